"""The jax-tpu-embedding stacked-and-sharded layout, checked against jax-tpu-embedding's own functions."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import sparse_embed as se
from conftest import importorfail, make_mesh

jte_spec = importorfail("jax_tpu_embedding.sparsecore.lib.nn.embedding_spec")
jte_stacking = importorfail("jax_tpu_embedding.sparsecore.lib.nn.table_stacking")

DIMS = {"a": 8, "b": 12, "c": 16}
VOCABS = {"a": 37, "b": 70, "c": 19}


def _jte_features(stack):
    feats = []
    for n in DIMS:
        t = jte_spec.TableSpec(name=n, vocabulary_size=VOCABS[n], embedding_dim=DIMS[n],
                               initializer=jax.nn.initializers.zeros, optimizer=jte_spec.SGDOptimizerSpec(),
                               combiner="sum")
        feats.append(jte_spec.FeatureSpec(name=f"f{n}", table_spec=t, input_shape=(8, 1), output_shape=(8, DIMS[n])))
    # Each table goes through jax-tpu-embedding's stack_tables: its stack_and_shard_tables asserts
    # ("Table a is not stacked.") on a TableSpec that never was.
    for group in ([["a", "b"], ["c"]] if stack else [["a"], ["b"], ["c"]]):
        jte_stacking.stack_tables(feats, group, global_device_count=4, num_sc_per_device=2)
    return {f.table_spec.name: f.table_spec for f in feats}


@pytest.mark.parametrize("stack", [False, True], ids=["one_table_stacks", "stacked_rotated"])
def test_matches_jax_tpu_embedding(stack):
    S = 8  # 4 devices x 2 SparseCores
    specs = _jte_features(stack)
    rng = np.random.default_rng(0)
    arrays = {n: rng.normal(size=(VOCABS[n], DIMS[n])).astype(np.float32) for n in DIMS}
    layout = se.jte.jte_layout_from_specs(specs.values(), S)
    ours = se.jte.to_jte(layout, arrays, S)
    theirs = jte_stacking.stack_and_shard_tables(specs, arrays, S)
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        np.testing.assert_array_equal(ours[k], np.asarray(theirs[k]).reshape(ours[k].shape))
    back = se.jte.from_jte(layout, ours, S)
    via_jte = jte_stacking.unshard_and_unstack_tables(specs, ours, S)
    for n in DIMS:
        np.testing.assert_array_equal(back[n], arrays[n])
        np.testing.assert_array_equal(np.asarray(via_jte[n]), arrays[n])
    # The {name: TableSpec} of its get_table_specs is taken as well (its keys were read as specs: "'str' object has
    # no attribute 'setting_in_stack'"); anything else that is not its TableSpec is a TypeError saying so.
    assert se.jte.jte_layout_from_specs(specs, S) == layout
    feature = jte_spec.FeatureSpec(name="fa", table_spec=specs["a"], input_shape=(8, 1), output_shape=(8, 8))
    for bad, kind in (([feature], "FeatureSpec"), ([se.TableSpec("a", 37, 8)], "TableSpec"), (["a"], "str")):
        with pytest.raises(TypeError, match=f"jte_layout_from_specs takes jax-tpu-embedding TableSpecs, got a {kind} "):
            se.jte.jte_layout_from_specs(bad, S)
    # Our own layout computation agrees with jax-tpu-embedding's stack_tables.
    ours_layout = se.jte.jte_layout({n: se.TableSpec(n, VOCABS[n], DIMS[n]) for n in DIMS}, S,
                                stacking=[["a", "b"], ["c"]] if stack else [["a"], ["b"], ["c"]], rotation=2)
    assert sorted(ours_layout, key=lambda t: t.name) == sorted(layout, key=lambda t: t.name)


def test_a_table_with_a_long_name_stacked_alone_keeps_its_name():
    """jte_layout's default (one stack per table) refused a table name over 50 characters ("hashed by
    jax-tpu-embedding"), though jax-tpu-embedding names a table it does not stack by the table, unshortened."""
    name = "user_features/" + "x" * 50
    t = jte_spec.TableSpec(name=name, vocabulary_size=37, embedding_dim=8, initializer=jax.nn.initializers.zeros,
                           optimizer=jte_spec.SGDOptimizerSpec(), combiner="sum")
    features = {"f": jte_spec.FeatureSpec(name="f", table_spec=t, input_shape=(8, 1), output_shape=(8, 8))}
    importorfail("jax_tpu_embedding.sparsecore.lib.nn.embedding").prepare_feature_specs_for_training(
        features, global_device_count=4, num_sc_per_device=2)
    ours = se.jte.jte_layout([se.TableSpec(name, 37, 8)], 8)
    assert ours == se.jte.jte_layout_from_specs([t], 8) and ours[0].stack_name == name
    array = np.random.default_rng(0).normal(size=(37, 8)).astype(np.float32)
    theirs = jte_stacking.stack_and_shard_tables({name: t}, {name: array}, 8)
    np.testing.assert_array_equal(se.jte.to_jte(ours, {name: array}, 8)[name], np.asarray(theirs[name]).reshape(64, 8))
    with pytest.raises(ValueError, match="names over 50 characters are hashed"):  # its stack_tables shortens one
        se.jte.jte_layout([se.TableSpec(name, 37, 8)], 8, stacking=[[name]])


def test_training_state_round_trip_through_jte_layout():
    a = se.TableSpec("a", 37, 8, optimizer=se.optimizers.Adagrad(0.1))
    c = se.TableSpec("c", 19, 8, optimizer=se.optimizers.Adagrad(0.1))
    plan = se.plan({"fa": se.FeatureSpec("fa", a, 8), "fc": se.FeatureSpec("fc", c, 8)}, make_mesh(4))
    state = se.init_tables(plan, jax.random.key(1))
    layout = se.jte.jte_layout(plan.tables, 4, stacking=[["a", "c"]], rotation=1)
    per_table = se.unstack_state(plan, state)
    for key in ("table", "accumulator"):
        arrays = {n: v[key] for n, v in per_table.items()}
        back = se.jte.from_jte(layout, se.jte.to_jte(layout, arrays, 4), 4)
        restacked = se.stack_tables(plan, back) if key == "table" else None
        for n in arrays:
            np.testing.assert_array_equal(back[n], arrays[n])
        if restacked is not None:
            np.testing.assert_array_equal(np.asarray(restacked["a_c"].table), np.asarray(state["a_c"].table))


def test_layouts_used_with_another_shard_count_or_array_are_refused_naming_them():
    """A layout is made for one number of shards: used with another, or given an array of another shape, it would
    read or write the wrong rows silently."""
    tables = {"a": se.TableSpec("a", 37, 16), "b": se.TableSpec("b", 100, 16)}
    l8 = se.jte.jte_layout(tables, 8, stacking=[["a", "b"]], rotation=2)
    arrays = {n: np.random.default_rng(0).normal(size=(t.vocabulary_size, 16)).astype(np.float32)
              for n, t in tables.items()}
    stacked = se.jte.to_jte(l8, arrays, 8)
    assert stacked["a_b"].shape == (l8[0].stack_vocab_size, 16)
    with pytest.raises(ValueError, match=r"Table 'b' \(stack 'a_b'\): its layout was not made for num_shards=4"):
        se.jte.to_jte(l8, arrays, 4)
    with pytest.raises(ValueError, match="its layout was not made for num_shards=16"):
        se.jte.from_jte(l8, stacked, 16)
    l16 = se.jte.jte_layout(tables, 16, stacking=[["a", "b"]], rotation=2)
    with pytest.raises(ValueError, match=r"Stack 'a_b': array of shape \(256, 16\), but its layout is \(192, 16\)"):
        se.jte.from_jte(l8, se.jte.to_jte(l16, arrays, 16), 8)
    with pytest.raises(ValueError, match=r"array of shape \(384, 8\)"):
        se.jte.from_jte(l8, {"a_b": np.zeros((384, 8), np.float32)}, 8)
    for a, match in ((arrays["b"][:99], r"Table 'b': array has shape \(99, 16\), expected \(100, 16\)"),
                     (arrays["b"] * (1 + 1j), "Table 'b': array dtype complex64 is complex"),
                     (np.full((100, 16), "x"), "Table 'b': array dtype <U1 is not numeric")):
        with pytest.raises(ValueError, match=match):
            se.jte.to_jte(l8, {**arrays, "b": a}, 8)
    for bad, match in ((-8, "num_shards must be a positive int"), (2.5, "num_shards must be a positive int")):
        with pytest.raises(ValueError, match=match):
            se.jte.jte_layout(tables, bad)
    with pytest.raises(ValueError, match="stacking must be a list of non-empty lists"):
        se.jte.jte_layout(tables, 8, stacking=["ab"])
    for bad in (2.5, "2", True):  # 2.5 was taken, and to_jte then failed in numpy ("Cannot cast array data ...")
        with pytest.raises(ValueError, match=f"rotation must be an int \\(the shard rotation step\\), got {bad!r}"):
            se.jte.jte_layout(tables, 8, stacking=[["a", "b"]], rotation=bad)
    assert se.jte.jte_layout(tables, 8, stacking=[["a", "b"]], rotation=np.int64(2)) == l8
    with pytest.raises(ValueError, match="A stack of several tables needs rotation="):
        se.jte.jte_layout(tables, 8, stacking=[["a", "b"]])
    assert se.jte.jte_layout(tables, 8) == se.jte.jte_layout(tables, 8, rotation=3)  # one table a stack: no rotation
