"""`core.row_swap` (`swap_rows`, `initial_rows`, `write_rows`), the device side of an offloaded table, against
plain numpy: the rows read out are the cache's rows bit for bit (-0.0 included), the rows written in are the
fill's or the initializer's; per process (blocks added up on the devices) as replicated."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import sparse_embed as se
from sparse_embed.core.row_swap import cache_positions, initial_rows, swap_rows, write_rows
from sparse_embed.core.tables import table_key
from tests.conftest import make_mesh

V, D, C, N = 100, 4, 24, 4  # table rows, width, cache rows, swap entries


def _offloaded(path, devices: int, g: np.random.Generator) -> tuple:
    """`(spec, plan, stack, cache)`: an offloaded table and random cache rows `{"table": [C, D], "accumulator":
    [C, 1]}`."""
    spec = se.TableSpec("t", V, D, optimizer=se.optimizers.RowwiseAdagrad(0.1),
                        storage=se.offload.Offload(str(path), C))
    plan = se.plan([se.FeatureSpec("f", spec, 8)], make_mesh(devices))
    cache = {"table": g.standard_normal((C, D)).astype(np.float32), "accumulator": g.random((C, 1), np.float32)}
    return spec, plan, plan.stack_of_table("t")[0], cache


def _stacked(plan, cache: dict) -> dict:
    return se.stack_tables(plan, {"t": cache["table"]}, slots={"t": {"accumulator": cache["accumulator"]}})


@pytest.mark.parametrize("per_process", [False, True])
@pytest.mark.parametrize("devices", [1, 8])
def test_swap_rows_against_numpy(tmp_path, devices, per_process):
    g = np.random.default_rng(0)
    spec, plan, stack, cache = _offloaded(tmp_path, devices, g)
    cache["table"][5, :2] = -0.0
    variables = _stacked(plan, cache)
    at = cache_positions(stack)
    evict = np.array([5, 3, 11, -1])
    put = np.array([5, 3, 20, -1])  # cache rows written: 20 gets the initializer's row of table row 77
    fill = {"table": g.standard_normal((N, D)).astype(np.float32), "accumulator": g.random((N, 1), np.float32)}
    fill["table"][0, 1] = -0.0
    fresh = np.array([False, False, True, False])
    ids = np.array([0, 0, 77, 0], np.uint32)
    if per_process:  # one process: block 0 holds its rows, the others zeros
        S = plan.num_shards
        fill_in = {k: np.concatenate([v] + [np.zeros_like(v)] * (S - 1)) for k, v in fill.items()}
        fresh_in = np.concatenate([fresh] + [np.zeros_like(fresh)] * (S - 1))
    else:
        fill_in, fresh_in = fill, fresh
    out, evicted = swap_rows(plan, stack.name, variables["t"], table_key(jax.random.key(0), "t"),
                             np.where(evict >= 0, at[np.maximum(evict, 0)], -1).astype(np.int32),
                             np.where(put >= 0, at[np.maximum(put, 0)], -1).astype(np.int32), fill_in, fresh_in, ids,
                             per_process=per_process)
    got = se.unstack_state(plan, {"t": out})["t"]
    for k in ("table", "accumulator"):
        want_out = np.zeros((N,) + cache[k].shape[1:], np.float32)
        want_out[:3] = cache[k][evict[:3]]
        np.testing.assert_array_equal(np.asarray(evicted[k]).view(np.uint32), want_out.view(np.uint32), err_msg=k)
        want = cache[k].copy()
        want[put[:2]] = fill[k][:2]
        keep = np.setdiff1d(np.arange(C), [20])
        np.testing.assert_array_equal(got[k][keep].view(np.uint32), want[keep].view(np.uint32), err_msg=k)
    assert not np.array_equal(got["table"][20], cache["table"][20])  # the initializer's row came in
    initial = np.float32(spec.resolved_optimizer.slots(D)["accumulator"].init)
    np.testing.assert_array_equal(got["accumulator"][20], initial)


@pytest.mark.parametrize("devices", [1, 8])
def test_initial_rows_written_apart(tmp_path, devices):
    """`initial_rows` and `write_rows` put the in-memory table's initial rows (bit for bit) and initial slots at
    the cache rows given, and leave every other row; `swap_rows` without `fresh` writes the fill as given."""
    g = np.random.default_rng(1)
    spec, plan, stack, cache = _offloaded(tmp_path, devices, g)
    variables = _stacked(plan, cache)
    at, key = cache_positions(stack), jax.random.key(3)
    put, rows = np.array([7, 2, 19, -1]), np.array([77, 0, 99, 5], np.uint32)
    new = initial_rows(stack.tables[0].table, table_key(key, "t"), rows)
    out = write_rows(plan, stack.name, variables["t"], np.where(put >= 0, at[np.maximum(put, 0)], -1).astype(np.int32),
                     new)
    fill = {"table": g.standard_normal((N, D)).astype(np.float32), "accumulator": g.random((N, 1), np.float32)}
    out, _ = swap_rows(plan, stack.name, out, table_key(key, "t"), np.full(N, -1, np.int32),
                       np.array([at[1], -1, -1, -1], np.int32), fill, None, None)
    got = se.unstack_state(plan, {"t": out})["t"]
    in_memory = se.plan([se.FeatureSpec("f", dataclasses.replace(spec, storage=None), 8)], make_mesh(1))
    initial = se.unstack_state(in_memory, se.init_tables(in_memory, key))["t"]
    want = {k: v.copy() for k, v in cache.items()}
    for k in want:
        want[k][put[:3]] = initial[k][rows[:3]]
        want[k][1] = fill[k][0]
        np.testing.assert_array_equal(got[k].view(np.uint32), want[k].view(np.uint32), err_msg=k)
