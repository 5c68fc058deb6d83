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
    # Our own layout computation agrees with jax-tpu-embedding's stack_tables.
    ours_layout = se.jte.jte_layout({n: se.TableSpec(n, VOCABS[n], DIMS[n]) for n in DIMS}, S,
                                stacking=[["a", "b"], ["c"]] if stack else [["a"], ["b"], ["c"]], rotation=2)
    assert sorted(ours_layout, key=lambda t: t.name) == sorted(layout, key=lambda t: t.name)


def test_training_state_round_trip_through_jte_layout():
    a = se.TableSpec("a", 37, 8, optimizer=se.optimizers.Adagrad(0.1))
    c = se.TableSpec("c", 19, 8, optimizer=se.optimizers.Adagrad(0.1))
    plan = se.plan({"fa": se.FeatureSpec("fa", a, 8), "fc": se.FeatureSpec("fc", c, 8)}, make_mesh(4))
    state = se.init_tables(plan, jax.random.key(1))
    layout = se.jte.jte_layout(plan.tables, 4, stacking=[["a", "c"]])
    per_table = se.unstack_state(plan, state)
    for key in ("table", "accumulator"):
        arrays = {n: v[key] for n, v in per_table.items()}
        back = se.jte.from_jte(layout, se.jte.to_jte(layout, arrays, 4), 4)
        restacked = se.stack_tables(plan, back) if key == "table" else None
        for n in arrays:
            np.testing.assert_array_equal(back[n], arrays[n])
        if restacked is not None:
            np.testing.assert_array_equal(np.asarray(restacked["a_c"].table), np.asarray(state["a_c"].table))
