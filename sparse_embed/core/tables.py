"""Stacked, sharded table state: create it, and convert it to and from per-table arrays.

A stack's table is `[num_shards * rows_per_shard, dim]` (`array_rows`),
sharded `P(axis)` in its placement's layout (see `relayout`); its slots have
the same rows.
"""

from __future__ import annotations

import functools
import zlib
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparse_embed.core.initializers import TruncatedNormal, seeds, truncated_normal_rows
from sparse_embed.core.planning import EmbeddingPlan, StackPlan
from sparse_embed.core.relayout import (TABLE_KEY, block_rows, blocks_to_mod, from_shard_major, natural_width,
                                        stack_rows)
from sparse_embed.core.state import SLOT_DTYPE, EmbeddingVariables, check_state


def check_rng(rng) -> None:
    """One PRNG key: a typed one (`jax.random.key`) of shape (), or raw `uint32` key data (`jax.random.PRNGKey`);
    else a TypeError saying so (jax's own was "invalid PRNG key data: expected key_data.ndim >= 1")."""
    dtype = getattr(rng, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        ok = rng.shape == ()
    else:
        ok = dtype == np.uint32 and np.ndim(rng) == 1
    if not ok:
        got = f"{type(rng).__name__} {rng!r}" if dtype is None else f"{dtype} of shape {tuple(rng.shape)}"
        raise TypeError(f"rng must be one PRNG key, jax.random.key(seed) (or jax.random.PRNGKey(seed)), got {got}.")


def _name_hash(table_name: str) -> int:
    return zlib.crc32(table_name.encode()) & 0x7FFFFFFF


def table_key(rng: jax.Array, table_name: str) -> jax.Array:
    """The init key of one table: independent of stacking, mesh and other tables."""
    check_rng(rng)
    return jax.random.fold_in(rng, _name_hash(table_name))


def table_seeds(rng: jax.Array, table_names: Sequence[str]) -> jax.Array:
    """`[len(table_names), 2]` uint32: each table's `seeds(table_key(rng, name))`, the same values computed as one
    batched hash. Two threefry hashes per table each became a piece of the init program to compile: a plan of
    dozens of tables compiled its init for seconds."""
    check_rng(rng)
    if not table_names:
        return jnp.zeros((0, 2), jnp.uint32)
    hashes = jnp.asarray(np.array([_name_hash(n) for n in table_names], np.uint32))
    return jax.vmap(lambda h: seeds(jax.random.fold_in(rng, h)))(hashes)


def natural_table(plan: EmbeddingPlan, stack: StackPlan, rng: jax.Array, i: int) -> jax.Array:
    """Table i of the stack, initialised, as natural blocks `[block_rows, dim]` (see `relayout`)."""
    t = stack.tables[i].table
    w = t.resolved_initializer(table_key(rng, t.name), (t.vocabulary_size, t.embedding_dim), t.dtype)
    if w.shape != (t.vocabulary_size, t.embedding_dim):
        raise ValueError(
            f"Table {t.name!r}: initializer returned shape {w.shape}, expected {(t.vocabulary_size, t.embedding_dim)}."
        )
    w = jnp.pad(w.astype(t.dtype), ((0, block_rows(stack, i) - t.vocabulary_size), (0, 0)))
    return jax.lax.with_sharding_constraint(w, plan.table_sharding())


def _slot_arrays(stack: StackPlan) -> dict[str, jax.Array]:
    widths = stack.slot_widths()
    return {name: jnp.full((stack.array_rows, widths[name]), spec.init, SLOT_DTYPE)
            for name, spec in stack.optimizer.slots(stack.embedding_dim).items()}


def init_tables(plan: EmbeddingPlan, rng: jax.Array, *, with_slots: bool = True) -> dict[str, EmbeddingVariables]:
    """Initialises every stack, sharded: `{stack: EmbeddingVariables}`.

    Runs as one jit. With the default (positional) initializer each device
    generates its own rows in place, in one pass; with any other
    initializer each device generates a contiguous block of each table's
    rows and one all_to_all moves them to their MOD shard. A table's
    values depend only on `rng` and its name (not on stacking or mesh size);
    padding rows are zero; slots hold the optimizer's initial values.
    `with_slots=False` creates no optimizer slots (inference/eval memory);
    such tables can be looked up but not trained.
    """
    check_rng(rng)  # before jit: names what was given (an int seed, not the tracer it becomes)
    return _init_jit(plan, with_slots, rng)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_jit(plan: EmbeddingPlan, with_slots: bool, rng: jax.Array) -> dict[str, EmbeddingVariables]:
    """One compiled init per (plan, with_slots); outputs carry the table sharding."""
    positional = [p.table.name for s in plan.stacks if _is_positional(s) for p in s.tables]
    seed_of = dict(zip(positional, table_seeds(rng, positional)))
    out = {}
    for s in plan.stacks:
        table = _positional_stack(plan, s, seed_of) if _is_positional(s) else _relaid_stack(plan, s, rng)
        out[s.name] = EmbeddingVariables(table, _slot_arrays(s) if with_slots else {})
    return jax.lax.with_sharding_constraint(out, plan.table_sharding())


def _is_positional(stack: StackPlan) -> bool:
    return all(isinstance(p.table.resolved_initializer, TruncatedNormal) for p in stack.tables)


def _positional_stack(plan: EmbeddingPlan, stack: StackPlan, seed_of: Mapping[str, jax.Array]) -> jax.Array:
    """The stacked table generated where its rows live: each element from (table key, id, column); padding zero."""
    g = jax.lax.with_sharding_constraint(jnp.arange(stack.array_rows, dtype=jnp.uint32), plan.table_sharding())
    srow = stack_rows(stack, g)  # the stack row each global row holds
    tables = sorted(stack.tables, key=lambda p: p.row_offset)
    offsets = np.array([p.row_offset for p in tables], np.uint32)
    which = jnp.searchsorted(jnp.asarray(offsets), srow, side="right") - 1
    ids = srow - jnp.asarray(offsets)[which]
    vocab = jnp.asarray(np.array([p.table.vocabulary_size for p in tables], np.uint32))[which]
    keys = jnp.stack([seed_of[p.table.name] for p in tables])[which]
    stddev = jnp.asarray(np.array([p.table.resolved_initializer.stddev for p in tables], np.float32))[which]
    values = truncated_normal_rows(keys, ids, stack.embedding_dim, stddev, stack.dtype)
    values = stack.strategy.local_columns(stack, g, values, 0, jnp)  # the columns each global row holds
    return jnp.where((ids < vocab)[:, None], values, jnp.zeros((), stack.dtype))


def _relaid_stack(plan: EmbeddingPlan, stack: StackPlan, rng: jax.Array) -> jax.Array:
    """Any initializer: each table generated whole (natural blocks), then its rows moved to their MOD shards."""
    blocks = [natural_table(plan, stack, rng, i) for i in range(len(stack.tables))]
    relayout = jax.shard_map(lambda *b: blocks_to_mod(stack, list(b), plan.axis_name), mesh=plan.mesh,
                             in_specs=jax.P(plan.axis_name), out_specs=jax.P(plan.axis_name))
    return relayout(*blocks)


def _check_no_raw_ids(plan: EmbeddingPlan, what: str) -> None:
    """A raw-id table has no `[vocabulary_size, dim]` form: its rows are id map slots (which depend on the mesh),
    its ids in the map."""
    raw = sorted(t.table.name for st in plan.stacks if st.dynamic is not None for t in st.tables)
    if raw:
        raise ValueError(f"{what}: tables {raw} are keyed by raw ids: their rows are id map slots, not rows by "
                         "id; read them with sparse_embed.raw_ids.id_table_contents (ids with their rows) and "
                         "write them with load_id_tables (docs/raw_ids.md).")


def _check_arrays(plan: EmbeddingPlan, arrays: Mapping[str, np.ndarray], what: str) -> None:
    missing = sorted(set(plan.tables) - set(arrays))
    unknown = sorted(set(arrays) - set(plan.tables))
    if missing or unknown:
        raise ValueError(f"{what}: tables missing {missing}, unknown {unknown}; the plan has {sorted(plan.tables)}.")


def _stacked_global(plan: EmbeddingPlan, stack: StackPlan, per_table: dict[str, np.ndarray], width: int, fill, dtype):
    """Builds a sharded global array from per-table `[vocab, width]` host arrays, shard by shard (each global
    row's columns of them, where the placement splits arrays as wide as the table over the devices)."""
    w = stack.array_dim if stack.splits(width) else width  # the array's columns

    def shard(index):
        g = np.arange(stack.array_rows)[index[0]]
        rows = stack_rows(stack, g)
        out = np.full((rows.size, width), fill, dtype)
        for p in stack.tables:
            ids = rows - p.row_offset
            hit = (ids >= 0) & (ids < p.table.vocabulary_size)
            out[hit] = per_table[p.table.name][ids[hit]]
        return stack.strategy.local_columns(stack, g, out, fill, np)[:, index[1]]

    return jax.make_array_from_callback((stack.array_rows, w), plan.table_sharding(), shard, dtype=dtype)


def host_array(name: str, what: str, a, shape: tuple[int, int]) -> np.ndarray:
    """`a` as numpy, checked: `shape`, and real numbers (a ValueError naming table `name` and `what` it is)."""
    a = np.asarray(a)
    if a.shape != shape:
        raise ValueError(f"Table {name!r}: {what} has shape {a.shape}, expected {shape}.")
    if not jnp.issubdtype(a.dtype, jnp.number):  # numpy's own check calls bfloat16 (ml_dtypes) not numeric
        raise ValueError(f"Table {name!r}: {what} dtype {a.dtype} is not numeric.")
    if jnp.issubdtype(a.dtype, jnp.complexfloating):  # (the cast to the table's dtype would drop the imaginary part)
        raise ValueError(f"Table {name!r}: {what} dtype {a.dtype} is complex; a table holds real numbers.")
    return a


def stack_tables(
    plan: EmbeddingPlan,
    arrays: Mapping[str, np.ndarray],
    slots: Mapping[str, Mapping[str, np.ndarray]] | None = None,
    *,
    with_slots: bool = True,
) -> dict[str, EmbeddingVariables]:
    """Per-table `{name: [vocabulary_size, dim]}` arrays -> the plan's stacked, sharded state.

    Slots are fresh (the optimizer's initial values) unless `slots`
    (`{table: {slot_name: [vocabulary_size, width]}}`) gives them;
    `with_slots=False` creates none (inference). Inverse of `unstack_state`.
    """
    _check_no_raw_ids(plan, "stack_tables")
    _check_arrays(plan, arrays, "stack_tables")
    if slots and not with_slots:
        raise ValueError("stack_tables: slots were given but with_slots=False.")
    for name, given in (slots or {}).items():  # else a misspelt one would be fresh silently
        if name not in plan.tables:
            raise ValueError(f"stack_tables: slots name table {name!r}, which the plan does not have; tables are "
                             f"{sorted(plan.tables)}.")
        o = plan.tables[name].resolved_optimizer
        has = sorted(o.slots(plan.tables[name].embedding_dim))
        if unknown := sorted(set(given) - set(has)):
            raise ValueError(f"stack_tables: table {name!r} has no slots {unknown}: its optimizer "
                             f"{type(o).__name__} has {has}.")
    host = {n: host_array(n, "array", a, (plan.tables[n].vocabulary_size, plan.tables[n].embedding_dim))
            for n, a in arrays.items()}
    out = {}
    for s in plan.stacks:
        slot_arrays = {}
        for slot_name, spec in (s.optimizer.slots(s.embedding_dim) if with_slots else {}).items():
            given = {}
            for p in s.tables:
                v = (slots or {}).get(p.table.name, {}).get(slot_name)
                shape = (p.table.vocabulary_size, spec.width)
                given[p.table.name] = (np.full(shape, spec.init, SLOT_DTYPE) if v is None
                                       else host_array(p.table.name, f"slot {slot_name!r}", v, shape))
            slot_arrays[slot_name] = _stacked_global(plan, s, given, spec.width, spec.init, SLOT_DTYPE)
        out[s.name] = EmbeddingVariables(_stacked_global(plan, s, host, s.embedding_dim, 0, s.dtype), slot_arrays)
    return out


def to_host(a: jax.Array) -> np.ndarray:
    """The whole global array on this host (gathered from the other processes if it spans several)."""
    if getattr(a, "is_fully_addressable", True):
        return np.asarray(a)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def unstack_tables(plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables]) -> dict[str, np.ndarray]:
    """The stacked state -> `{table_name: np.ndarray [vocabulary_size, dim]}`: row i of each table, whatever the
    mesh. Raw-id tables are refused (their rows are id map slots: `raw_ids.id_table_contents` reads them); an
    offloaded table's array is its cache (`[cache_rows, dim]`: `offload.store_state` reads the table)."""
    _check_no_raw_ids(plan, "unstack_tables")
    return {name: arrays[TABLE_KEY] for name, arrays in unstack_state(plan, tables).items()}


def unstack_state(plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables]) -> dict[str, dict[str, np.ndarray]]:
    """`{table_name: {"table": [vocab, dim], slot_name: [vocab, width], ...}}` on the host (raw-id and offloaded
    tables: their stacks' rows, map or cache slots, as `unstack_tables` says)."""
    check_state(plan, tables)
    out: dict[str, dict[str, np.ndarray]] = {}
    for s in plan.stacks:
        v = tables[s.name]
        rows = {k: from_shard_major(s, to_host(a), natural_width(s, k))
                for k, a in {TABLE_KEY: v.table, **v.slots}.items()}
        for p in s.tables:
            sl = slice(p.row_offset, p.row_offset + p.table.vocabulary_size)
            out[p.table.name] = {k: r[sl] for k, r in rows.items()}
    return out


def empty_tables(plan: EmbeddingPlan, *, with_slots: bool = True) -> dict[str, EmbeddingVariables]:
    """Zero tables and slots at their initial values, sharded: the state a restore writes into."""
    return _empty_jit(plan, with_slots)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _empty_jit(plan: EmbeddingPlan, with_slots: bool) -> dict[str, EmbeddingVariables]:
    out = {s.name: EmbeddingVariables(jnp.zeros((s.array_rows, s.array_dim), s.dtype),
                                      _slot_arrays(s) if with_slots else {}) for s in plan.stacks}
    return jax.lax.with_sharding_constraint(out, plan.table_sharding())
