"""Swapping rows in and out of a table's device cache: the device side of an offloaded table (`sparse_embed.tiers`).

An offloaded table's stack is a cache of `cache_rows` rows; which id each
cache row holds is the host's business. Before a step, the rows its batch
misses are written into the cache rows the host chose, and the rows they
replace are read out first (the host writes them back to the store if they
changed). Rows never written to the store are generated here by the table's
positional initializer, so the cache fills with exactly the values
`init_tables` gives the in-memory table.

All arrays are padded to a bucket size `n` (a power of two) so that the swap
compiles a few times, not every step; padding entries have position -1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sparse_embed.core.initializers import seeds, truncated_normal_rows
from sparse_embed.core.planning import EmbeddingPlan, StackPlan
from sparse_embed.core.relayout import TABLE_KEY, stack_rows
from sparse_embed.core.specs import TableSpec
from sparse_embed.core.state import EmbeddingVariables


def cache_positions(stack: StackPlan) -> np.ndarray:
    """`[cache_rows]` int32: the global array row that holds each cache row (row `c` of the stack's one table)."""
    rows = np.asarray(stack_rows(stack, np.arange(stack.array_rows)))
    where = np.empty(stack.array_rows, np.int64)
    where[rows] = np.arange(stack.array_rows)
    return where[:stack.tables[0].table.vocabulary_size].astype(np.int32)


def fresh_rows(t: TableSpec, table_key: jax.Array, ids: jax.Array) -> dict[str, jax.Array]:
    """`{"table": [n, dim], slot: [n, width]}`: the initial values of rows `ids` (uint32) of table `t`."""
    out = {TABLE_KEY: truncated_normal_rows(seeds(table_key), ids, t.embedding_dim,
                                           t.resolved_initializer.stddev, t.dtype)}
    for name, spec in t.resolved_optimizer.slots(t.embedding_dim).items():
        out[name] = jnp.full((ids.shape[0], spec.width), spec.init, jnp.float32)
    return out


def _gathered(x: jax.Array, axis: str) -> jax.Array:
    """The sum over `axis` of blocks in which each entry is non-zero on one device at most: that device's bits
    exactly (added as integers; a float sum would turn -0.0 into 0.0)."""
    ints = {2: jnp.int16, 4: jnp.int32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(jax.lax.psum(jax.lax.bitcast_convert_type(x, ints), axis), x.dtype)


def _combined(plan: EmbeddingPlan, fill: dict[str, jax.Array], fresh: jax.Array) -> tuple[dict, jax.Array]:
    """`fill` and `fresh` (or None) given per process (`[S * n, ...]` over the plan's axis: each device's block
    is its process's rows, or zeros), added up into `[n, ...]` on every device (each entry is non-zero in its
    row's owner's block only)."""
    axis = plan.axis_name

    def add(fill, fresh):
        fresh = None if fresh is None else jax.lax.psum(fresh.astype(jnp.int32), axis) > 0
        return {k: _gathered(v, axis) for k, v in fill.items()}, fresh

    return jax.shard_map(add, mesh=plan.mesh, in_specs=(P(axis), P(axis)), out_specs=(P(), P()))(fill, fresh)


def _local_at(at: jax.Array, lo: jax.Array, rps: int) -> jax.Array:
    """Global array rows `at` (-1: padding) as rows of this device's shard; `rps` (out of bounds) where not its."""
    local = at - lo
    return jnp.where((local >= 0) & (local < rps) & (at >= 0), local, rps)


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=("per_process",), donate_argnums=(2,))
def swap_rows(plan: EmbeddingPlan, stack_name: str, variables: EmbeddingVariables, table_key: jax.Array,
              evict_at: jax.Array, fill_at: jax.Array, fill: dict[str, jax.Array], fresh: jax.Array | None,
              fresh_ids: jax.Array | None, *, per_process: bool = False
              ) -> tuple[EmbeddingVariables, dict[str, jax.Array]]:
    """Reads rows out of a stack's cache, then writes rows in (in place: `variables` is donated).

    Args:
      evict_at: `[n]` int32 global array rows to read out (-1: padding).
      fill_at: `[n]` int32 global array rows to write (-1: padding); never one
        that another entry writes.
      fill: `{"table": [n, dim], slot: [n, width]}` the rows to write (from the store).
      fresh: `[n]` bool: write the initializer's row `fresh_ids[i]` (and initial
        slots) instead of `fill`'s (a row never stored); None: none is.
      fresh_ids: `[n]` uint32 table rows for `fresh` entries (None with `fresh`).
      per_process: `fill` and `fresh` come from several processes, each its own rows (see `_combined`).

    Returns:
      `(variables, evicted)`: the cache with the rows written, and
      `{"table": [n, dim], slot: [n, width]}` the rows at `evict_at` before
      the write (replicated; zeros at padding).
    """
    stack = plan.stack(stack_name)
    if per_process:
        fill, fresh = _combined(plan, fill, fresh)
    if fresh is not None:
        new = fresh_rows(stack.tables[0].table, table_key, fresh_ids)
        fill = {k: jnp.where(fresh[:, None], new[k], v) for k, v in fill.items()}
    arrays = {TABLE_KEY: variables.table, **variables.slots}
    axis, rps = plan.axis_name, stack.rows_per_shard

    def swap(arrays, evict_at, fill_at, fill):
        lo = jax.lax.axis_index(axis) * rps
        out, evicted = {}, {}
        for k, local in arrays.items():
            at = _local_at(evict_at, lo, rps)
            rows = jnp.where((at < rps)[:, None], local[jnp.minimum(at, rps - 1)], jnp.zeros((), local.dtype))
            evicted[k] = _gathered(rows, axis)
            out[k] = local.at[_local_at(fill_at, lo, rps)].set(fill[k].astype(local.dtype), mode="drop")
        return out, evicted

    out, evicted = jax.shard_map(swap, mesh=plan.mesh, in_specs=(P(axis), P(), P(), P()),
                                 out_specs=(P(axis), P()))(arrays, evict_at, fill_at, fill)
    return EmbeddingVariables(out.pop(TABLE_KEY), out), evicted


@functools.partial(jax.jit, static_argnums=(0, 1))
def read_rows(plan: EmbeddingPlan, stack_name: str, variables: EmbeddingVariables, at: jax.Array
              ) -> dict[str, jax.Array]:
    """`{"table": [n, dim], slot: [n, width]}`: the rows at global array rows `at` (`[n]` int32, -1: padding, zeros)
    of a stack's cache, replicated. Reads only: `variables` is not donated, so a flush whose write to the store
    fails leaves the caller's tables whole (it can be retried)."""
    stack = plan.stack(stack_name)
    arrays = {TABLE_KEY: variables.table, **variables.slots}
    axis, rps = plan.axis_name, stack.rows_per_shard

    def read(arrays, at):
        local = _local_at(at, jax.lax.axis_index(axis) * rps, rps)
        return {k: _gathered(jnp.where((local < rps)[:, None], v[jnp.minimum(local, rps - 1)], jnp.zeros((), v.dtype)),
                             axis)
                for k, v in arrays.items()}

    return jax.shard_map(read, mesh=plan.mesh, in_specs=(P(axis), P()), out_specs=P())(arrays, at)


@functools.partial(jax.jit, static_argnums=(0,))
def initial_rows(t: TableSpec, table_key: jax.Array, ids: jax.Array) -> dict[str, jax.Array]:
    """`fresh_rows` as its own computation: an offloaded table's rows never stored, generated ahead of the swap
    that writes them (`write_rows`), beside the step before it."""
    return fresh_rows(t, table_key, ids)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2,))
def write_rows(plan: EmbeddingPlan, stack_name: str, variables: EmbeddingVariables, at: jax.Array,
               rows: dict[str, jax.Array]) -> EmbeddingVariables:
    """Writes `rows` (`{"table": [n, dim], slot: [n, width]}`, replicated) at global array rows `at` (`[n]` int32,
    -1: padding; distinct) of a stack's cache, in place.

    Under one process, the rows a batch misses that were never stored (`initial_rows`) go in apart from
    `swap_rows`' fill: no fill of zeros is made or moved for them.
    """
    stack = plan.stack(stack_name)
    arrays = {TABLE_KEY: variables.table, **variables.slots}
    axis, rps = plan.axis_name, stack.rows_per_shard

    def write(arrays, at, rows):
        to = _local_at(at, jax.lax.axis_index(axis) * rps, rps)
        return {k: local.at[to].set(rows[k].astype(local.dtype), mode="drop") for k, local in arrays.items()}

    out = jax.shard_map(write, mesh=plan.mesh, in_specs=(P(axis), P(), P()), out_specs=P(axis))(arrays, at, rows)
    return EmbeddingVariables(out.pop(TABLE_KEY), out)
