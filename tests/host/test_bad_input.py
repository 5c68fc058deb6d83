"""Every bad input gets a clear error naming the feature; nothing reaches a table."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparse_embed as se
import reference as ref
from conftest import make_mesh, require_native
from sparse_embed.host import native



@pytest.fixture
def setup(mesh8):
    t = se.TableSpec("tbl", 20, 4, combiner="mean")
    feats = {"f": se.FeatureSpec("f", t, 8), "g": se.FeatureSpec("g", t, 8, max_sequence_length=2)}
    plan = se.plan(feats, mesh8)
    good = {"f": np.ones((8, 2), np.int32), "g": [np.array([1])] * 8}
    return plan, good


def _expect(setup, match, ids=None, weights=None):
    plan, good = setup
    with pytest.raises(ValueError, match=match):
        se.preprocess(plan, {**good, **(ids or {})}, weights)


F = r"Feature 'f' \(table 'tbl'\): "
G = r"Feature 'g' \(table 'tbl'\): "


@pytest.mark.parametrize("ids", [
    np.full((8, 2), 20), np.full(8, 25), [np.array([3, 20])] * 8, (np.full(8, 99), np.ones(8, int))],
    ids=["dense", "1d", "ragged_list", "ragged_pair"])
def test_id_past_vocabulary(setup, ids):
    _expect(setup, F + r"id \d+ in sample 0 is out of range: ids must be < vocabulary_size 20", {"f": ids})


@pytest.mark.parametrize("ids, match", [
    (np.array([[1, -2]] * 8), r"id -2 in sample 0 is out of range: negative ids are not allowed \(only -1 is padding"),
    (np.array([1] * 7 + [-5]), r"id -5 in sample 7 is out of range: negative"),
    ([np.array([1, -1])] * 8, "id -1 in sample 0 is out of range: negative ids are not allowed in ragged input"),
])
def test_negative_ids(setup, ids, match):
    _expect(setup, F + match, {"f": ids})


@pytest.mark.parametrize("ids", [np.ones((8, 2), np.float32), np.ones((8, 2), bool), [np.array([1.5])] * 8,
                                 np.array([["a"]] * 8)], ids=["float", "bool", "ragged_float", "str"])
def test_non_integer_ids(setup, ids):
    _expect(setup, F + ".*must be integers", {"f": ids})


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights(setup, bad):
    w = np.ones((8, 2), np.float32)
    w[5, 1] = bad
    _expect(setup, F + r"weight .* for sample 5 is not finite", weights={"f": w})


def test_weights_past_float32_are_not_finite(setup):
    """float64 weights past float32's range: the finite check's error (inf), never numpy's overflow warning."""
    w = np.ones((8, 2))
    w[5, 1] = -1e300
    _expect(setup, F + r"weight -inf for sample 5 is not finite \(weights are float32", weights={"f": w})
    _expect(setup, G + r"weight inf for sample 3 is not finite \(weights are float32",  # a list: the C path
            weights={"g": [np.ones(1)] * 3 + [np.array([1e300])] + [np.ones(1)] * 4})
    _expect(setup, G + r"weight inf for sample 0 is not finite", weights={"g": [[1e300]] + [[1.0]] * 7})  # numpy


@pytest.mark.parametrize("path", ["C", "numpy"])
@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
@pytest.mark.parametrize("fmt", ["dense", "ragged"])
def test_weights_whose_sum_passes_float32_are_refused(mesh8, combiner, fmt, monkeypatch, path):
    """Finite weights whose float32 divisor (a sample's Σ|w|, Σw²; a sequence position's own) overflowed gave
    all-zero activations silently; weights just inside the range still pool as numpy does, and sum ignores it."""
    if path == "numpy":
        monkeypatch.setenv(native.ENV, "0")
    else:
        require_native("preprocess")
    t = se.TableSpec("t", 20, 4, combiner=combiner)
    feats = {"f": se.FeatureSpec("f", t, 8), "s": se.FeatureSpec("s", t, 8, max_sequence_length=2)}
    plan = se.plan(feats, mesh8)
    big = 3e38 if combiner == "mean" else 1e20  # two of them: Σ|w| = 6e38, Σw² = 2e40 (float32's max: 3.4e38)
    ok = 1.5e38 if combiner == "mean" else 1.2e19  # two: 3e38, 2.9e38
    ids = np.tile(np.array([[3, 5]]), (8, 1))
    as_fmt = (lambda a: a) if fmt == "dense" else (lambda a: list(a))
    w = np.ones((8, 2), np.float32)
    w[2] = big
    what = "absolute" if combiner == "mean" else "squared"
    with pytest.raises(ValueError, match=rf"Feature 'f' \(table 't'\): the {what} weights of sample 2 sum to "):
        se.preprocess(plan, {"f": as_fmt(ids), "s": as_fmt(ids)}, {"f": as_fmt(w)})
    if combiner == "sqrtn":  # a sequence position divides by its own √w²
        with pytest.raises(ValueError, match=rf"Feature 's' .* the squared weights of sample 2 sum to "):
            se.preprocess(plan, {"f": as_fmt(ids), "s": as_fmt(ids)}, {"s": as_fmt(w)})
    served = {"t": np.arange(80, dtype=np.float32).reshape(20, 4)}
    with pytest.raises(ValueError, match=r"Feature 'f' .* weights of sample 2 sum to "):
        se.serving_lookup([feats["f"]], served, {"f": ids}, {"f": w})
    w[2] = ok
    batch, _ = se.preprocess(plan, {"f": as_fmt(ids), "s": as_fmt(ids)}, {"f": as_fmt(w)})
    tables = se.stack_tables(plan, served)
    got = np.asarray(se.lookup(plan, batch, tables, 0)["f"])[2]
    w64 = w[2].astype(np.float64)
    gains = w64 / (w64.sum() if combiner == "mean" else np.sqrt((w64 ** 2).sum()))
    np.testing.assert_allclose(got, gains @ served["t"][[3, 5]], rtol=1e-5)
    summed = se.plan({"f": se.FeatureSpec("f", se.TableSpec("t", 20, 4, combiner="sum"), 8)}, mesh8)
    w[2] = big
    se.preprocess(summed, {"f": as_fmt(ids)}, {"f": as_fmt(w)})  # sum never divides


def test_weights_structure_and_shape(setup):
    _expect(setup, F + "weights are list but ids are dense", weights={"f": [np.ones(2)] * 8})
    _expect(setup, F + r"weights have shape \(8, 3\), but the ids have shape \(8, 2\)", weights={"f": np.ones((8, 3))})
    _expect(setup, G + "weights have 7 rows but ids have 8", weights={"g": [np.ones(1)] * 7})
    _expect(setup, G + r"weights of sample 2 have shape \(2,\)", weights={"g": [np.ones(1)] * 2 + [np.ones(2)] * 6})
    _expect(setup, F + "weights' row_lengths differ", {"f": (np.ones(8, int), np.ones(8, int))},
            {"f": (np.ones(8), np.r_[2, 0, np.ones(6, int)])})
    _expect(setup, F + "weights must be numbers", weights={"f": np.full((8, 2), "x")})


def test_ragged_pair_errors(setup):
    _expect(setup, F + "row_lengths sum to 9 but there are 8 values", {"f": (np.ones(8, int), np.r_[2, np.ones(7, int)])})
    _expect(setup, F + "row_lengths must be >= 0", {"f": (np.ones(8, int), np.r_[-1, 2, np.ones(6, int)])})
    _expect(setup, F + r"a ragged tuple must be \(values, row_lengths\)", {"f": (np.ones(8, int),)})


@pytest.mark.parametrize("ids, match", [
    ([np.ones((2, 2), int)] + [np.array([1])] * 7, r"ids of sample 0 are 2-D, shape \(2, 2\)"),
    ([np.array([1])] * 7 + [[[1], [2, 3]]], "ids of sample 7 are nested unevenly"),
    ([[1, [2]]] + [[1]] * 7, "ids of sample 0 are nested unevenly"),
    ([np.array([1])] * 3 + [4] + [np.array([1])] * 4, "ids of sample 3 are a single value, not a row"),
    ([[np.array([1]), np.array([2, 3])]] * 8, "ids of sample 0 are nested unevenly"),
    ([np.ones((1, 2), int)] * 8, r"ids of sample 0 are 2-D"),
    (([[1], [2, 3]], np.ones(8, int)), "ids could not be read as an array"),
    ((np.ones(8, int), [[1], [1, 1]] + [1] * 6), "row_lengths could not be read as an array"),
], ids=["2d_row", "nested_row", "uneven_row", "scalar_among_rows", "list_of_arrays_row", "all_2d_rows",
        "pair_values", "pair_lengths"])
def test_nested_ragged_input(setup, ids, match):
    """A ragged row that is 2-D or nested: a ValueError naming the feature (and the sample), never numpy's."""
    _expect(setup, F + match, {"f": ids})


@pytest.mark.parametrize("ids, match", [
    ((), r"a ragged tuple must be \(values, row_lengths\), got a tuple of 0"),
    ([np.ones((2, 2), int)] + [np.array([1])] * 7, r"ids of sample 0 are 2-D"),
    ([[2**63]] * 8, r"raw id 9223372036854775808 is out of range: raw ids must be < 2\*\*63"),
    (([[1], [2, 3]], np.ones(8, int)), "ids could not be read as an array"),
], ids=["empty_tuple", "2d_row", "past_int64", "pair_values"])
def test_malformed_raw_ids(ids, match):
    """A raw-id table's input goes through the same parser first (its range checks run on what it read)."""
    t = se.TableSpec("users", 100, 4, dynamic=se.Dynamic())
    plan = se.plan([se.FeatureSpec("u", t, 8)], make_mesh(2))
    with pytest.raises(ValueError, match=r"Feature 'u' \(table 'users'\): " + match):
        se.preprocess(plan, {"u": ids})


def test_nested_weights(setup):
    _expect(setup, F + "weights of sample 0 are nested unevenly", {"f": [np.array([1, 2])] * 8},
            {"f": [[1.0, [2.0]]] * 8})
    _expect(setup, F + "weights of sample 7 are a single value", {"f": [np.array([1])] * 8},
            {"f": [np.ones(1)] * 7 + [1.0]})
    _expect(setup, F + "weights' row_lengths could not be read as an array", {"f": (np.ones(8, int), np.ones(8, int))},
            {"f": (np.ones(8), [[1], [1, 1]] + [1] * 6)})


@pytest.mark.parametrize("ids", [np.full((8, 2), 2**64 - 1, np.uint64), np.full(8, 2**63, np.uint64),
                                 [np.array([2**63], np.uint64)] * 8, [[2**63]] * 8,
                                 (np.full(8, 2**64 - 1, np.uint64), np.ones(8, int)),
                                 # Python ints past int64 beside others, which numpy reads as float64 (or object)
                                 [2**63] + [1] * 7, [[2**63, -1]] + [[1, 2]] * 7, [[2**63], [1]] + [[2]] * 6,
                                 [2**64] + [1] * 7],
                         ids=["dense_max", "1d", "list_rows", "python_ints", "pair", "python_1d_mixed",
                              "python_dense_mixed", "python_rows_mixed", "python_past_uint64"])
def test_uint64_ids_past_int64_never_wrap(setup, ids):
    """uint64 ids >= 2**63 are out of range; cast to int64 they would wrap (2**64 - 1 would read as -1, padding).
    Python ints past int64 are named as such, never as floats ('ids must be integers, got dtype float64')."""
    _expect(setup, F + r"id (18446744073709551615|9223372036854775808|18446744073709551616)( in sample 0)? is out "
                       r"of range: ids must be < vocabulary_size 20", {"f": ids})


@pytest.mark.parametrize("ids", [[2**63] + [1] * 7, [[2**63, -1]] + [[1, 2]] * 7, [[2**63], [1]] + [[2]] * 6])
def test_python_raw_ids_past_int64_are_out_of_range(ids):
    t = se.TableSpec("u", 10, 4, dynamic=se.Dynamic())
    plan = se.plan([se.FeatureSpec("u", t, 8)], make_mesh(1))
    with pytest.raises(ValueError, match=r"Feature 'u' \(table 'u'\): raw id 9223372036854775808 is out of range: "
                                         r"raw ids must be < 2\*\*63"):
        se.preprocess(plan, {"u": ids})
    with pytest.raises(ValueError, match="ids must be integers, got dtype float64"):  # floats stay floats
        se.preprocess(plan, {"u": [1.5] * 8})


def test_dense_rank(setup):
    _expect(setup, F + r"dense ids must be 1-D \[batch\] or 2-D \[batch, L\], got shape \(8, 1, 1\)",
            {"f": np.ones((8, 1, 1), int)})


def test_missing_and_unknown_features(setup):
    plan, good = setup
    with pytest.raises(ValueError, match=r"ids is missing features \['g'\]"):
        se.preprocess(plan, {"f": good["f"]})
    with pytest.raises(ValueError, match=r"ids has unknown features \['h'\]"):
        se.preprocess(plan, {**good, "h": good["f"]})
    with pytest.raises(ValueError, match=r"weights has unknown features \['h'\]"):
        se.preprocess(plan, good, {"h": np.ones((8, 2))})
    with pytest.raises(TypeError, match="mapping"):
        se.preprocess(plan, [good["f"]])
    for weights in (["f"], 5, np.ones((8, 2))):  # not a mapping: never an AttributeError or "unhashable"
        with pytest.raises(TypeError, match="weights must be a mapping feature name -> weights"):
            se.preprocess(plan, good, weights)
    with pytest.raises(ValueError, match=r"ids has unknown features \[1, 'h'\]"):  # names of mixed types sort
        se.preprocess(plan, {**good, 1: good["f"], "h": good["f"]})


@pytest.mark.parametrize("rows", [4, 9, 16])
def test_batch_size_differs_from_feature_spec(setup, rows):
    _expect(setup, F + f"got {rows} samples, but the FeatureSpec's batch_size is 8", {"f": np.ones((rows, 2), int)})
    _expect(setup, G + f"got {rows} samples", {"g": [np.array([1])] * rows})


def test_failed_preprocess_leaves_tables_untouched(setup):
    plan, good = setup
    tables = se.init_tables(plan, jax.random.key(0))
    before = se.unstack_tables(plan, tables)
    with pytest.raises(ValueError):
        se.preprocess(plan, {**good, "f": np.full((8, 2), 99)})
    after = se.unstack_tables(plan, tables)
    np.testing.assert_array_equal(after["tbl"], before["tbl"])


@pytest.mark.usefixtures("each_kernel")  # on the generic and the native kernel
def test_lookup_rejects_foreign_batch_and_tables(setup, mesh8):
    plan, good = setup
    tables = se.init_tables(plan, jax.random.key(0))
    batch, _ = se.preprocess(plan, good)
    other = se.plan({"f": se.FeatureSpec("f", se.TableSpec("x", 5, 4), 8)}, mesh8)
    with pytest.raises(ValueError, match="batch has stacks"):
        se.lookup(other, batch, tables)
    with pytest.raises(ValueError, match="stacks missing"):
        se.lookup(plan, batch, {})
    with pytest.raises(TypeError, match="ShardedCooMatrix"):
        se.lookup(plan, {"tbl": tuple(batch["tbl"])}, tables)
    # preprocess's whole (batch, stats), or no mapping at all: not set()'s "unhashable type: 'dict'"
    with pytest.raises(TypeError, match=r"^batch must be the \{stack: ShardedCooMatrix\} mapping that "
                                        r"sparse_embed.preprocess builds, got tuple; preprocess returns \(batch, "
                                        r"stats\): batch, stats = sparse_embed.preprocess\(plan, ids\)\.$"):
        se.lookup(plan, se.preprocess(plan, good), tables)
    with pytest.raises(TypeError, match=r"^batch must be .* got NoneType\.$"):
        se.nonfinite_rows(plan, None, {})
    with pytest.raises(TypeError, match=r"^tables must be the \{stack: EmbeddingVariables\} mapping that init_tables "
                                        r"\(or stack_tables\) makes, got tuple\.$"):
        se.lookup(plan, batch, (tables,))
    for dtype in (jnp.bfloat16, jnp.float16, jnp.int32):  # bf16 trained in bf16 silently; the others in the kernel
        cast = {k: v._replace(table=v.table.astype(dtype)) for k, v in tables.items()}
        with pytest.raises(ValueError, match=rf"Stack 'tbl': table has dtype {jnp.dtype(dtype)}, the plan's "
                                             r"TableSpec says float32"):
            se.lookup(plan, batch, cast)



@pytest.mark.parametrize("other", [dict(vocab=20), dict(dynamic=se.Dynamic(admit_after=3)), dict(devices=1)],
                         ids=["fewer_rows", "admission", "mesh"])
def test_map_ids_rejects_id_maps_made_for_another_plan(other):
    """Same stack name, other rows, admission (a pending set) or mesh: the map would silently run the other
    plan's policy (or fail in shard_map), so it is refused naming the stack."""
    def make(vocab=100, dynamic=se.Dynamic(), devices=2):
        return se.plan([se.FeatureSpec("v", se.TableSpec("visitors", vocab, 4, dynamic=dynamic), 8)],
                       make_mesh(devices))

    plan, foreign = make(), make(**other)
    rng = jax.random.key(0)
    tables, batch = se.init_tables(plan, rng), se.preprocess(plan, {"v": np.arange(8)})[0]
    with pytest.raises(ValueError, match=r"Stack 'visitors': its id map does not fit this plan .* made for another "
                                         r"plan"):
        se.map_ids(plan, batch, tables, se.init_id_maps(foreign, rng), 0)
    se.map_ids(plan, batch, tables, se.init_id_maps(plan, rng), 0)  # its own: fine


def test_map_ids_rejects_a_batch_built_by_another_plan():
    """Same table names, but static and auto-stacked (or another mesh): a ValueError naming the stacks, never a
    KeyError or a shard_map shape error."""
    visitors = se.TableSpec("visitors", 100, 4, dynamic=se.Dynamic())
    feats = [se.FeatureSpec("v", visitors, 8), se.FeatureSpec("i", se.TableSpec("items", 100, 4), 8)]
    plan = se.plan(feats, make_mesh(2))
    tables, maps = se.init_tables(plan, jax.random.key(0)), se.init_id_maps(plan, jax.random.key(0))
    ids = {"v": np.arange(8), "i": np.arange(8)}
    static = se.plan([se.FeatureSpec("v", dataclasses.replace(visitors, dynamic=None), 8), feats[1]], make_mesh(2))
    assert static.stack_names == ("items_visitors",)
    with pytest.raises(ValueError, match=r"batch has stacks \['items_visitors'\] but the plan has \['items', "
                                         r"'visitors'\] \(stacks missing \['items', 'visitors'\], unknown "
                                         r"\['items_visitors'\]\): the batch was built by another plan"):
        se.map_ids(plan, se.preprocess(static, ids)[0], tables, maps, 0)
    other_mesh = se.plan(feats, make_mesh(1))
    with pytest.raises(ValueError, match=r"Stack 'visitors': batch arrays have shapes .* which do not fit this "
                                         r"plan \(2 devices, 2 shards\): the batch was built by another plan"):
        se.map_ids(plan, se.preprocess(other_mesh, ids)[0], tables, maps, 0)
    batch, _ = se.preprocess(plan, ids)
    with pytest.raises(ValueError, match=r"tables do not match the plan: stacks missing \['visitors'\]"):
        se.map_ids(plan, batch, {"items": tables["items"]}, maps, 0)
    with pytest.raises(TypeError, match="Stack 'visitors': batch entry must be a RawIdBatch"):
        se.map_ids(plan, {**batch, "visitors": tuple(batch["visitors"])}, tables, maps, 0)
    # arrays of the same shapes, from a plan whose raw-id table has fewer rows: its layout mark is refused
    fewer = se.plan([se.FeatureSpec("v", dataclasses.replace(visitors, vocabulary_size=96), 8), feats[1]],
                    make_mesh(2))
    theirs = se.preprocess(fewer, ids)[0]
    assert jax.tree.map(np.shape, tuple(theirs["visitors"][:6])) == jax.tree.map(np.shape, tuple(batch["visitors"][:6]))
    with pytest.raises(ValueError, match=r"Stack 'visitors': the batch was built for another plan's stack 'visitors' "
                                         r"\(.* 48 rows each, tables visitors; this plan: .* 50 rows each"):
        jax.jit(lambda b: se.map_ids(plan, b, tables, maps, 0))(theirs)

# ---------------------------------------------------------------- ids that would land on padding or another table
@pytest.fixture
def stacked(mesh8):
    """Two stacked tables: 'a' (vocab 21, padded to 24 rows) then 'b' at stack rows [24, 56)."""
    a, b = se.TableSpec("a", 21, 4, combiner="sum"), se.TableSpec("b", 30, 4, combiner="sum")
    plan = se.plan({"fa": se.FeatureSpec("fa", a, 8), "fb": se.FeatureSpec("fb", b, 8)}, mesh8)
    assert plan.stack_names == ("a_b",) and plan.stack("a_b").total_rows == 56
    return plan


@pytest.mark.parametrize("bad", [21, 23, 24, 56, 2**31 - 1, 2**40],
                         ids=["vocab", "padding_row", "next_table", "stack_rows", "int32_max", "int64"])
def test_id_in_padding_or_another_stacked_table(stacked, bad):
    ids = np.zeros((8, 2), np.int64)
    ids[3, 1] = bad
    with pytest.raises(ValueError, match=rf"Feature 'fa' \(table 'a'\): id {bad} in sample 3 is out of range: "
                                         r"ids must be < vocabulary_size 21"):
        se.preprocess(stacked, {"fa": ids, "fb": np.zeros(8, np.int32)})


def test_int32_min_id(setup):
    _expect(setup, F + r"id -2147483648 in sample 0 is out of range: negative",
            {"f": np.full((8, 2), np.iinfo(np.int32).min, np.int32)})


# ---------------------------------------------------------------- 1-D vs 2-D
def test_flat_ids_for_a_multi_hot_feature(setup):
    """1-D is one id per sample: a flat [B * L] array is never reshaped, it is B * L samples."""
    _expect(setup, F + r"got 16 samples, but the FeatureSpec's batch_size is 8\. A 1-D array is one id per sample: "
                       r"reshape flat ids to \[batch, L\]", {"f": np.ones(16, np.int32)})


def test_one_d_ids_equal_a_single_column(setup):
    """[B] and [B, 1] mean the same; for a sequence feature, that id is position 0."""
    plan, _ = setup
    ids = np.array([3, -1, 5, 7, 0, 1, -1, 19])
    for name in ("f", "g"):
        one, col = (se.flatten(plan.features[name], x) for x in (ids, ids[:, None]))
        for a, b in zip(one, col):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(one.positions, 0)


# ---------------------------------------------------------------- empty features
def _train_step(plan, cts):
    def loss(tables, batch):
        acts = se.lookup(plan, batch, tables, 0)
        return sum(jax.numpy.sum(acts[k] * cts[k]) for k in cts), acts

    return jax.jit(jax.grad(loss, has_aux=True))


EMPTY = {
    "dense_all_padding": (np.full((8, 3), -1), np.zeros((8, 3))),
    "dense_no_columns": (np.zeros((8, 0), np.int64), np.zeros((8, 0))),
    "one_d_all_padding": (np.full(8, -1), np.ones(8)),
    "list_of_empty_rows": ([np.array([], np.int64)] * 8, [np.array([], np.float32)] * 8),
    "list_of_empty_lists": ([[]] * 8, [[]] * 8),
    "pair_zero_lengths": ((np.array([], np.int64), np.zeros(8, int)), (np.array([]), np.zeros(8, int))),
}


@pytest.mark.usefixtures("each_kernel")  # on the generic and the native kernel
@pytest.mark.parametrize("form", list(EMPTY))
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_empty_feature_gives_zero_activations_and_no_table_change(mesh8, form, weighted):
    t = se.TableSpec("t", 20, 4, combiner="sqrtn", optimizer=se.optimizers.Adagrad(0.1))
    plan = se.plan({"f": se.FeatureSpec("f", t, 8)}, mesh8)
    ids, w = EMPTY[form]
    batch, stats = se.preprocess(plan, {"f": ids}, {"f": w} if weighted else None)
    assert stats.num_ids == {"t": 0}
    tables = se.init_tables(plan, jax.random.key(0))
    before = se.unstack_state(plan, tables)
    new, acts = _train_step(plan, {"f": np.ones((8, 4), np.float32)})(tables, batch)
    np.testing.assert_array_equal(acts["f"], 0)
    after = se.unstack_state(plan, new)
    for k in before["t"]:
        np.testing.assert_array_equal(after["t"][k], before["t"][k], err_msg=k)


# ---------------------------------------------------------------- NaN / inf upstream gradients
NONFINITE_OPTIMIZERS = {
    "sgd": (lambda: se.optimizers.SGD(0.1), ref.sgd, None),  # the scatter-add path
    "adagrad": (lambda: se.optimizers.Adagrad(0.1), ref.adagrad, None),  # the combine-duplicates path
    "adagrad_max_norm": (lambda: se.optimizers.Adagrad(0.1), ref.adagrad, 0.5),
}


def _nonfinite_case(mesh, name, policy):
    make_opt, update, max_norm = NONFINITE_OPTIMIZERS[name]
    o = make_opt()
    a = se.TableSpec("a", 30, 4, combiner="mean", optimizer=o, max_norm=max_norm)
    b = se.TableSpec("b", 21, 4, combiner="mean", optimizer=o, max_norm=max_norm)
    feats = {"fa": se.FeatureSpec("fa", a, 8), "fb": se.FeatureSpec("fb", b, 8),
             "fb_seq": se.FeatureSpec("fb_seq", b, 8, max_sequence_length=3)}
    plan = se.plan(feats, mesh, nonfinite_gradients=policy)
    rng = np.random.default_rng(5)
    samples = {n: ref.random_samples(rng, 8, f.table.vocabulary_size, 4, weighted=True, min_len=1, id_pool=12)
               for n, f in feats.items()}
    cts = {n: rng.normal(size=f.output_shape).astype(np.float32) for n, f in feats.items()}
    cts["fa"][2] = np.nan  # every row sample 2 reads
    cts["fb"][0, 1] = -np.inf
    cts["fb_seq"][5, 1] = np.inf  # only the id at position 1 of sample 5
    ids = {n: ref.render(s, "list")[0] for n, s in samples.items()}
    weights = {n: ref.render(s, "list")[1] for n, s in samples.items()}
    batch, _ = se.preprocess(plan, ids, weights)
    tables = se.init_tables(plan, jax.random.key(3))
    state = {n: {k: v.astype(np.float64) for k, v in s.items()} for n, s in se.unstack_state(plan, tables).items()}
    new, _ = _train_step(plan, cts)(tables, batch)
    with np.errstate(invalid="ignore"):  # inf - inf in the reference's max_norm vjp
        grads = _reference_grads(feats, samples, cts, state, max_norm)
    bad = {t: {r for r, g in gs.items() if not np.isfinite(g).all()} for t, gs in grads.items()}
    return plan, batch, cts, o, update, state, grads, bad, se.unstack_state(plan, new)


def _reference_grads(feats, samples, cts, state, max_norm):
    grads = {"a": {}, "b": {}}
    for n, f in feats.items():
        W = state[f.table.name]["table"]
        for r, g in ref.row_grads(W, samples[n], cts[n], combiner="mean", seq_len=f.max_sequence_length,
                                  max_norm=max_norm).items():
            grads[f.table.name][r] = grads[f.table.name].get(r, 0.0) + g
    return grads


@pytest.mark.usefixtures("each_kernel")  # on the generic and the native kernel
@pytest.mark.parametrize("name", list(NONFINITE_OPTIMIZERS))
def test_nonfinite_gradient_rows_are_skipped(mesh8, name):
    plan, batch, cts, o, update, state, grads, bad, got = _nonfinite_case(mesh8, name, "skip")
    assert bad["a"] and bad["b"] and len(bad["a"]) < len(grads["a"])  # some rows skipped, others updated
    for t in ("a", "b"):
        before = {k: v.copy() for k, v in state[t].items()}
        ref.apply(update, state[t], {r: g for r, g in grads[t].items() if r not in bad[t]}, o.learning_rate)
        for k in state[t]:
            assert np.isfinite(got[t][k]).all()
            np.testing.assert_allclose(got[t][k], state[t][k], rtol=1e-5, atol=1e-6, err_msg=f"{t}/{k}")
            rows = sorted(bad[t])
            np.testing.assert_array_equal(got[t][k][rows], before[k][rows].astype(np.float32))
    counts = jax.jit(lambda b, g: se.nonfinite_rows(plan, b, g))(batch, cts)
    assert {k: int(v) for k, v in counts.items()} == {"a_b": len(bad["a"]) + len(bad["b"])}
    with pytest.raises(ValueError, match=r"activation_grads is missing features \['fb'\]"):
        se.nonfinite_rows(plan, batch, {k: v for k, v in cts.items() if k != "fb"})


@pytest.mark.usefixtures("each_kernel")  # on the generic and the native kernel
def test_nonfinite_gradients_apply_poisons_exactly_those_rows(mesh8):
    *_, grads, bad, got = _nonfinite_case(mesh8, "adagrad", "apply")
    for t in ("a", "b"):
        assert {int(r) for r in np.nonzero(~np.isfinite(got[t]["table"]).all(1))[0]} == bad[t]


OVERFLOWING = {  # optimizers whose update squares the gradient: (optimizer, reference update)
    "adagrad": (se.optimizers.Adagrad(0.1), ref.adagrad),
    "rowwise_adagrad": (se.optimizers.RowwiseAdagrad(0.1), ref.rowwise_adagrad(1e-8)),
    "adam": (se.optimizers.Adam(0.01), ref.adam(0.9, 0.999, 1e-8)),
    "adagrad_momentum": (se.optimizers.AdagradMomentum(0.1), ref.adagrad_momentum(0.9, 1.0, 1e-10, 2.0, False)),
    "ftrl": (se.optimizers.FTRL(0.1), ref.ftrl(-0.5, 0.0, 0.0, 0.0, False)),
    "laprop": (se.optimizers.LaProp(0.01), ref.laprop(0.9, 0.95, 1e-30)),
}


@pytest.mark.usefixtures("each_kernel")  # on the generic and the native kernel
def test_a_finite_gradient_whose_update_overflows_is_skipped(mesh8):
    """A finite gradient of 1e20 (its square is inf in float32) wrote inf into every optimizer's slots and NaN into
    FTRL's rows (Adam's the step after): under "skip" such a row keeps its values and slots, the others train."""
    feats = {n: se.FeatureSpec(n, se.TableSpec(n, 16, 4, combiner="sum", optimizer=o), 8)
             for n, (o, _) in OVERFLOWING.items()}
    plan = se.plan(feats, mesh8)
    batch, _ = se.preprocess(plan, {n: np.arange(8) for n in feats})  # sample i reads row i
    tables = se.init_tables(plan, jax.random.key(0))
    state = {n: {k: v.astype(np.float64) for k, v in s.items()} for n, s in se.unstack_state(plan, tables).items()}
    rng = np.random.default_rng(0)
    for step, huge in enumerate([(0, 1), ()]):  # rows 0 and 1 get 1e20 at step 0; every row trains at step 1
        cts = {n: rng.normal(size=(8, 4)).astype(np.float32) for n in feats}
        for n in feats:
            cts[n][list(huge)] = 1e20
        loss = lambda t, b, c: sum(jnp.sum(a * c[k]) for k, a in se.lookup(plan, b, t, step).items())
        tables = jax.jit(jax.grad(loss))(tables, batch, cts)
        got = se.unstack_state(plan, tables)
        for n, (o, update) in OVERFLOWING.items():
            ref.apply(update, state[n], {r: cts[n][r] for r in range(8) if r not in huge}, o.learning_rate, step)
            for k, want in state[n].items():
                np.testing.assert_allclose(got[n][k], want, rtol=1e-5, atol=1e-6, err_msg=f"step {step}: {n}/{k}")


def test_bad_input_table_names_existing_tests():
    """Every row of docs/bad_input.md names the test (path under tests/) that checks it."""
    import pathlib
    import re

    tests = pathlib.Path(__file__).resolve().parents[1]
    table = (tests.parent / "docs" / "bad_input.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| input")]
    assert len(rows) >= 15
    for row in rows:
        named = re.findall(r"`([\w/]+\.py)::(test_\w+)`", row.rsplit("|", 2)[1])
        assert named, f"row names no test: {row}"
        for file, name in named:
            assert re.search(rf"^def {name}\(", (tests / file).read_text(), re.M), f"{file}::{name} not found"


@pytest.mark.parametrize("field, value, message", [
    ("admit_after", 0, "admit_after must be a positive int, got 0"),
    ("admit_after", -1, "admit_after must be a positive int"),
    ("admit_after", True, "admit_after must be a positive int, got True"),
    ("admit_after", 1.5, "admit_after must be a positive int"),
    ("admit_after", "2", "admit_after must be a positive int"),
    ("expire_after", 0, "expire_after must be a positive int"),
    ("expire_after", -3, "expire_after must be a positive int"),
    ("pending_capacity", 0, "pending_capacity must be a positive int"),
    ("expire_after", 2**31, r"expire_after must be at most 2147483647, got 2147483648 \(int32"),
    ("admit_after", 2**40, "admit_after must be at most 2147483647"),
    ("pending_capacity", 2**40, "pending_capacity must be at most 2147483647"),
    ("id_bits", 0, "id_bits must be a positive int"),
    ("id_bits", 64, "id_bits must be at most 63"),
    ("default", [], "finite float or vector"),
    ("default", [[1.0, 2.0]], "finite float or vector"),
    ("default", float("inf"), "finite float or vector"),
])
def test_dynamic_rejects_bad_settings_naming_them(field, value, message):
    with pytest.raises(ValueError, match=f"Dynamic: {message}" if field != "default" else message):
        se.Dynamic(**{field: value})


@pytest.mark.parametrize("step, error, match", [
    (1.5, TypeError, r"step must be an integer scalar \(the global step\), got float32 of shape \(\)"),
    (True, TypeError, "got bool of shape"),
    (np.array([1, 2]), TypeError, r"of shape \(2,\)"),
    (-1, ValueError, "step must be >= 0, got -1"),
], ids=["float", "bool", "vector", "negative"])
def test_a_step_that_is_not_a_non_negative_integer_scalar_is_refused(step, error, match):
    """A float or bool step would feed the schedules another count silently; Adam at step -1 writes NaN."""
    t = se.TableSpec("t", 20, 4, optimizer=se.optimizers.Adam(0.1))
    u = se.TableSpec("u", 20, 4, dynamic=se.Dynamic())
    plan = se.plan([se.FeatureSpec("f", t, 4), se.FeatureSpec("g", u, 4)], make_mesh(1))
    rng = jax.random.key(0)
    tables, maps = se.init_tables(plan, rng), se.init_id_maps(plan, rng)
    batch, _ = se.preprocess(plan, {"f": np.arange(4), "g": np.arange(4)})
    with pytest.raises(error, match=f"map_ids: .*{match}"):
        se.map_ids(plan, batch, tables, maps, step)
    mapped, tables, maps, _ = se.map_ids(plan, batch, tables, maps, 0)
    with pytest.raises(error, match=f"lookup: .*{match}"):
        se.lookup(plan, mapped, tables, step)
    for fine in (0, np.int64(3), jnp.int32(2)):
        se.lookup(plan, mapped, tables, fine)
