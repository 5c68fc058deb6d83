"""serving_lookup equals the training lookup for every combiner and format; OOV policies; jax.export."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparse_embed as se
import reference as ref
from conftest import make_mesh

B = 16


def _coo(samples):
    idx = np.array([[b, j] for b, s in enumerate(samples) for j in range(len(s))], np.int64).reshape(-1, 2)
    vals = np.array([i for s in samples for i, _ in s], np.int64)
    w = np.array([x for s in samples for _, x in s], np.float32)
    shape = (len(samples), max([len(s) for s in samples] + [1]))
    return (idx, vals, shape), (idx, w, shape)


def _render(samples, fmt):
    return _coo(samples) if fmt == "coo" else ref.render(samples, fmt)


def _setup(fmt, weighted, seq_len=0, max_norm=None, seed=0):
    rng = np.random.default_rng(seed)
    feats, samples = {}, {}
    for combiner in ("sum", "mean", "sqrtn"):
        t = se.TableSpec(f"t_{combiner}", 40 + len(combiner), 8, combiner=combiner, max_norm=max_norm)
        feats[f"f_{combiner}"] = se.FeatureSpec(f"f_{combiner}", t, B, max_sequence_length=seq_len)
        s = ref.random_samples(rng, B, t.vocabulary_size, 1 if fmt == "1d" else 5, weighted=weighted)
        s[2] = []
        samples[f"f_{combiner}"] = s
    rendered = {n: _render(s, fmt) for n, s in samples.items()}
    ids = {n: r[0] for n, r in rendered.items()}
    weights = {n: r[1] for n, r in rendered.items()} if weighted else None
    return feats, samples, ids, weights


@pytest.mark.parametrize("fmt", ["dense", "1d", "list", "pair", "coo"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("seq_len, max_norm", [(0, 0.4), (3, None)], ids=["pooled_max_norm", "sequence"])
def test_serving_equals_training_lookup_and_numpy(fmt, weighted, seq_len, max_norm):
    feats, samples, ids, weights = _setup(fmt, weighted, seq_len, max_norm)
    plan = se.plan(feats, make_mesh(2))
    state = se.init_tables(plan, jax.random.key(0))
    arrays = se.unstack_tables(plan, state)
    train_ids = ids if fmt != "coo" else {n: ref.render(s, "list")[0] for n, s in samples.items()}
    train_w = None if not weighted else (weights if fmt != "coo" else {n: ref.render(s, "list")[1] for n, s in samples.items()})
    batch, _ = se.preprocess(plan, train_ids, train_w)
    want = se.lookup(plan, batch, state)
    got = jax.jit(lambda t, i, w: se.serving_lookup(feats, t, i, w))(arrays, ids, weights)
    for name, f in feats.items():
        assert got[name].shape == f.output_shape and got[name].dtype == jnp.float32
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6, err_msg=name)
        numpy = ref.lookup(arrays[f.table.name], samples[name], combiner=f.table.combiner, seq_len=seq_len,
                           max_norm=max_norm)
        np.testing.assert_allclose(got[name], numpy, rtol=1e-5, atol=1e-6, err_msg=name)


def _oov_setup():
    t = se.TableSpec("t", 10, 4, combiner="mean")
    feats = {"f": se.FeatureSpec("f", t, 3)}
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    ids = {"f": np.array([[1, 12], [3, -1], [-5, 2]])}  # 12 and -5 are out of vocabulary, -1 is padding
    return feats, {"t": table}, ids, table


@pytest.mark.parametrize("policy", ["zero", "default"])
def test_oov_zero_and_default_vector(policy):
    feats, tables, ids, W = _oov_setup()
    default = np.array([1.0, -2.0, 3.0, 0.5], np.float32)
    oov = "zero" if policy == "zero" else {"t": default}
    d = np.zeros(4) if policy == "zero" else default
    want = np.stack([(W[1] + d) / 2, W[3], (d + W[2]) / 2])
    eager = se.serving_lookup(feats, tables, ids, oov=oov)
    jitted = jax.jit(lambda t, i: se.serving_lookup(feats, t, i, oov=oov))(tables, ids)
    for got in (eager, jitted):
        np.testing.assert_allclose(got["f"], want, rtol=1e-6)
    if policy != "zero":  # a misspelt table kept the default policy ("error") silently
        with pytest.raises(ValueError, match=r"oov sets policies for tables \['T'\] that are not in tables \(it "
                                             r"has \['t'\]\)"):
            se.serving_lookup(feats, tables, ids, oov={"T": default})


def test_oov_error_raises_eagerly_and_poisons_under_jit():
    feats, tables, ids, W = _oov_setup()
    with pytest.raises(ValueError, match=r"Feature 'f' \(table 't'\): id 12 in sample 0 is out of vocabulary"):
        se.serving_lookup(feats, tables, ids)
    got = np.asarray(jax.jit(lambda t, i: se.serving_lookup(feats, t, i))(tables, ids)["f"])
    assert np.isnan(got[0]).all() and np.isnan(got[2]).all()
    np.testing.assert_array_equal(got[1], W[3])


@pytest.mark.parametrize("wide", [2**32 + 5, -(2**32) + 3, 2**64 - 1], ids=["past_int32", "below_int32", "uint64_max"])
def test_ids_wider_than_int32_are_never_wrapped_to_a_row_or_padding(wide):
    """jax takes host ids as int32: 2**32 + 5 would read row 5, 2**64 - 1 would be -1 padding."""
    feats, tables, _, W = _oov_setup()
    ids = np.array([[1, wide], [3, 0], [2, 2]], np.uint64 if wide > 2**63 else np.int64)
    with pytest.raises(ValueError, match=rf"Feature 'f' \(table 't'\): id {wide} is out of vocabulary \[0, 10\)"):
        se.serving_lookup(feats, tables, {"f": ids})
    coo = (np.array([[0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [2, 1]]), ids.ravel(), (3, 2))
    with pytest.raises(ValueError, match=rf"Feature 'f' \(table 't'\): id {wide} is out of vocabulary \[0, 10\)"):
        se.serving_lookup(feats, tables, {"f": coo})  # COO: its values are the ids (not its indices)
    python = [[int(i) for i in row] for row in ids]  # Python ints: jax alone refused those past int32
    for given in ([row for row in ids], ids, coo, python):
        got = se.serving_lookup(feats, tables, {"f": given}, oov="zero")["f"]
        np.testing.assert_allclose(got, np.stack([W[1] / 2, (W[3] + W[0]) / 2, W[2]]), rtol=1e-6)  # as any OOV id
    raw = {"g": se.FeatureSpec("g", se.TableSpec("u", 8, 4, combiner="sum", dynamic=se.Dynamic()), 2)}
    served = {"u": (np.array([3, 7], np.int64), np.arange(32, dtype=np.float32).reshape(8, 4))}
    with pytest.raises(ValueError, match=rf"Feature 'g' \(table 'u'\): raw id {2**64 - 1} is out of range: raw ids "
                                         r"must be < 2\*\*63"):
        se.serving_lookup(raw, served, {"g": np.array([[2**64 - 1], [3]], np.uint64)}, oov="zero")


def test_raw_ids_in_every_format_read_their_rows_and_never_under_jit():
    """A raw-id table maps the ids of every format (COO: its values, not its indices) to its rows on the host;
    under jit that cannot be done, and the error says so, naming the feature."""
    raw = {"g": se.FeatureSpec("g", se.TableSpec("u", 8, 4, combiner="sum", dynamic=se.Dynamic()), 2)}
    array = np.arange(32, dtype=np.float32).reshape(8, 4)
    served = {"u": (np.array([3, 7, 2**40], np.int64), array)}  # raw id -> row 0, 1, 2
    want = np.stack([array[2] + array[1], array[0]])
    for ids in (np.array([[2**40, 7], [3, -1]]), [np.array([2**40, 7]), np.array([3])],
                (np.array([2**40, 7, 3]), np.array([2, 1])), (np.array([[0, 0], [0, 1], [1, 0]]),
                                                              np.array([2**40, 7, 3]), (2, 2))):
        np.testing.assert_array_equal(np.asarray(se.serving_lookup(raw, served, {"g": ids})["g"]), want)
    with pytest.raises(ValueError, match=r"Feature 'g' \(table 'u'\): raw id 1 is not in the table"):
        se.serving_lookup(raw, served, {"g": (np.array([[0, 0], [1, 0]]), np.array([3, 1]), (2, 1))})
    with pytest.raises(ValueError, match=r"Feature 'g' \(table 'u'\): the table is keyed by raw ids, which are "
                                         r"mapped to its rows on the host: call serving_lookup outside jit"):
        jax.jit(lambda t, i: se.serving_lookup(raw, t, i))(served, {"g": np.array([[3], [7]])})


def test_a_raw_id_tables_ids_and_array_under_a_spec_without_dynamic_are_refused_naming_the_feature():
    """A spec written by hand without `dynamic=` for a raw-id table as load_serving returns it: jax's "Cannot
    concatenate arrays with different numbers of dimensions" named neither the feature nor the cause."""
    plain = [se.FeatureSpec("g", se.TableSpec("u", 8, 4, combiner="sum"), 2)]
    served = {"u": (np.array([3, 7], np.int64), np.zeros((8, 4), np.float32))}
    with pytest.raises(ValueError, match=r"Feature 'g' \(table 'u'\): the table is given as \(ids, array\), as "
                                         r"load_serving returns a raw-id table, but its TableSpec is not keyed by raw "
                                         r"ids \(no dynamic=\)"):
        se.serving_lookup(plain, served, {"g": np.array([[3], [7]])})


def test_a_raw_id_tables_ids_narrowed_by_jax_are_refused_naming_the_feature():
    """`jax.device_put(tables)` (or `jnp.asarray`) keeps 32 bits of the int64 raw ids without x64: id 2**32 + 7
    became 7, so a request for raw id 7 read raw id 2**32 + 7's row, and 2**32 + 7 read zeros, silently."""
    raw = [se.FeatureSpec("g", se.TableSpec("u", 8, 4, combiner="sum", dynamic=se.Dynamic()), 2)]
    array = np.arange(32, dtype=np.float32).reshape(8, 4)
    served = {"u": (np.array([3, 2**32 + 7], np.int64), array)}
    ids = {"g": np.array([[7], [2**32 + 7]], np.int64)}
    got = np.asarray(se.serving_lookup(raw, served, ids, oov="zero")["g"])
    np.testing.assert_array_equal(got, [np.zeros(4), array[1]])  # 7: unknown; 2**32 + 7: row 1
    moved = jax.device_put(served)
    if moved["u"][0].dtype == np.int64:
        pytest.skip("jax_enable_x64 is on: the ids keep their 64 bits")
    with pytest.raises(ValueError, match=r"Feature 'g' \(table 'u'\): the table's raw ids are a jax int32 array: "
                                         r"jax without x64 keeps 32 bits of int64 ids"):
        se.serving_lookup(raw, moved, ids, oov="zero")


@pytest.mark.parametrize("dtype", [None, "int8"])
def test_a_raw_id_tables_default_vector_is_served_as_lookup_reads_it_under_max_norm(tmp_path, dtype):
    """`max_norm` clips the table's rows, not the default vector of ids without a row: `lookup` adds the
    default unclipped, and serving did clip it ([0.6, 0.8] for a default of [3, 4] under max_norm 1)."""
    users = se.TableSpec("users", 8, 2, combiner="sum", max_norm=1.0, dynamic=se.Dynamic(default=(3.0, 4.0)))
    plan = se.plan([se.FeatureSpec("u", users, 2)], make_mesh(1))
    key = jax.random.key(0)
    tables, maps = se.init_tables(plan, key), se.init_id_maps(plan, key)
    batch = se.preprocess(plan, {"u": np.array([[5], [6]], np.int64)})[0]
    _, tables, maps, _ = se.map_ids(plan, batch, tables, maps, 0)  # ids 5 and 6 get rows; 777 has none
    ids = {"u": np.array([[777], [5]], np.int64)}
    b = se.map_ids(plan, se.preprocess(plan, ids)[0], tables, maps, 1, train=False)[0]
    want = np.asarray(se.lookup(plan, b, tables, 1)["u"])
    np.testing.assert_array_equal(want[0], [3.0, 4.0])  # the default, whole (its norm is 5)
    assert 0 < np.linalg.norm(want[1]) <= 1 + 1e-6
    se.export_serving(str(tmp_path / "served"), plan, tables, id_maps=maps, dtype=dtype)
    arrays, specs = se.load_serving(str(tmp_path / "served"))
    got = np.asarray(se.serving_lookup([se.FeatureSpec("u", specs["users"], 2)], arrays, ids)["u"])
    np.testing.assert_array_equal(got[0], [3.0, 4.0])
    np.testing.assert_allclose(got[1], want[1], atol=0 if dtype is None else 0.01)

@pytest.mark.parametrize("fmt", ["dense", "pair", "coo"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_weight_that_is_not_finite_is_refused_eagerly_naming_the_feature_and_sample(fmt, combiner, bad):
    """As preprocess refuses it: sum served NaN / inf, mean and sqrtn said the weights 'sum to nan, past float32's
    range: scale the weights down'. Padding's weights are never read."""
    feats = [se.FeatureSpec("f", se.TableSpec("t", 10, 2, combiner=combiner), 3)]
    tables = {"t": np.ones((10, 2), np.float32)}
    samples = [[(1, 1.0), (2, 0.5)], [(3, 1.0), (4, bad)], [(5, 2.0)]]
    ids, w = _render(samples, fmt)
    if fmt == "dense":
        w[2, 1] = np.nan  # padding: ignored
    with pytest.raises(ValueError, match=rf"Feature 'f' \(table 't'\): weight {bad} for sample 1 is not finite"):
        se.serving_lookup(feats, tables, {"f": ids}, {"f": w})
    samples[1][1] = (4, 1.5)
    ids, w = _render(samples, fmt)
    got = np.asarray(se.serving_lookup(feats, tables, {"f": ids}, {"f": w})["f"])
    np.testing.assert_allclose(got, ref.lookup(tables["t"], samples, combiner=combiner), rtol=1e-6)


def test_ids_and_weights_of_unknown_or_missing_features_are_refused():
    feats, tables, ids, _ = _oov_setup()
    with pytest.raises(ValueError, match=r"ids have no ids for features \['f'\]; the features are \['f'\]\.$"):
        se.serving_lookup(feats, tables, {})
    with pytest.raises(ValueError, match=r"ids have unknown features \['ff'\]; the features"):
        se.serving_lookup(feats, tables, {**ids, "ff": ids["f"]})
    with pytest.raises(ValueError, match=r"weights have unknown features \['ff'\]; features are \['f'\]"):
        se.serving_lookup(feats, tables, ids, {"ff": np.ones((3, 2), np.float32)})


@pytest.mark.parametrize("bad, match", [
    ({"oov": "skip"}, "oov must be 'error', 'zero' or a"),
    ({"oov": np.zeros(3)}, r"default vector has shape \(3,\)"),
])
def test_bad_oov_policy(bad, match):
    feats, tables, ids, _ = _oov_setup()
    with pytest.raises(ValueError, match=match):
        se.serving_lookup(feats, tables, ids, **bad)


def test_jax_export_roundtrip_and_serving_checkpoint(tmp_path):
    feats, samples, ids, weights = _setup("dense", True)
    plan = se.plan(feats, make_mesh(8))
    state = se.init_tables(plan, jax.random.key(4))
    se.export_serving(tmp_path / "serve", plan, state)
    tables, specs = se.load_serving(tmp_path / "serve")
    assert {n: s.combiner for n, s in specs.items()} == {t.name: t.combiner for t in plan.tables.values()}
    serve_feats = {n: se.FeatureSpec(n, specs[f.table.name], B) for n, f in feats.items()}
    fn = jax.jit(lambda t, i, w: se.serving_lookup(serve_feats, t, i, w, oov="zero"))
    exported = jax.export.export(fn)(tables, ids, weights)
    reloaded = jax.export.deserialize(exported.serialize())
    got = reloaded.call(tables, ids, weights)
    batch, _ = se.preprocess(plan, ids, weights)
    want = se.lookup(plan, batch, state)
    for name in feats:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6)


def test_bf16_serving_export(tmp_path):
    feats, _, ids, _ = _setup("dense", False)
    plan = se.plan(feats, make_mesh(2))
    state = se.init_tables(plan, jax.random.key(4))
    se.export_serving(tmp_path / "s", plan, state, dtype="bf16")
    tables, specs = se.load_serving(tmp_path / "s")
    assert all(t.dtype == jnp.bfloat16 for t in tables.values())
    want = se.unstack_tables(plan, state)
    for n, t in tables.items():
        np.testing.assert_array_equal(np.asarray(t), want[n].astype(jnp.bfloat16))


def test_a_float16_export_refuses_rows_beyond_its_range(tmp_path):
    """float16 holds at most 65504: a larger value would serve as inf (numpy only warns); bfloat16 holds it."""
    t = se.TableSpec("t", 10, 4)
    plan = se.plan([se.FeatureSpec("f", t, 8)], make_mesh(2))
    rows = np.zeros((10, 4), np.float32)
    rows[7, 2] = 1e5
    state = se.stack_tables(plan, {"t": rows})
    with pytest.raises(ValueError, match=r"Table 't': row 7 holds values beyond float16's range \(it would serve "
                                         r"inf\); export it as float32 or bfloat16"):
        se.export_serving(tmp_path / "f16", plan, state, dtype="f16")
    assert not (tmp_path / "f16").exists()
    rows[7, 2] = 6e4
    se.export_serving(tmp_path / "ok", plan, se.stack_tables(plan, {"t": rows}), dtype="f16")
    np.testing.assert_array_equal(np.asarray(se.load_serving(tmp_path / "ok")[0]["t"]), rows.astype(np.float16))


@pytest.mark.parametrize("seq_len", [0, 3], ids=["pooled", "sequence"])
def test_unsorted_coo_indices_are_never_misassigned(seq_len):
    """COO entries in any order give the same activations as sorted ones (and as numpy)."""
    feats, samples, ids, weights = _setup("coo", True, seq_len)
    order = np.random.default_rng(1).permutation
    shuffled_ids, shuffled_w = {}, {}
    for n, (idx, vals, shape) in ids.items():
        p = order(len(vals))
        shuffled_ids[n] = (idx[p], vals[p], shape)
        shuffled_w[n] = (idx[p], weights[n][1][p], shape)
    arrays = {f.table.name: np.random.default_rng(2).normal(size=(f.table.vocabulary_size, 8)).astype(np.float32)
              for f in feats.values()}
    got = se.serving_lookup(feats, arrays, shuffled_ids, shuffled_w)
    want = se.serving_lookup(feats, arrays, ids, weights)
    for name, f in feats.items():
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6, err_msg=name)
        numpy = ref.lookup(arrays[f.table.name], samples[name], combiner=f.table.combiner, seq_len=seq_len)
        np.testing.assert_allclose(got[name], numpy, rtol=1e-5, atol=1e-6, err_msg=name)


COO_OUTSIDE = {"negative position": [[1, -1]], "sample past the batch": [[0, 0], [3, 0]],
               "negative sample": [[-1, 0]]}


@pytest.mark.parametrize("seq_len", [0, 2], ids=["pooled", "sequence"])
@pytest.mark.parametrize("where", sorted(COO_OUTSIDE))
def test_coo_entries_outside_the_batch_are_refused_or_poison_under_jit(where, seq_len):
    """An entry at a negative position read as the previous sample's last one; one outside [0, batch) vanished."""
    f = se.FeatureSpec("f", se.TableSpec("t", 50, 2), batch_size=3, max_sequence_length=seq_len)
    arrays = {"t": np.arange(100, dtype=np.float32).reshape(50, 2)}
    idx = np.array(COO_OUTSIDE[where], np.int64)
    coo = (idx, np.arange(1, len(idx) + 1, dtype=np.int64), np.array([3, max(seq_len, 1)], np.int64))
    with pytest.raises(ValueError, match=rf"Feature 'f' \(table 't'\): COO entry {len(idx) - 1} is at \(sample "):
        se.serving_lookup([f], arrays, {"f": coo})
    jitted = jax.jit(lambda c: se.serving_lookup([f], arrays, {"f": c})["f"])
    assert np.isnan(np.asarray(jitted(coo))).all()  # under jit: nothing to raise, so nothing reads as valid
    good = (np.array([[0, 0], [2, 1]], np.int64), np.array([1, 2], np.int64), coo[2])
    want = np.zeros((3, seq_len, 2) if seq_len else (3, 2), np.float32)
    want[(0, 0) if seq_len else 0] = arrays["t"][1]
    want[(2, 1) if seq_len else 2] = arrays["t"][2]
    np.testing.assert_array_equal(jitted(good), want)


@pytest.mark.parametrize("which", ["indices", "values"])
def test_coo_float_indices_or_values_are_refused_naming_the_feature(which):
    f = se.FeatureSpec("f", se.TableSpec("t", 50, 2), batch_size=3)
    coo = [np.array([[0, 0]], np.int64), np.array([1], np.int64), np.array([3, 1])]
    k = 0 if which == "indices" else 1
    coo[k] = coo[k].astype(np.float32)
    arrays = {"t": np.zeros((50, 2), np.float32)}
    with pytest.raises(ValueError, match=rf"Feature 'f' \(table 't'\): COO {which} must be integers, got float32"):
        se.serving_lookup([f], arrays, {"f": tuple(coo)})
    with pytest.raises(ValueError, match=f"COO {which} must be integers"):
        jax.jit(lambda c: se.serving_lookup([f], arrays, {"f": c}))(tuple(coo))
