"""A store as an in-memory table's arrays and back (`store_state` / `write_store`), on another mesh (checkpoints
of offloaded tables: tests/io/test_offload_checkpoint.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparse_embed as se
from tests.conftest import make_mesh

V, D, B, L = 2000, 8, 32, 4


def _spec(path=None, cache=200) -> se.TableSpec:
    storage = None if path is None else se.offload.Offload(str(path), cache_rows=cache)
    return se.TableSpec("t", V, D, optimizer=se.optimizers.Adam(0.01), combiner="mean", storage=storage)


def _train(spec, mesh, steps=10, rng=jax.random.key(3)):
    plan = se.plan([se.FeatureSpec("f", spec, B)], mesh)
    tables = se.init_tables(plan, rng)
    cot = jnp.sin(jnp.arange(B * D, dtype=jnp.float32)).reshape(B, D)
    grad = jax.jit(jax.grad(lambda t, b, s: jnp.sum(se.lookup(plan, b, t, s)["f"] * cot)), donate_argnums=0)
    data = np.random.default_rng(0)
    batches = [{"f": (data.zipf(1.2, (B, L)) * 31 % V).astype(np.int64)} for _ in range(steps)]
    if spec.storage is None:
        for i, ids in enumerate(batches):
            tables = grad(tables, se.preprocess(plan, ids)[0], i)
        return se.unstack_state(plan, tables)["t"]
    tiers = se.offload.Tiers(plan, rng)
    for i, item in enumerate(tiers.prefetch(batches)):
        tables = grad(tiers.swap(tables, item.swap), item.batch, i)
    tiers.flush(tables, step=steps)
    tiers.close()
    return None


def test_a_store_reads_as_the_in_memory_table_and_writes_back_on_another_mesh(tmp_path):
    memory = _train(_spec(), make_mesh(1))
    _train(_spec(tmp_path / "a"), make_mesh(8))
    state = se.offload.store_state(_spec(tmp_path / "a"), jax.random.key(3))
    assert set(state) == set(memory)
    for k in memory:  # every row: trained ones from the store, untouched ones generated as init_tables does
        np.testing.assert_array_equal(state[k], memory[k], err_msg=k)
    plan2 = se.plan([se.FeatureSpec("f", _spec(), B)], make_mesh(2))  # into memory on 2 devices, and out again
    slots = {k: v for k, v in state.items() if k != "table"}
    placed = se.stack_tables(plan2, {"t": state["table"]}, slots={"t": slots})
    back = se.unstack_state(plan2, placed)["t"]
    se.offload.write_store(_spec(tmp_path / "b"), back, step=10)
    again = se.offload.store_state(_spec(tmp_path / "b"), jax.random.key(99))  # every row stored: rng unused
    for k in memory:
        np.testing.assert_array_equal(again[k], memory[k], err_msg=k)


def test_write_store_names_a_missing_or_misshapen_array(tmp_path):
    with pytest.raises(ValueError, match=r"Table 't': write_store needs 'table' of shape \(2000, 8\)"):
        se.offload.write_store(_spec(tmp_path), {"table": np.zeros((V, 4), np.float32)})

