"""Every bad input gets a clear error naming the feature; nothing reaches a table."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import sparse_embed as se


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
