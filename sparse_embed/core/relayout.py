"""Every conversion between a table's layouts: one home for MOD, block and natural order.

- **Stacked (MOD)**: a stack's `[S * rows_per_shard, w]` array, sharded
  `P(axis)`; shard `s` holds global rows `[s*rps, (s+1)*rps)`, and its local
  row `j` is stack row `j*S + s`. A SparseCore stack is MOD over its N =
  S * C SparseCores (`StackPlan.mod_shards`), each table rotated (see
  `planning`): global row `p * R + e` (R = `sc_rows`) is row `e` of
  SparseCore `p`, stack row `e * N + (p - rotation) % N`. With C = 1 and no
  rotation this is the plain MOD layout, and one code path does both.
- **Natural blocks**: one table's `[stored_rows, w]` array in id order (row
  `i` is id `i`, rows `>= vocabulary_size` zero), `stored_rows` the
  vocabulary rounded up to a multiple of `S * S`, sharded `P(axis)` over
  the S devices: device `d` holds ids `[d * stored_rows / S, (d + 1) *
  stored_rows / S)`. Custom initializers generate tables this way, and
  checkpoints of sparse_embed <= 0.2 stored it. A SparseCore stack takes
  them padded to `block_rows` (whole rows of every SparseCore per device).
- **Natural chunks**: ids `[c0 * S, (c0 + m) * S)` of one table, device `d`
  holding `m` consecutive ids of them: what the checkpoint store streams.

Between MOD and either is one `all_to_all` per array (or chunk) under
`shard_map`: every device only ever holds its own block and its own shard,
never a whole table. Each placement owns its side of these conversions
(`core.placements`: "row" the MOD layout above; "table", "replicated" and
"column" gather a table's natural rows onto the devices that hold it); this
module holds what every placement shares and asks the stack's strategy for
the rest.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sparse_embed.core.planning import EmbeddingPlan, StackPlan, round_up
from sparse_embed.core.state import SLOT_DTYPE, EmbeddingVariables

TABLE_KEY = "table"  # the table's own entry among {"table": ..., slot_name: ...}


def stored_rows(vocabulary_size: int, num_shards: int) -> int:
    """Rows of the natural block array of a table on `num_shards` devices."""
    return round_up(vocabulary_size, num_shards * num_shards)


def natural_width(stack: StackPlan, key: str) -> int:
    """Columns of the table (`key` = TABLE_KEY) or slot `key` in id order: what a checkpoint stores."""
    return stack.embedding_dim if key == TABLE_KEY else stack.optimizer.slots(stack.embedding_dim)[key].width


def from_shard_major(stack: StackPlan, array: np.ndarray, width: int | None = None) -> np.ndarray:
    """A stacked global array (host) -> `[total_rows, width]` in stack-row order.

    `width`: the array's natural columns (for placements that split them; see `natural_width`).
    """
    return stack.strategy.from_shard_major(stack, array, width)


def stack_rows(stack: StackPlan, global_rows):
    """The stack row held at each global row of a stacked array (numpy or jnp; inverse of `from_shard_major`)."""
    return stack.strategy.stack_rows(stack, global_rows)


def block_rows(stack: StackPlan, i: int) -> int:
    """Rows of table i's natural blocks as `blocks_to_mod` takes them: `stored_rows`, or on SparseCores
    (`sparsecores`) a multiple of `S * N` that covers its padded rows, so every device's block is whole rows
    of all N SparseCores."""
    return stack.strategy.block_rows(stack, i, stored_rows(stack.tables[i].table.vocabulary_size, stack.num_shards))


def pad_blocks(stack: StackPlan, i: int, x: jax.Array) -> jax.Array:
    """Table i's natural blocks `[stored_rows, w]` padded with zeros to `block_rows` (jnp)."""
    return jnp.pad(x, ((0, block_rows(stack, i) - x.shape[0]), (0, 0)))


def blocks_to_mod(stack: StackPlan, blocks: list[jax.Array], axis: str) -> jax.Array:
    """Inside shard_map: each table's contiguous row block `[n*N, w]` (`block_rows`) -> this shard's rows.

    Shard d holds ids `[d*n*N, (d+1)*n*N)` of a table; its placement moves
    them where they live (`Placement.blocks_to_local`: "row" with one
    all_to_all; the others gather each table whole onto the devices that
    hold it). Rows past a table's vocabulary come through as the blocks
    have them.
    """
    return stack.strategy.blocks_to_local(stack, blocks, axis)


def _per_shard(plan: EmbeddingPlan, fn: Callable) -> Callable:
    """`fn` under shard_map over the plan's axis, every input and output row-sharded."""
    return jax.shard_map(fn, mesh=plan.mesh, in_specs=P(plan.axis_name), out_specs=P(plan.axis_name))


# (stack, index of the table in the stack) -> its initial values as natural blocks `[block_rows, dim]`
FreshTable = Callable[[StackPlan, int], jax.Array]


def from_natural(
    plan: EmbeddingPlan,
    natural: Mapping[str, Mapping[str, jax.Array]],
    valid_rows: Mapping[str, int],
    fresh_table: FreshTable | None = None,
) -> dict[str, EmbeddingVariables]:
    """Natural blocks (sharded as `plan.table_sharding()`, `[stored_rows(vocab, S), w]`) -> stacked state.

    Rows of table `t` with id `>= valid_rows[t]` (rows a smaller, older
    vocabulary did not have) get `fresh_table`'s values and the slots'
    initial values.
    """
    grows = any(valid_rows[t] < spec.vocabulary_size for t, spec in plan.tables.items())
    if grows and fresh_table is None:
        raise ValueError("Restoring a larger vocabulary needs the initial values of the new rows (rng=).")

    def fill(s: StackPlan, i: int, key: str, x: jax.Array) -> jax.Array:
        """Rows `< valid`: restored; `[valid, vocab)`: initial values; past the vocabulary: padding."""
        t, valid = s.tables[i].table, valid_rows[s.tables[i].table.name]
        ids = jnp.arange(x.shape[0])[:, None]
        if key == TABLE_KEY:  # the initializer pads past the vocabulary with zeros
            init = fresh_table(s, i).astype(x.dtype) if valid < t.vocabulary_size else jnp.zeros((), x.dtype)
        else:  # slot padding holds the initial value, as in init_tables
            x, init = x.astype(SLOT_DTYPE), jnp.asarray(s.optimizer.slots(s.embedding_dim)[key].init, SLOT_DTYPE)
        return jnp.where(ids < valid, x, init)

    def convert(natural):
        out = {}
        for s in plan.stacks:
            keys = [k for k in (TABLE_KEY, *s.optimizer.slots(s.embedding_dim)) if k in natural[s.tables[0].table.name]]
            arrays = {}
            for key in keys:
                blocks = [fill(s, i, key, pad_blocks(s, i, natural[p.table.name][key])) for i, p in enumerate(s.tables)]
                arrays[key] = _per_shard(plan, lambda *b, s=s: blocks_to_mod(s, list(b), plan.axis_name))(*blocks)
            slots = {k: v.astype(SLOT_DTYPE) for k, v in arrays.items() if k != TABLE_KEY}
            out[s.name] = EmbeddingVariables(arrays[TABLE_KEY].astype(s.dtype), slots)
        return out

    return jax.jit(convert, out_shardings=plan.table_sharding())(dict(natural))


# ----------------------------------------------------------------- natural rows in chunks (checkpoint streaming)
def chunk_rows(stack: StackPlan, row_bytes: int, target_bytes: int) -> int:
    """Rows `m` each device holds of a streamed chunk: a multiple of S ("row": of `mod_shards`,
    `Placement.chunk_align`), about `target_bytes`, at most the table.

    A chunk covers ids `[c0 * S, (c0 + m) * S)` of one table, `c0` a multiple of `m`; device d holds its
    natural rows `[c0 * S + d * m, c0 * S + (d + 1) * m)`, so every device's piece is one aligned range.
    """
    S, a = stack.num_shards, stack.strategy.chunk_align(stack)
    most = round_up(max(p.padded_rows for p in stack.tables) // S, a)
    return max(a, min(most, target_bytes // max(1, row_bytes) // a * a))


def table_range(stack: StackPlan, i: int) -> tuple[int, int, int]:
    """Where table i lies in its stack, as the chunk functions read it: `(start, count, rotation)`.

    "row": its rows on every MOD shard (a device, or a SparseCore), and its
    rotation. Others: its stack row of id 0 and its padded rows (rotation 0).
    """
    return stack.strategy.table_range(stack, i)


def mod_to_natural_chunk(stack: StackPlan, local: jax.Array, where: jax.Array, m: int, axis: str,
                         width: int) -> jax.Array:
    """Inside shard_map: the chunk's rows of one table, where its placement keeps them -> this device's natural
    rows `[c0 * S + d * m, c0 * S + (d + 1) * m)`, in order (`Placement.to_natural_chunk`).

    `where` = `[c0, start, count, rotation]` (int32): the chunk's first row,
    and the table's `table_range`. Rows past the table read as zeros.
    `width`: the natural columns (`natural_width`).
    """
    return stack.strategy.to_natural_chunk(stack, local, where, m, axis, width)


def natural_chunk_to_mod(stack: StackPlan, local: jax.Array, chunk: jax.Array, where: jax.Array,
                         axis: str) -> jax.Array:
    """Inside shard_map: the inverse of `mod_to_natural_chunk`, written into `local`.

    `where` = `[c0, start, count, rotation, valid]`: rows of ids `>= valid` are left as they are.
    """
    return stack.strategy.from_natural_chunk(stack, local, chunk, where, axis)


@functools.lru_cache(maxsize=256)
def natural_chunk_fn(plan: EmbeddingPlan, stack: StackPlan, m: int, width: int) -> Callable:
    """`(stacked array, where) -> [S * m, width]`: natural rows `[c0 * S, (c0 + m) * S)` of a table, row-sharded.

    One compile per stack, chunk size and width, shared by its tables (`where`: see `mod_to_natural_chunk`).
    """
    fn = jax.shard_map(lambda x, where: mod_to_natural_chunk(stack, x, where, m, plan.axis_name, width),
                       mesh=plan.mesh,
                       in_specs=(P(plan.axis_name), P()), out_specs=P(plan.axis_name))
    return jax.jit(fn, out_shardings=plan.table_sharding())


@functools.lru_cache(maxsize=256)
def write_chunk_fn(plan: EmbeddingPlan, stack: StackPlan) -> Callable:
    """`(stacked array (donated), chunk [S * m, w] row-sharded, where) -> stacked array` with the chunk written in."""
    fn = jax.shard_map(lambda x, chunk, where: natural_chunk_to_mod(stack, x, chunk, where, plan.axis_name),
                       mesh=plan.mesh, in_specs=(P(plan.axis_name), P(plan.axis_name), P()),
                       out_specs=P(plan.axis_name))
    return jax.jit(fn, donate_argnums=0, out_shardings=plan.table_sharding())
