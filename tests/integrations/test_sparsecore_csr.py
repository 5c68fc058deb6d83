"""`sparsecore_csr` against jax-tpu-embedding's own C++ preprocessing of the same ids, and decoded independently.

jax-tpu-embedding (jte) leaves its buffers uninitialized after each slice's
last row pointer, so only the row pointers and each slice's used region
`[0, round_up(row_pointers[num_sc - 1], 8))` are compared. Its C++ aborts
the process when a partition overflows, so `sparsecore_csr` (which raises)
always runs first.
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import numpy as np
import pytest

from conftest import importorfail, make_mesh

importorfail("jax_tpu_embedding")
embedding = importorfail("jax_tpu_embedding.sparsecore.lib.nn.embedding")
embedding_spec = importorfail("jax_tpu_embedding.sparsecore.lib.nn.embedding_spec")
table_stacking = importorfail("jax_tpu_embedding.sparsecore.lib.nn.table_stacking")

import sparse_embed as se  # noqa: E402
from sparse_embed.core.sparsecore.batch import PAD_ID, CsrBatch  # noqa: E402
from sparse_embed.integrations.jte import sparsecore_csr  # noqa: E402

VOCABS = {"a": 37, "b": 70, "c": 19, "d": 45, "s": 23}
DIMS = {"a": 8, "b": 16, "c": 8, "d": 8, "s": 8}
# feature -> (table, batch in multiples of num_sc, max_sequence_length); listed out of name order on purpose
FEATURES = {"f_a2": ("a", 1, 0), "f_a1": ("a", 2, 0), "f_b": ("b", 3, 0), "f_c": ("c", 1, 0), "f_d": ("d", 2, 0),
            "f_s": ("s", 1, 3)}
STACKINGS = {"unstacked": [["a"], ["b"], ["c"], ["d"], ["s"]], "stacked": [["a", "b", "c"], ["d", "s"]]}
WIDTH = 4  # most ids of a pooled sample
FORMATS = ["dense", "dense_full", "ragged", "weighted_dense", "weighted_ragged"]
CONFIGS = [(1, 2), (1, 4), (4, 2), (4, 4)]  # (devices, SparseCores per device)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _features(combiner: str, num_sc: int) -> dict[str, se.FeatureSpec]:
    tables = {n: se.TableSpec(n, VOCABS[n], DIMS[n], combiner=combiner) for n in VOCABS}
    return {f: se.FeatureSpec(f, tables[t], k * num_sc, L) for f, (t, k, L) in FEATURES.items()}


def _samples(rng: np.random.Generator, f: se.FeatureSpec, full: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each sample's (ids, weights > 0).

    Pooled samples repeat ids (sample 0 and every third one); sequences may
    overrun L; `full`: every sample has the most ids.
    """
    L, V = f.max_sequence_length, f.table.vocabulary_size
    width = L or WIDTH
    lengths = np.full(f.batch_size, width) if full else rng.integers(0, width + (2 if L else 1), f.batch_size)
    lengths[0] = width
    rows = [rng.integers(0, V, n).astype(np.int32) for n in lengths]
    if not L:
        rows[0][:4] = 5, V - 1, 5, 5
        for r in rows[3::3]:
            r[-1:] = r[:1]
    return [(r, rng.uniform(0.5, 2.0, r.size).astype(np.float32)) for r in rows]


def _objects(rows: list) -> np.ndarray:
    """A 1-D object array of rows (even when they have equal lengths)."""
    out = np.empty(len(rows), dtype=object)
    out[:] = rows
    return out


def _inputs(rng: np.random.Generator, fmt: str, f: se.FeatureSpec, samples: list) -> tuple[Any, Any, Any, Any]:
    """`(ours, our weights, jte's, jte's weights)` of one feature's samples in format `fmt`.

    jte has no -1 padding and no sequences: padded dense input is ragged
    for it, and a sequence of batch B and length L is B * L samples of at
    most one id.
    """
    ids, w = [r for r, _ in samples], [x for _, x in samples]
    L, weighted = f.max_sequence_length, fmt.startswith("weighted")
    if fmt in ("dense", "weighted_dense"):  # ids at random columns, -1 elsewhere (sequences get holes)
        ours = np.full((len(ids), L or WIDTH), -1, np.int32)
        dense_w = np.zeros(ours.shape, np.float32)
        for row, row_w, r, x in zip(ours, dense_w, ids, w):
            cols = np.sort(rng.choice(row.size, min(r.size, row.size), replace=False))
            row[cols], row_w[cols] = r[: cols.size], x[: cols.size]
        ids, w = [row[row != -1] for row in ours], [x[row != -1] for row, x in zip(ours, dense_w)]
        positions, our_w = [np.flatnonzero(row != -1) for row in ours], dense_w if weighted else None
    else:
        ours, positions = ids, [np.arange(r.size) for r in ids]
        our_w = w if weighted else None
        if fmt == "dense_full":
            ours = np.stack(ids)
        elif f.table.name != "a":  # the other ragged form: (values, row_lengths)
            lengths = np.array([r.size for r in ids])
            ours = (np.concatenate(ids), lengths)
            our_w = None if our_w is None else (np.concatenate(w), lengths)
    if L:  # position j of sample i -> sample i * L + j
        seq, seq_w = [ids[0][:0]] * (len(ids) * L), [w[0][:0]] * (len(ids) * L)
        for i, (r, x, pos) in enumerate(zip(ids, w, positions)):
            for k, j in enumerate(pos[:L]):
                seq[i * L + j], seq_w[i * L + j] = r[k : k + 1], x[k : k + 1]
        ids, w = seq, seq_w
    if fmt == "dense_full":
        return ours, None, np.stack(ids), None
    return ours, our_w, _objects(ids), _objects(w) if weighted else None


def _jte_specs(features: dict[str, se.FeatureSpec], groups: list[list[str]], G: int, S: int, limit: int,
               stack_limits: dict[str, int] | None = None) -> dict:
    """jte's prepared FeatureSpecs for the same features (a sequence feature: B * L samples of one id).

    `limit`: every table's max ids per partition; `stack_limits`: a stack's, if given (else jte's default).
    """
    stack_of = {t: "_".join(g) for g in groups for t in g}
    tables = {t.name: embedding_spec.TableSpec(
        name=t.name, vocabulary_size=t.vocabulary_size, embedding_dim=t.embedding_dim,
        initializer=jax.nn.initializers.zeros, optimizer=embedding_spec.SGDOptimizerSpec(), combiner=t.combiner,
        max_ids_per_partition=(stack_limits or {}).get(stack_of[t.name], limit),
        max_unique_ids_per_partition=(stack_limits or {}).get(stack_of[t.name], limit))
        for t in (f.table for f in features.values())}
    specs = {}
    for f in features.values():
        n = f.batch_size * max(f.max_sequence_length, 1)
        specs[f.name] = embedding_spec.FeatureSpec(name=f.name, table_spec=tables[f.table.name],
                                                   input_shape=[n, 1 if f.is_sequence else WIDTH],
                                                   output_shape=[n, f.table.embedding_dim])
    for g in groups:
        if len(g) > 1:
            kw = {} if stack_limits is None else {
                "stack_to_max_ids_per_partition": lambda name, _: stack_limits[name],
                "stack_to_max_unique_ids_per_partition": lambda name, _: stack_limits[name]}
            table_stacking.stack_tables(specs, g, global_device_count=G, num_sc_per_device=S, stack_name="_".join(g),
                                        **kw)
    embedding.prepare_feature_specs_for_training(specs, global_device_count=G, num_sc_per_device=S)
    return specs


def _assert_same(ours: CsrBatch, theirs: tuple, num_slices: int, num_sc: int) -> None:
    """Row pointers in full; ids, samples and gains in each slice's used region."""
    rp, eid, sid, gain = (np.asarray(x) for x in theirs)
    assert [a.shape for a in ours] == [rp.shape, eid.shape, sid.shape, gain.shape]
    np.testing.assert_array_equal(ours.row_pointers, rp)
    size = eid.size // num_slices
    for k, ends in enumerate(rp.reshape(num_slices, -1)):
        used = slice(k * size, k * size + _round_up(int(ends[num_sc - 1]), 8))
        np.testing.assert_array_equal(ours.embedding_ids[used], eid[used])
        np.testing.assert_array_equal(ours.sample_ids[used], sid[used])
        np.testing.assert_array_equal(ours.gains[used], gain[used])


@pytest.mark.parametrize("stacking", sorted(STACKINGS))
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("G,S", CONFIGS, ids=[f"{g}x{s}" for g, s in CONFIGS])
def test_matches_jax_tpu_embedding(G, S, fmt, combiner, stacking):
    num_sc, groups = G * S, STACKINGS[stacking]
    limit = 256 if stacking == "stacked" else 64  # jte gives a stack of several tables 256 whatever its tables say
    features = _features(combiner, num_sc)
    rng = np.random.default_rng(0)
    inputs = {f: _inputs(rng, fmt, spec, _samples(rng, spec, fmt == "dense_full")) for f, spec in features.items()}
    layout = se.jte.jte_layout({f.table.name: f.table for f in features.values()}, num_sc, stacking=groups, rotation=S)
    ours = sparsecore_csr(features, layout, {f: x[0] for f, x in inputs.items()},
                          {f: x[1] for f, x in inputs.items() if x[1] is not None},
                          num_devices=G, sc_per_device=S, max_ids_per_partition=limit)
    specs = _jte_specs(features, groups, G, S, limit)
    jte_tables = {f.table_spec.name: f.table_spec for f in specs.values()}
    by_name = operator.attrgetter("name")
    assert sorted(se.jte.jte_layout_from_specs(jte_tables.values(), num_sc), key=by_name) == sorted(layout, key=by_name)
    pre, _ = embedding.preprocess_sparse_dense_matmul_input(
        {f: x[2] for f, x in inputs.items()}, {f: x[3] for f, x in inputs.items()} if "weighted" in fmt else None,
        specs, local_device_count=G, global_device_count=G, num_sc_per_device=S)
    assert sorted(ours) == sorted(pre.lhs_row_pointers) == sorted("_".join(g) for g in groups)
    for stack, csr in ours.items():
        assert (csr.row_pointers > 0).any()
        _assert_same(csr, (pre.lhs_row_pointers[stack], pre.lhs_embedding_ids[stack], pre.lhs_sample_ids[stack],
                           pre.lhs_gains[stack]), num_sc, num_sc)


@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_a_sample_whose_divisor_is_zero_gets_gains_zero_where_jax_tpu_embedding_divides_by_zero(combiner):
    """The one difference from jte's output (docs/sparsecore.md): sample 1's weights are all 0, so its divisor is 0."""
    t = se.TableSpec("t", 40, 8, combiner=combiner)
    features = {"f": se.FeatureSpec("f", t, 4)}
    ids = _objects([np.array([1, 7], np.int32), np.array([3, 9], np.int32), np.array([2], np.int32),
                    np.array([5, 6], np.int32)])
    w = _objects([np.array([1.0, 2.0], np.float32), np.zeros(2, np.float32), np.array([0.5], np.float32),
                  np.array([3.0, 1.0], np.float32)])
    ours = sparsecore_csr(features, se.jte.jte_layout({"t": t}, 2), {"f": list(ids)}, {"f": list(w)}, num_devices=1,
                          sc_per_device=2, max_ids_per_partition=64)["t"]
    specs = _jte_specs(features, [["t"]], 1, 2, 64)
    pre, _ = embedding.preprocess_sparse_dense_matmul_input({"f": ids}, {"f": w}, specs, local_device_count=1,
                                                            global_device_count=1, num_sc_per_device=2)
    theirs = pre.lhs_gains["t"]
    zero = (ours.sample_ids == 1) & (np.arange(ours.gains.size) < ours.gains.size // 2)  # slice 0's sample 1
    assert zero.sum() == 2 and (ours.gains[zero] == 0).all() and not np.isfinite(theirs[zero]).any()
    _assert_same(ours._replace(gains=np.where(zero, np.nan, ours.gains)),
                 (pre.lhs_row_pointers["t"], pre.lhs_embedding_ids["t"], pre.lhs_sample_ids["t"],
                  np.where(zero, np.nan, theirs)), 2, 2)


# ------------------------------------------------------------------ a SparseCore plan's own preprocessing
PLAN_STACKINGS = {"unstacked": None, "stacked": [["a", "c", "s"], ["d"], ["b"]]}  # a plan stacks equal dims


@pytest.mark.parametrize("stacking", sorted(PLAN_STACKINGS))
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("G,S", CONFIGS, ids=[f"{g}x{s}" for g, s in CONFIGS])
def test_a_sparsecore_plans_preprocess_matches_jax_tpu_embedding(G, S, fmt, combiner, stacking):
    """`preprocess` of a plan with `sparsecores=S` on G devices builds, in each batch, the CSR that jte's own C++
    preprocessing builds for the same features, stacking and ids (its limits set to the ones the plan chose)."""
    num_sc = G * S
    features = _features(combiner, num_sc)
    rng = np.random.default_rng(2)
    inputs = {f: _inputs(rng, fmt, spec, _samples(rng, spec, fmt == "dense_full")) for f, spec in features.items()}
    plan = se.plan(features, make_mesh(G), sparsecores=S, stacking=PLAN_STACKINGS[stacking])
    assert all(s.sparsecores == S for s in plan.stacks)
    batch, _ = se.preprocess(plan, {f: x[0] for f, x in inputs.items()},
                             {f: x[1] for f, x in inputs.items() if x[1] is not None})
    groups = [[p.table.name for p in s.tables] for s in plan.stacks]
    limits = {s.name: batch[s.name].csr.embedding_ids.shape[1] // S // num_sc for s in plan.stacks}
    specs = _jte_specs(features, groups, G, S, 0, limits)
    pre, _ = embedding.preprocess_sparse_dense_matmul_input(
        {f: x[2] for f, x in inputs.items()}, {f: x[3] for f, x in inputs.items()} if "weighted" in fmt else None,
        specs, local_device_count=G, global_device_count=G, num_sc_per_device=S)
    assert sorted(pre.lhs_row_pointers) == sorted(s.name for s in plan.stacks)
    for s in plan.stacks:
        ours = CsrBatch(*(np.asarray(x).reshape(-1) for x in batch[s.name].csr))
        assert (ours.row_pointers > 0).any()
        _assert_same(ours, (pre.lhs_row_pointers[s.name], pre.lhs_embedding_ids[s.name], pre.lhs_sample_ids[s.name],
                            pre.lhs_gains[s.name]), num_sc, num_sc)


def test_a_sparsecore_plans_tables_are_jax_tpu_embeddings_stacked_arrays():
    """The stacked arrays of a SparseCore plan hold every row where jte's layout has it (`to_jte`)."""
    features = _features("sum", 8)
    plan = se.plan(features, make_mesh(4), sparsecores=2, stacking=PLAN_STACKINGS["stacked"])
    tables = se.init_tables(plan, jax.random.key(3))
    layout = se.jte.jte_layout(plan.tables, 8, stacking=[[p.table.name for p in s.tables] for s in plan.stacks],
                           rotation=2)
    theirs = se.jte.to_jte(layout, se.unstack_tables(plan, tables), 8)
    for s in plan.stacks:
        ours = np.asarray(tables[s.name].table)
        real = ~np.isnan(theirs[s.name]).any(axis=1)  # jte pads with NaN; the plan with zeros
        assert ours.shape == theirs[s.name].shape and real.sum() == sum(p.table.vocabulary_size for p in s.tables)
        np.testing.assert_array_equal(ours[real], theirs[s.name][real])
        assert not ours[~real].any()


# ------------------------------------------------------------------ an independent decoding


def _decode(csr: CsrBatch, layout, features: list[se.FeatureSpec], num_sc: int) -> list[tuple]:
    """`(feature, sample, id, gain)` of every entry, read from the row pointers and the layout; checks the padding."""
    features = sorted(features, key=lambda f: f.name)
    rows = [f.batch_size * max(f.max_sequence_length, 1) // num_sc for f in features]
    offsets = np.cumsum([0] + rows)
    rp = csr.row_pointers.reshape(num_sc, -1)
    size = csr.embedding_ids.size // num_sc
    out = []
    for k in range(num_sc):
        eid, sid, gain = (a[k * size:(k + 1) * size] for a in csr[1:])
        start = 0
        for p in range(num_sc):
            end = int(rp[k, p])
            assert (eid[end:_round_up(end, 8)] == PAD_ID).all() and np.isnan(gain[end:_round_up(end, 8)]).all()
            keys = list(zip(eid[start:end], sid[start:end]))
            assert keys == sorted(set(keys))  # sorted by (embedding_id, sample_id), no repeats
            for e, s, g in zip(eid[start:end], sid[start:end], gain[start:end]):
                j = int(np.searchsorted(offsets, s, side="right")) - 1
                f = features[j]
                t = next(t for t in layout if t.name == f.table.name)
                assert t.row_offset_in_shard <= e < t.row_offset_in_shard + t.padded_vocab_size // num_sc
                natural = (e - t.row_offset_in_shard) * num_sc + (p - t.shard_rotation) % num_sc
                out.append((f.name, k * rows[j] + s - offsets[j], int(natural), float(g)))
            start = _round_up(end, 8)
        assert rp[k, num_sc:].tolist() == [_round_up(int(rp[k, num_sc - 1]), 8)] * (rp.shape[1] - num_sc)
    return out


def _reference(f: se.FeatureSpec, samples: list) -> list[tuple]:
    """`(feature, sample, id, gain)` of one feature's weighted samples: combiner gains, in-sample duplicates summed."""
    out = []
    L = f.max_sequence_length
    for i, (ids, w) in enumerate(samples):
        w = w.astype(np.float64)
        if L:  # one id per sample: its weight (sum), else 1 (the weights are > 0)
            out += [(f.name, i * L + j, int(v), float(x) if f.table.combiner == "sum" else 1.0)
                    for j, (v, x) in enumerate(zip(ids[:L], w[:L]))]
            continue
        denom = {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}[f.table.combiner]
        merged: dict[int, float] = {}
        for v, x in zip(ids, w):
            merged[int(v)] = merged.get(int(v), 0.0) + x / denom
        out += [(f.name, i, v, g) for v, g in merged.items()]
    return out


@pytest.mark.parametrize("stacking", sorted(STACKINGS))
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("G,S", [(1, 2), (4, 4)], ids=["1x2", "4x4"])
def test_decodes_to_the_input(G, S, combiner, stacking):
    num_sc = G * S
    features = _features(combiner, num_sc)
    rng = np.random.default_rng(1)
    samples = {f: _samples(rng, spec, False) for f, spec in features.items()}
    layout = se.jte.jte_layout({f.table.name: f.table for f in features.values()}, num_sc, stacking=STACKINGS[stacking],
                           rotation=S)
    out = sparsecore_csr(features, layout, {f: [r for r, _ in s] for f, s in samples.items()},
                         {f: [w for _, w in s] for f, s in samples.items()},
                         num_devices=G, sc_per_device=S, max_ids_per_partition=64)
    decoded = []
    for stack, csr in out.items():
        decoded += _decode(csr, layout, [f for f in features.values()
                                         if next(t for t in layout if t.name == f.table.name).stack_name == stack],
                           num_sc)
    expected = [e for f, spec in features.items() for e in _reference(spec, samples[f])]
    assert sorted(d[:3] for d in decoded) == sorted(e[:3] for e in expected)
    np.testing.assert_allclose([d[3] for d in sorted(decoded)], [e[3] for e in sorted(expected)], rtol=1e-6)


# ------------------------------------------------------------------ bad input


def test_partition_over_the_limit_is_a_value_error():
    t = se.TableSpec("t", 64, 8, combiner="sum")
    layout = se.jte.jte_layout({"t": t}, 2)
    f = {"f": se.FeatureSpec("f", t, 4)}
    # 2 slices of 2 samples; the even ids go to partition 0: slice 0 sends it 5 ids
    ids = {"f": np.array([[0, 2, 4, 6], [8, -1, -1, -1], [1, -1, -1, -1], [3, -1, -1, -1]])}
    with pytest.raises(ValueError, match=r"Stack 't'.*max_ids_per_partition=4"):
        sparsecore_csr(f, layout, ids, num_devices=1, sc_per_device=2, max_ids_per_partition=4)
    for bad, what in ((2.5, "max_ids_per_partition"), (None, "max_ids_per_partition"), (0, "max_ids_per_partition"),
                      ("8", "max_unique_ids_per_partition")):  # 2.5 and None were numpy / comparison TypeErrors
        kw = {"max_ids_per_partition": bad} if what == "max_ids_per_partition" else {
            "max_ids_per_partition": 8, what: bad}
        with pytest.raises(ValueError, match=f"{what} must be a positive int, got {bad!r}"):
            sparsecore_csr(f, layout, ids, num_devices=1, sc_per_device=2, **kw)
    same = {"f": np.array([[0, 2], [0, 2], [1, -1], [1, -1]])}  # slice 0 -> partition 0: 4 entries, 2 distinct ids
    with pytest.raises(ValueError, match=r"Stack 't'.*max_unique_ids_per_partition=1"):
        sparsecore_csr(f, layout, same, num_devices=1, sc_per_device=2, max_ids_per_partition=4,
                       max_unique_ids_per_partition=1)
    assert sparsecore_csr(f, layout, same, num_devices=1, sc_per_device=2, max_ids_per_partition=4,
                          max_unique_ids_per_partition=2)["t"].row_pointers[:2].tolist() == [4, 8]


@pytest.mark.parametrize("ids,weights", [
    ({"f": np.array([[1, 19], [2, -1]])}, None),  # id == vocabulary_size
    ({"f": np.array([[1, -2], [2, -1]])}, None),  # negative, not -1
    ({"f": [np.array([1]), np.array([-1])]}, None),  # -1 is not padding in ragged input
    ({"f": [np.array([1]), np.array([3])]}, {"f": [np.array([1.0]), np.array([np.nan])]}),  # non-finite weight
    ({"s": [np.array([1, 2, 3, 4, 99]), np.array([3])]}, None),  # past max_sequence_length, still checked
], ids=["too_large", "negative", "ragged_minus_one", "nan_weight", "sequence_tail"])
def test_bad_ids_give_preprocess_errors(ids, weights):
    t = se.TableSpec("t", 19, 8)
    features = {"f": se.FeatureSpec("f", t, 2), "s": se.FeatureSpec("s", t, 2, max_sequence_length=2)}
    ids = {"f": np.array([[1], [2]]), "s": np.array([[3, 4], [5, -1]]), **ids}
    weights = weights or {}
    with pytest.raises(ValueError) as theirs:
        se.preprocess(se.plan(features, make_mesh(1)), ids, weights, device_put=False)
    with pytest.raises(ValueError) as ours:
        sparsecore_csr(features, se.jte.jte_layout({"t": t}, 2), ids, weights, num_devices=1, sc_per_device=2,
                       max_ids_per_partition=64)
    assert str(ours.value) == str(theirs.value)


def test_features_and_layout_must_agree():
    t = se.TableSpec("t", 19, 8)
    f = {"f": se.FeatureSpec("f", t, 4)}
    ids = {"f": np.array([[1], [2], [3], [4]])}
    kw = dict(num_devices=1, sc_per_device=2, max_ids_per_partition=64)
    with pytest.raises(ValueError, match=r"the layout has no tables \['t'\]"):
        sparsecore_csr(f, se.jte.jte_layout({"u": se.TableSpec("u", 19, 8)}, 2), ids, **kw)
    with pytest.raises(ValueError, match=r"no ids for features \['f'\]"):
        sparsecore_csr(f, se.jte.jte_layout({"t": t}, 2), {}, **kw)
    with pytest.raises(ValueError, match="table 't' has 19 rows, its layout 20"):
        sparsecore_csr(f, se.jte.jte_layout({"t": se.TableSpec("t", 20, 8)}, 2), ids, **kw)
    with pytest.raises(ValueError, match="4 samples are not a multiple of 8 SparseCores"):
        sparsecore_csr(f, se.jte.jte_layout({"t": t}, 8), ids, **{**kw, "num_devices": 4})
    with pytest.raises(ValueError, match="sparsecore_csr: feature key 'g' differs from its FeatureSpec name 'f'"):
        sparsecore_csr({"g": f["f"]}, se.jte.jte_layout({"t": t}, 2), {"g": ids["f"]}, **kw)  # was a KeyError 'f'
    raw = se.TableSpec("t", 19, 8, dynamic=se.Dynamic())
    with pytest.raises(ValueError, match="keyed by raw ids"):
        sparsecore_csr({"f": se.FeatureSpec("f", raw, 4)}, se.jte.jte_layout({"t": raw}, 2), ids, **kw)


def test_ids_or_weights_of_unknown_features_are_refused_as_preprocess_refuses_them():
    """A misspelt weights key was ignored: the feature's gains came out unweighted (1 / n under mean)."""
    t = se.TableSpec("t", 19, 8, combiner="mean")
    f = {"f": se.FeatureSpec("f", t, 2)}
    ids, w = {"f": np.array([[1, 3], [2, -1]])}, np.array([[3.0, 1.0], [2.0, 0.0]], np.float32)
    kw = dict(num_devices=1, sc_per_device=2, max_ids_per_partition=64)
    layout = se.jte.jte_layout({"t": t}, 2)
    gains = sparsecore_csr(f, layout, ids, {"f": w}, **kw)["t"].gains
    np.testing.assert_array_equal(np.sort(gains[~np.isnan(gains)]), [0.25, 0.75, 1.0])  # 3 / 4, 1 / 4; 2 / 2
    with pytest.raises(ValueError, match=r"sparsecore_csr: weights has unknown features \['g'\]; the features are "
                                         r"\['f'\]\."):
        sparsecore_csr(f, layout, ids, {"g": w}, **kw)
    with pytest.raises(ValueError, match=r"sparsecore_csr: ids has unknown features \['g'\]"):
        sparsecore_csr(f, layout, {**ids, "g": ids["f"]}, **kw)
    for args, what, got in (((f, layout, ids["f"]), "ids", "ndarray"),  # was "unhashable type: 'numpy.ndarray'"
                            ((f, layout, ids, [w]), "weights", "list"),  # was "'list' object has no attribute 'get'"
                            ((list(f.values()), layout, ids), "features", "list")):
        with pytest.raises(TypeError, match=f"sparsecore_csr: {what} must be a mapping keyed by feature name, "
                                            f"got {got}"):
            sparsecore_csr(*args, **kw)
