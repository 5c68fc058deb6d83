"""Stacked, sharded table state: create it, and convert to/from per-table arrays.

A stack's table is `[num_shards * rows_per_shard, dim]`, sharded
`P(axis, None)`: shard `s` holds global rows `[s*rps, (s+1)*rps)`, and its
local row `j` is stack row `j*S + s` (MOD layout, see `planning`).
"""

from __future__ import annotations

import functools
import zlib
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import PartitionSpec as P

from sparse_embed.planning import EmbeddingPlan, StackPlan

SLOT_DTYPE = jnp.float32


class EmbeddingVariables(NamedTuple):
    """A stack's trainable state: `table [rows, dim]` and optimizer `slots {name: [rows, width]}`."""

    table: jax.Array
    slots: dict[str, jax.Array]


def table_key(rng: jax.Array, table_name: str) -> jax.Array:
    """The init key of one table: independent of stacking, mesh and other tables."""
    return jax.random.fold_in(rng, zlib.crc32(table_name.encode()) & 0x7FFFFFFF)


def from_shard_major(stack: StackPlan, array: np.ndarray) -> np.ndarray:
    """The sharded global layout -> `[total_rows, w]` in stack-row order (host)."""
    s, w = stack.num_shards, array.shape[-1]
    return array.reshape(s, stack.rows_per_shard, w).transpose(1, 0, 2).reshape(-1, w)


def _slot_arrays(stack: StackPlan) -> dict[str, jax.Array]:
    return {
        name: jnp.full((stack.total_rows, spec.width), spec.init, SLOT_DTYPE)
        for name, spec in stack.optimizer.slots(stack.embedding_dim).items()
    }


def _natural_table(plan: EmbeddingPlan, stack: StackPlan, rng: jax.Array, i: int) -> jax.Array:
    """Table i of the stack in id order, padded to a multiple of S*S rows, sharded by row blocks."""
    t, S = stack.tables[i].table, stack.num_shards
    w = t.resolved_initializer(table_key(rng, t.name), (t.vocabulary_size, t.embedding_dim), t.dtype)
    if w.shape != (t.vocabulary_size, t.embedding_dim):
        raise ValueError(
            f"Table {t.name!r}: initializer returned shape {w.shape}, expected {(t.vocabulary_size, t.embedding_dim)}."
        )
    w = jnp.pad(w.astype(t.dtype), ((0, -t.vocabulary_size % (S * S)), (0, 0)))
    return jax.lax.with_sharding_constraint(w, plan.table_sharding())


def blocks_to_mod(stack: StackPlan, blocks: list[jax.Array], axis: str) -> jax.Array:
    """Inside shard_map: each table's contiguous row block `[n*S, w]` -> this shard's MOD rows, stacked.

    Shard d holds rows `[d*n*S, (d+1)*n*S)` of a table; row r must go to shard
    `r % S`, local row `r // S`: one all_to_all of `[S, n, w]`. Rows past a
    table's vocabulary come through as the blocks have them.
    """
    S = stack.num_shards
    out = []
    for p, block in zip(stack.tables, blocks):
        n = block.shape[0] // S
        x = block.reshape(n, S, -1).transpose(1, 0, 2)
        out.append(jax.lax.all_to_all(x, axis, 0, 0, tiled=True).reshape(S * n, -1)[: p.padded_rows // S])
    return jnp.concatenate(out, axis=0)


def _slot_names(stack: StackPlan, with_slots: bool) -> list[str]:
    return list(stack.optimizer.slots(stack.embedding_dim)) if with_slots else []


def init_tables(plan: EmbeddingPlan, rng: jax.Array, *, with_slots: bool = True) -> dict[str, EmbeddingVariables]:
    """Initialises every stack, sharded: `{stack: EmbeddingVariables}`.

    Runs as one jit: each device generates a contiguous block of each
    table's rows and one all_to_all moves them to their MOD shard, so no
    device ever holds more than a few shards' worth of a table. A table's
    values depend only on `rng` and its name (not on stacking or mesh size);
    padding rows are zero; slots hold the optimizer's initial values.
    `with_slots=False` creates no optimizer slots (inference/eval memory);
    such tables can be looked up but not trained.
    """
    return _init_jit(plan, with_slots, rng)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_jit(plan: EmbeddingPlan, with_slots: bool, rng: jax.Array) -> dict[str, EmbeddingVariables]:
    """One compiled init per (plan, with_slots); outputs carry the table sharding."""
    sharding, axis = plan.table_sharding(), plan.axis_name
    out = {}
    for s in plan.stacks:
        blocks = [_natural_table(plan, s, rng, i) for i in range(len(s.tables))]
        relayout = jax.shard_map(
            lambda *b, s=s: blocks_to_mod(s, list(b), axis), mesh=plan.mesh,
            in_specs=P(axis, None), out_specs=P(axis, None),
        )
        slots = _slot_arrays(s) if with_slots else {}
        out[s.name] = EmbeddingVariables(relayout(*blocks), slots)
    return jax.lax.with_sharding_constraint(out, sharding)


def _check_arrays(plan: EmbeddingPlan, arrays: Mapping[str, np.ndarray], what: str) -> None:
    missing = sorted(set(plan.tables) - set(arrays))
    unknown = sorted(set(arrays) - set(plan.tables))
    if missing or unknown:
        raise ValueError(f"{what}: tables missing {missing}, unknown {unknown}; the plan has {sorted(plan.tables)}.")


def _stacked_global(plan: EmbeddingPlan, stack: StackPlan, per_table: dict[str, np.ndarray], width: int, fill, dtype):
    """Builds a sharded global array from per-table `[vocab, width]` host arrays, shard by shard."""
    s_count, rps = stack.num_shards, stack.rows_per_shard

    def shard(index):
        rows = np.arange(stack.num_shards * rps)[index[0]]
        stack_rows = (rows % rps) * s_count + rows // rps
        out = np.full((rows.size, width), fill, dtype)
        for p in stack.tables:
            ids = stack_rows - p.row_offset
            hit = (ids >= 0) & (ids < p.table.vocabulary_size)
            out[hit] = per_table[p.table.name][ids[hit]]
        return out[:, index[1]]

    return jax.make_array_from_callback((s_count * rps, width), plan.table_sharding(), shard, dtype=dtype)


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
    _check_arrays(plan, arrays, "stack_tables")
    if slots and not with_slots:
        raise ValueError("stack_tables: slots were given but with_slots=False.")
    host = {}
    for name, a in arrays.items():
        t = plan.tables[name]
        a = np.asarray(a)
        if a.shape != (t.vocabulary_size, t.embedding_dim):
            raise ValueError(
                f"Table {name!r}: array has shape {a.shape}, expected {(t.vocabulary_size, t.embedding_dim)}."
            )
        if not np.issubdtype(a.dtype, np.number):
            raise ValueError(f"Table {name!r}: array dtype {a.dtype} is not numeric.")
        host[name] = a
    out = {}
    for s in plan.stacks:
        table = _stacked_global(plan, s, host, s.embedding_dim, 0, s.dtype)
        slot_arrays = {}
        for slot_name in _slot_names(s, with_slots):
            spec, given = s.optimizer.slots(s.embedding_dim)[slot_name], {}
            for p in s.tables:
                v = None if slots is None else slots.get(p.table.name, {}).get(slot_name)
                if v is None:
                    v = np.full((p.table.vocabulary_size, spec.width), spec.init, SLOT_DTYPE)
                v = np.asarray(v)
                if v.shape != (p.table.vocabulary_size, spec.width):
                    raise ValueError(
                        f"Table {p.table.name!r}: slot {slot_name!r} has shape {v.shape}, "
                        f"expected {(p.table.vocabulary_size, spec.width)}."
                    )
                given[p.table.name] = v
            slot_arrays[slot_name] = _stacked_global(plan, s, given, spec.width, spec.init, SLOT_DTYPE)
        out[s.name] = EmbeddingVariables(table, slot_arrays)
    return out


def check_state(plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables]) -> None:
    missing = sorted(set(plan.stack_names) - set(tables))
    unknown = sorted(set(tables) - set(plan.stack_names))
    if missing or unknown:
        raise ValueError(
            f"tables do not match the plan: stacks missing {missing}, unknown {unknown}; "
            f"the plan has {list(plan.stack_names)}."
        )
    for s in plan.stacks:
        v = tables[s.name]
        shape = tuple(v.table.shape)
        if shape != (s.total_rows, s.embedding_dim):
            raise ValueError(f"Stack {s.name!r}: table has shape {shape}, the plan expects {(s.total_rows, s.embedding_dim)}.")
        specs = s.optimizer.slots(s.embedding_dim)
        if v.slots and set(v.slots) != set(specs):
            raise ValueError(
                f"Stack {s.name!r}: slots {sorted(v.slots)} do not match its {type(s.optimizer).__name__} "
                f"optimizer's {sorted(specs)}."
            )
        for name, a in v.slots.items():
            if tuple(a.shape) != (s.total_rows, specs[name].width):
                raise ValueError(
                    f"Stack {s.name!r}: slot {name!r} has shape {tuple(a.shape)}, "
                    f"the plan expects {(s.total_rows, specs[name].width)}."
                )


def _to_host(a: jax.Array) -> np.ndarray:
    """The whole global array on this host (gathered from the other processes if it spans several)."""
    if getattr(a, "is_fully_addressable", True):
        return np.asarray(a)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def unstack_tables(plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables]) -> dict[str, np.ndarray]:
    """The stacked state -> `{table_name: np.ndarray [vocabulary_size, dim]}` (mesh-independent)."""
    check_state(plan, tables)
    return {name: arrays["table"] for name, arrays in unstack_state(plan, tables).items()}


def unstack_state(plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables]) -> dict[str, dict[str, np.ndarray]]:
    """`{table_name: {"table": [vocab, dim], slot_name: [vocab, width], ...}}` on the host."""
    check_state(plan, tables)
    out: dict[str, dict[str, np.ndarray]] = {}
    for s in plan.stacks:
        v = tables[s.name]
        arrays = {"table": v.table, **v.slots}
        rows = {k: from_shard_major(s, _to_host(a)) for k, a in arrays.items()}
        for p in s.tables:
            sl = slice(p.row_offset, p.row_offset + p.table.vocabulary_size)
            out[p.table.name] = {k: r[sl] for k, r in rows.items()}
    return out
