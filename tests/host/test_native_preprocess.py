"""preprocess's C kernels (sparse_embed/host/_native.c) against its numpy path, bit for bit.

Both paths get the same inputs: random plans (stacking, combiners, sequence
features, 1 to 8 devices, also non-power-of-2 meshes), every id format and
dtype, capacity drops, and bad input, which must give the same error
message. The numpy path is itself checked against tests/reference.py by
test_preprocess.py, which runs every test on both paths.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import chex
import numpy as np
import pytest

import sparse_embed as se
from sparse_embed.host import native
import reference as ref
from conftest import make_mesh

NATIVE = native.extension()
pytestmark = pytest.mark.usefixtures("needs_native_preprocess")  # a skip, or under CI a failure


def _both(monkeypatch, fn):
    """`fn()` on the native path, then on the numpy path; a ValueError/TypeError becomes its message."""
    out = []
    for switch in ("1", "0"):
        monkeypatch.setenv(native.ENV, switch)
        try:
            out.append(fn())
        except (ValueError, TypeError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def _assert_same(native, numpy_, error: bool = False):
    """Equal batches (floats compared as bits) and Stats, or (`error`) equal error messages."""
    if error:
        assert isinstance(native, str) and native == numpy_, (native, numpy_)
        return
    assert not isinstance(native, str) and not isinstance(numpy_, str), (native, numpy_)
    (batch, stats), (want, want_stats) = native, numpy_
    chex.assert_trees_all_equal_shapes_and_dtypes(batch, want)
    bits = lambda tree: {k: [np.asarray(x).view(np.int32) for x in coo if x is not None] for k, coo in tree.items()}
    chex.assert_trees_all_equal(bits(batch), bits(want))
    assert stats == want_stats


def _random_case(rng, n: int):
    """(plan kwargs, features, {name: (ids, weights)}) with every format, dtype and combiner."""
    tables = [se.TableSpec(f"t{i}", int(rng.choice([1, 7, 40, 1000])), 4,
                           combiner=str(rng.choice(["sum", "mean", "sqrtn"]))) for i in range(rng.integers(1, 4))]
    feats, rendered = {}, {}
    for i in range(rng.integers(1, 5)):
        fmt = str(rng.choice(["dense", "1d", "list", "pair"]))
        t = tables[rng.integers(len(tables))]
        seq = 0 if fmt == "1d" else int(rng.choice([0, 0, 2, 3]))
        f = feats[f"f{i}"] = se.FeatureSpec(f"f{i}", t, n * int(rng.integers(1, 4)), max_sequence_length=seq)
        samples = ref.random_samples(rng, f.batch_size, t.vocabulary_size, 1 if fmt == "1d" else 6,
                                     weighted=bool(rng.integers(2)), id_pool=int(rng.choice([3, 10**6])))
        ids, w = ref.render(samples, fmt)
        dtype = rng.choice([np.int32, np.int64])
        ids = ((ids[0].astype(dtype), ids[1]) if fmt == "pair" else
               [r.astype(dtype) for r in ids] if fmt == "list" else ids.astype(dtype))
        rendered[f.name] = ids, (w if rng.integers(3) else None)
    placement = str(rng.choice(["row", "table", "replicated", "mixed"]))
    if placement == "mixed":  # every table its own placement
        placement = {t.name: str(rng.choice(["row", "table", "replicated"])) for t in tables if t.name in
                     {f.table.name for f in feats.values()}}
    kw = dict(stacking=[None, "auto"][rng.integers(2)], on_overflow="drop", placement=placement)
    if rng.integers(2):
        kw["capacity"] = 8  # often overflows: drops must match too
    return kw, feats, rendered


@pytest.mark.parametrize("n", [1, 2, 3, 6, 8])
@pytest.mark.parametrize("seed", range(12))
def test_random_batches_match_numpy_bit_for_bit(monkeypatch, n, seed):
    kw, feats, rendered = _random_case(np.random.default_rng(1000 * n + seed), n)
    ids = {k: v[0] for k, v in rendered.items()}
    weights = {k: v[1] for k, v in rendered.items() if v[1] is not None}
    _assert_same(*_both(monkeypatch, lambda: se.preprocess(se.plan(feats, make_mesh(n), **kw), ids, weights,
                                                           device_put=False)))


@pytest.mark.parametrize("n", [1, 8])
def test_large_stack_matches_numpy(monkeypatch, n):
    """Multi-word bitsets, many partitions, int32 and int64 ids, a mean table with padding in the middle."""
    rng = np.random.default_rng(n)
    feats = {f"f{i}": se.FeatureSpec(f"f{i}", se.TableSpec(f"t{i}", 100_000, 8, combiner=c), 512)
             for i, c in enumerate(["sum", "mean", "sqrtn", "sum"])}
    ids = {name: rng.integers(-1, 100_000, (512, 20), dtype=[np.int32, np.int64][i % 2])
           for i, name in enumerate(feats)}
    weights = {name: rng.uniform(0, 2, (512, 20)).astype(np.float32) for name in feats}
    _assert_same(*_both(monkeypatch, lambda: se.preprocess(se.plan(feats, make_mesh(n)), ids, weights,
                                                           device_put=False)))


@pytest.fixture
def plan8(mesh8):
    t = se.TableSpec("tbl", 20, 4, combiner="mean")
    u = se.TableSpec("other", 30, 4, combiner="sum")
    feats = {"f": se.FeatureSpec("f", t, 8), "g": se.FeatureSpec("g", t, 8, max_sequence_length=2),
             "h": se.FeatureSpec("h", u, 8)}
    return lambda **kw: se.plan(feats, mesh8, **kw)


GOOD = {"f": np.ones((8, 2), np.int32), "g": [np.array([1, 2, 3])] * 8, "h": (np.arange(8), np.ones(8, int))}
NAN_AT_5 = np.ones((8, 2), np.float32)
NAN_AT_5[5, 1] = np.nan
BAD = {
    "dense_past_vocab": ({"f": np.full((8, 2), 20)}, None),
    "dense_negative": ({"f": np.array([[1, -2]] * 8)}, None),
    "int32_min": ({"f": np.full((8, 2), np.iinfo(np.int32).min, np.int32)}, None),
    "int64_huge": ({"f": np.full((8, 2), 2**40)}, None),
    "1d_negative": ({"f": np.array([1] * 7 + [-5])}, None),
    "list_minus_one": ({"g": [np.array([1, -1])] * 8}, None),
    "list_past_vocab": ({"g": [np.array([1])] * 7 + [np.array([3, 20])]}, None),
    "pair_past_vocab": ({"h": (np.r_[np.zeros(7, int), 30], np.ones(8, int))}, None),
    "float_ids": ({"f": np.ones((8, 2), np.float32)}, None),
    "bool_ids": ({"f": np.ones((8, 2), bool)}, None),
    "list_float_rows": ({"g": [np.array([1.5])] * 8}, None),
    "list_mixed_rows": ({"g": [np.array([1], np.int32)] * 4 + [np.array([1.0])] * 4}, None),
    "nan_weight": ({}, {"f": NAN_AT_5}),
    "inf_weight_list": ({}, {"g": [np.ones(3, np.float32)] * 6 + [np.array([1, np.inf, 1], np.float32)] * 2}),
    "nan_weight_pair": ({}, {"h": (np.r_[np.ones(6), np.nan, 1.0], np.ones(8, int))}),
    "bad_id_before_bad_weight": ({"f": np.r_[np.ones((7, 2), int), [[1, 99]]]}, {"f": NAN_AT_5}),
    "first_feature_wins": ({"f": np.full((8, 2), 20), "h": (np.full(8, -3), np.ones(8, int))}, None),
    "weight_rows_differ": ({}, {"g": [np.ones(3)] * 7 + [np.ones(2)]}),
    "weights_structure": ({}, {"g": np.ones((8, 3))}),
    "wrong_batch": ({"g": [np.array([1])] * 9}, None),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gives_the_same_error(monkeypatch, plan8, case):
    ids, weights = BAD[case]
    native, numpy_ = _both(monkeypatch, lambda: se.preprocess(plan8(), {**GOOD, **ids}, weights, device_put=False))
    _assert_same(native, numpy_, error=True)
    assert native.startswith("FeatureInputError: Feature '"), native  # (a ValueError)


@pytest.mark.parametrize("weights", [None, "nan_on_padding"])
def test_accepted_odd_input_matches_numpy(monkeypatch, plan8, weights):
    """-1 inside dense rows, NaN weights on padding, float64 and int weights, rows of mixed int dtypes."""
    f = np.array([[3, -1], [-1, -1], [-1, 4]] + [[5, 6]] * 5, np.int64)
    g = [np.array([1, 2], np.int32), np.array([], np.int64), [4, 5, 6]] + [np.array([7], np.int16)] * 5
    w = None
    if weights:
        w = {"f": np.where(f == -1, np.nan, 0.5).astype(np.float64), "g": [np.ones(len(r), int) for r in g]}
    _assert_same(*_both(monkeypatch, lambda: se.preprocess(plan8(), {**GOOD, "f": f, "g": g}, w, device_put=False)))


@pytest.mark.parametrize("policy", ["error", "drop"])
def test_overflow_matches_numpy(monkeypatch, plan8, policy):
    ids = {**GOOD, "f": np.tile([0, 8, 16], (8, 4)), "g": [np.array([0, 8, 16])] * 8}  # 14 ids on shard 0
    native, numpy_ = _both(monkeypatch, lambda: se.preprocess(plan8(capacity=8, on_overflow=policy, stacking=None), ids,
                                                              device_put=False))
    _assert_same(native, numpy_, error=policy == "error")
    assert "has 14 ids but the capacity is 8" in native if policy == "error" else native[1].dropped_ids["tbl"] == 8 * 6


def test_preprocess_in_threads(plan8):
    """The kernels release the GIL; concurrent calls give what a lone call gives."""
    plan = plan8()
    want, _ = se.preprocess(plan, GOOD, device_put=False)
    results = []
    threads = [threading.Thread(target=lambda: results.append(se.preprocess(plan, GOOD, device_put=False)[0]))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    for got in results:
        chex.assert_trees_all_equal(got, want)


# ---------------------------------------------------------------- the kernels' own checks


def _feature(ids, weights=None, offsets=None, batch=4, width=2, vocab=10, spd=4, shard=-1, sc=0, sc_rows=0,
             rotation=0):
    return (ids, weights, offsets, batch, width, vocab, 0, 0, spd, 0, 0, shard, sc, sc_rows, rotation, 0)


@pytest.mark.parametrize("ids, error", [
    (np.zeros(8, np.float64), TypeError),  # not integers
    (np.zeros(8, np.int16), TypeError),
    (np.zeros((8, 2), np.int32)[:, 0], ValueError),  # not contiguous
    (np.zeros(6, np.int32), ValueError),  # not [batch, width]
])
def test_kernels_reject_bad_buffers(ids, error):
    with pytest.raises(error):
        NATIVE.count([_feature(ids)], 1, 1, 10, np.zeros(1, np.int64))


@pytest.mark.parametrize("feature", [
    _feature(np.zeros(8, np.int32), weights=np.ones(7, np.float32)),  # weights and ids differ
    _feature(np.zeros(8, np.int32), weights=np.ones(8, np.float64)),
    _feature(np.zeros(8, np.int32), offsets=np.array([0, 2, 4, 6, 9])),  # past the ids
    _feature(np.zeros(8, np.int32), offsets=np.array([0, 5, 4, 6, 8])),  # decreasing
    _feature(np.zeros(8, np.int32), vocab=11),  # the table does not fit the stack
    _feature(np.zeros(8, np.int32), spd=5),  # more samples than given
    _feature(np.zeros(8, np.int32), shard=1),  # the table's one shard is not a device
    _feature(np.zeros(8, np.int32), shard=-2),
    _feature(np.zeros(8, np.int32), sc=2, sc_rows=3),  # SparseCores of 3 rows do not tile the stack's 10
    _feature(np.zeros(8, np.int32), sc=2, sc_rows=5, rotation=2),  # 2 SparseCores: no rotation 2
    _feature(np.zeros(8, np.int32), sc=2, sc_rows=5, shard=0),  # SparseCores shard rows: no whole-table shard
    _feature(np.zeros(8, np.int32), spd=3, sc=2, sc_rows=5),  # 3 samples per device do not split over 2 slices
])
def test_kernels_reject_inconsistent_features(feature):
    NATIVE.count([_feature(np.zeros(8, np.int32))], 1, 1, 10, np.zeros(1, np.int64))  # the unchanged one is fine
    with pytest.raises((ValueError, TypeError)):
        NATIVE.count([feature], 1, 1, 10, np.zeros(1, np.int64))


def test_kernels_check_outputs_and_ids():
    feat = _feature(np.zeros(8, np.int32))
    with pytest.raises(ValueError, match="devices \\* shards \\* cap"):
        NATIVE.fill([feat], 1, 1, 10, 8, 4, np.empty(7, np.int32), np.empty(7, np.int32), np.empty(7, np.float32))
    with pytest.raises(TypeError):
        NATIVE.fill([feat], 1, 1, 10, 8, 4, np.empty(8, np.int64), np.empty(8, np.int32), np.empty(8, np.float32))
    with pytest.raises(ValueError, match="counts"):
        NATIVE.count([_feature(np.zeros(8, np.int32), spd=2)], 2, 1, 10, np.zeros(1, np.int64))
    bad = _feature(np.full(8, 10, np.int32))  # not validated: out of range must not be written anywhere
    with pytest.raises(RuntimeError, match="out of range"):
        NATIVE.count([bad], 1, 1, 10, np.zeros(1, np.int64))
    with pytest.raises(RuntimeError, match="out of range"):
        NATIVE.fill([bad], 1, 1, 10, 8, 4, np.empty(8, np.int32), np.empty(8, np.int32), np.empty(8, np.float32))


def test_concat_rows():
    rows = [np.array([1, 2], np.int32), np.array([], np.int32), np.array([3], np.int32)]
    fmt, data, lengths = NATIVE.concat_rows(rows, "ilq")
    np.testing.assert_array_equal(np.frombuffer(data, fmt), [1, 2, 3])
    np.testing.assert_array_equal(np.frombuffer(lengths, np.int64), [2, 0, 1])
    for other in ([np.array([1], np.int32), np.array([1], np.int64)], [[1, 2]], [np.ones((2, 2), np.int32)],
                  [np.arange(4, dtype=np.int32)[::2]], [np.ones(2, np.float32)], [np.int32(1)]):
        assert NATIVE.concat_rows(other, "ilq") is None


def test_env_var_forces_the_numpy_path():
    code = "from sparse_embed.host import native; print(native.extension())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SPARSE_EMBED_NATIVE": "0"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


@pytest.mark.parametrize("n_dev, capacity", [(1, None), (2, None), (8, None), (2, 8), (3, 16), (1, 8)])
def test_raw_id_partition_is_the_same_in_c(monkeypatch, n_dev, capacity):
    """Raw 64-bit ids: owner shards, first-occurrence numbering, keys, drops and stats, C = numpy, bit for bit."""
    rng = np.random.default_rng(n_dev)
    raw = se.TableSpec("raw", 30, 4, combiner="sqrtn", dynamic=se.Dynamic())
    feats = [se.FeatureSpec("a", raw, 24), se.FeatureSpec("s", raw, 24, max_sequence_length=3)]
    plan = se.plan(feats, make_mesh(n_dev), capacity=capacity, on_overflow="drop")
    pool = np.concatenate([rng.integers(0, 2**63 - 1, 40, dtype=np.int64), [0, 2**63 - 1]])
    dense = pool[rng.integers(0, pool.size, (24, 4))]
    dense[rng.random((24, 4)) < 0.3] = -1
    rows = [pool[rng.integers(0, pool.size, rng.integers(0, 6))].astype(np.uint64) for _ in range(24)]
    weights = rng.uniform(0.5, 2, (24, 4)).astype(np.float32)
    got = _both(monkeypatch, lambda: se.preprocess(plan, {"a": dense, "s": rows}, {"a": weights}, device_put=False))
    _assert_same(*got)
    assert got[0][0]["raw"].keys is not None
    if capacity:
        assert got[0][1].dropped_ids["raw"] > 0
    bad = [np.array([-3, 5])] + rows[1:]
    _assert_same(*_both(monkeypatch, lambda: se.preprocess(plan, {"a": dense, "s": bad}, device_put=False)), error=True)
