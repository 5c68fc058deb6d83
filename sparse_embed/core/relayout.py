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
never a whole table. Stacks placed "table" or "replicated" (see
`planning`) hold whole tables: a stack row is a global row of the array
("table"), or of its first copy ("replicated"), and their conversions gather
a table's natural rows onto the devices that hold it. A "column" stack
holds every row on every device, each device `w` columns of it (the array
is the column blocks one after the other; a per-row slot, e.g.
RowwiseAdagrad's, is held whole, as "replicated"); its conversions move
columns with one all_to_all.
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

    `width`: the array's natural columns ("column" placement; see `natural_width`).
    """
    if stack.placement == "table":
        return array
    if stack.placement == "replicated":
        return array[: stack.total_rows]  # the first copy
    if stack.placement == "column":  # the column blocks side by side (a per-row slot: D copies; the first)
        D, w = stack.num_shards, array.shape[-1]
        return array.reshape(D, stack.total_rows, w).transpose(1, 0, 2).reshape(stack.total_rows, D * w)[:, :width]
    N, w = stack.mod_shards, array.shape[-1]
    x = array.reshape(N, stack.sc_rows, w)
    parts = []
    for p in stack.tables:  # [N, rows, w] at its rows of every shard; shard (c + rotation) % N holds ids = c mod N
        o, n = p.row_offset // N, p.padded_rows // N
        parts.append(np.roll(x[:, o:o + n], -p.rotation, axis=0).transpose(1, 0, 2).reshape(-1, w))
    return np.concatenate(parts)


def stack_rows(stack: StackPlan, global_rows):
    """The stack row held at each global row of a stacked array (numpy or jnp; inverse of `from_shard_major`)."""
    if stack.placement == "table":
        return global_rows
    if stack.placement in ("replicated", "column"):
        return global_rows % stack.total_rows
    N, R = stack.mod_shards, stack.sc_rows
    shard, row = global_rows // R, global_rows % R
    if not any(p.rotation for p in stack.tables):
        return row * N + shard
    xp = jnp if isinstance(global_rows, jax.Array) else np
    which = xp.searchsorted(xp.asarray([p.row_offset // N for p in stack.tables]), row, side="right") - 1
    rotation = xp.asarray([p.rotation for p in stack.tables])[which]
    return row * N + (shard - rotation) % N


def block_rows(stack: StackPlan, i: int) -> int:
    """Rows of table i's natural blocks as `blocks_to_mod` takes them: `stored_rows`, or on SparseCores
    (`sparsecores`) a multiple of `S * N` that covers its padded rows, so every device's block is whole rows
    of all N SparseCores."""
    p, rows = stack.tables[i], stored_rows(stack.tables[i].table.vocabulary_size, stack.num_shards)
    if stack.placement != "row" or not stack.sparsecores:
        return rows
    return round_up(max(rows, p.padded_rows), stack.num_shards * stack.mod_shards)


def pad_blocks(stack: StackPlan, i: int, x: jax.Array) -> jax.Array:
    """Table i's natural blocks `[stored_rows, w]` padded with zeros to `block_rows` (jnp)."""
    return jnp.pad(x, ((0, block_rows(stack, i) - x.shape[0]), (0, 0)))


def blocks_to_mod(stack: StackPlan, blocks: list[jax.Array], axis: str) -> jax.Array:
    """Inside shard_map: each table's contiguous row block `[n*N, w]` (`block_rows`) -> this shard's rows.

    Shard d holds ids `[d*n*N, (d+1)*n*N)` of a table; id i goes to MOD
    shard `p = (i % N + rotation) % N` (N = `mod_shards`), row `i // N`,
    on device `p // C` (C SparseCores per device, else 1): one all_to_all of
    `[S, n, C, w]`. Rows past a table's vocabulary come through as the
    blocks have them. A stack placed "table" or "replicated" gathers each
    table whole onto the devices that hold it (`_blocks_to_whole`).
    """
    if stack.placement != "row":
        return _blocks_to_whole(stack, blocks, axis)
    S, N = stack.num_shards, stack.mod_shards
    C = N // S
    out = []
    for p, block in zip(stack.tables, blocks):
        n = block.shape[0] // N
        x = jnp.roll(block.reshape(n, N, -1), p.rotation, axis=1).reshape(n, S, C, -1).transpose(1, 0, 2, 3)
        x = jax.lax.all_to_all(x, axis, 0, 0, tiled=True)  # [S (source d), n, C, w]: row d*n + a of each SparseCore
        out.append(x.transpose(2, 0, 1, 3).reshape(C, S * n, -1)[:, : p.padded_rows // N])
    return jnp.concatenate(out, axis=1).reshape(C * stack.sc_rows, -1)


def columns(x: jax.Array, num_shards: int, block) -> jax.Array:
    """Column block `block` of `x [n, width]`: `ceil(width / S)` columns, zero past `width`."""
    w = -(-x.shape[1] // num_shards)
    x = jnp.pad(x, ((0, 0), (0, num_shards * w - x.shape[1])))
    return jax.lax.dynamic_slice_in_dim(x, block * w, w, axis=1)


def _blocks_to_whole(stack: StackPlan, blocks: list[jax.Array], axis: str) -> jax.Array:
    """Inside shard_map, "table", "replicated" or "column": every table's blocks gathered whole, placed in
    this device's rows (and columns, unless they are a per-row slot's: `StackPlan.splits`)."""
    whole = [jax.lax.all_gather(b, axis, tiled=True)[: p.padded_rows] for p, b in zip(stack.tables, blocks)]
    if stack.placement == "column" and stack.splits(whole[0].shape[1]):
        me = jax.lax.axis_index(axis)
        return jnp.concatenate([columns(x, stack.num_shards, me) for x in whole], axis=0)
    if stack.placement in ("replicated", "column"):
        return jnp.concatenate(whole, axis=0)
    me, R = jax.lax.axis_index(axis), stack.rows_per_shard
    local = jnp.zeros((R, whole[0].shape[1]), whole[0].dtype)
    for p, x in zip(stack.tables, whole):
        at = p.row_offset - p.shard * R
        local = local.at[at:at + p.padded_rows].set(jnp.where(me == p.shard, x.astype(local.dtype),
                                                              local[at:at + p.padded_rows]))
    return local


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
    """Rows `m` each device holds of a streamed chunk: a multiple of S ("row": of `mod_shards`), about
    `target_bytes`, at most the table.

    A chunk covers ids `[c0 * S, (c0 + m) * S)` of one table, `c0` a multiple of `m`; device d holds its
    natural rows `[c0 * S + d * m, c0 * S + (d + 1) * m)`, so every device's piece is one aligned range.
    """
    S, a = stack.num_shards, stack.mod_shards if stack.placement == "row" else stack.num_shards
    most = round_up(max(p.padded_rows for p in stack.tables) // S, a)
    return max(a, min(most, target_bytes // max(1, row_bytes) // a * a))


def table_range(stack: StackPlan, i: int) -> tuple[int, int, int]:
    """Where table i lies in its stack, as the chunk functions read it: `(start, count, rotation)`.

    "row": its rows on every MOD shard (a device, or a SparseCore), and its
    rotation. "table" and "replicated": its stack row of id 0 and its padded
    rows (rotation 0).
    """
    p = stack.tables[i]
    if stack.placement != "row":
        return p.row_offset, p.padded_rows, 0
    return p.row_offset // stack.mod_shards, p.padded_rows // stack.mod_shards, p.rotation


def mod_to_natural_chunk(stack: StackPlan, local: jax.Array, where: jax.Array, m: int, axis: str,
                         width: int) -> jax.Array:
    """Inside shard_map: the chunk's rows of one table on every MOD shard -> this device's natural rows.

    `where` = `[c0, start, count, rotation]` (int32): the chunk's first row,
    and the table's `table_range`. The chunk is rows `[c0 / C, c0 / C + k)`
    (k = m / C) of each of the N = S * C MOD shards (C SparseCores per
    device, else 1); row j of shard p is id `j * N + (p - rotation) % N`.
    One all_to_all of `[S, m / N, C, w]` gives device d the ids
    `[c0 * S + d * m, c0 * S + (d + 1) * m)`, in order. Rows past the table
    read as zeros. `width`: the natural columns (`natural_width`).
    """
    if stack.placement != "row":
        return _whole_to_natural_chunk(stack, local, where, m, axis, width)
    S, N, R = stack.num_shards, stack.mod_shards, stack.sc_rows
    C, k = N // S, m // (N // S)
    c0, start, count, rotation = where[0], where[1], where[2], where[3]
    j = c0 // C + jnp.arange(k)
    rows = (jnp.arange(C) * R)[:, None] + (start + j)[None, :]
    x = jnp.where((j < count)[None, :, None], local[jnp.minimum(rows, local.shape[0] - 1)], jnp.zeros((), local.dtype))
    x = x.reshape(C, S, k // S, -1).transpose(1, 2, 0, 3)  # [S (destination), k / S, C, w]
    x = jax.lax.all_to_all(x, axis, 0, 0, tiled=True)  # [S (source d), a, C (c), w]: row c0/C + me*k/S + a of d*C + c
    x = x.transpose(1, 0, 2, 3).reshape(k // S, N, -1)
    return jnp.roll(x, -rotation, axis=1).reshape(m, -1)  # shard p holds ids = (p - rotation) mod N


def _whole_start(stack: StackPlan, start: jax.Array) -> tuple[jax.Array, jax.Array]:
    """"table"/"replicated"/"column": a table's stack row of id 0 -> (its device, its first local row)."""
    if stack.placement != "table":
        return jnp.int32(0), start
    return start // stack.rows_per_shard, start % stack.rows_per_shard


def _whole_to_natural_chunk(stack: StackPlan, local: jax.Array, where: jax.Array, m: int, axis: str,
                            width: int) -> jax.Array:
    """`mod_to_natural_chunk` for a table held whole: device d's ids `[c0 * S + d * m, +m)` read where they lie
    ("table": on its device, which sends every device its piece in one all_to_all)."""
    S = stack.num_shards
    c0, (owner, start), count = where[0] * S, _whole_start(stack, where[1]), where[2]

    def rows(ids):
        ok = (ids < count)[..., None]
        return jnp.where(ok, local[jnp.minimum(start + ids, local.shape[0] - 1)], jnp.zeros((), local.dtype))

    if stack.placement == "replicated":
        return rows(c0 + jax.lax.axis_index(axis) * m + jnp.arange(m))
    x = rows(c0 + jnp.arange(S * m).reshape(S, m))  # [S (destination d), m, w]: "table", real on the owner only
    x = jax.lax.all_to_all(x, axis, 0, 0, tiled=True)  # [S (source), m, w]
    if stack.placement == "column":  # every source sent its columns of the rows: side by side
        return x.transpose(1, 0, 2).reshape(m, -1)[:, :width]
    return x[owner]


def natural_chunk_to_mod(stack: StackPlan, local: jax.Array, chunk: jax.Array, where: jax.Array,
                         axis: str) -> jax.Array:
    """Inside shard_map: the inverse of `mod_to_natural_chunk`, written into `local`.

    `where` = `[c0, start, count, rotation, valid]`: rows of ids `>= valid` are left as they are.
    """
    S, m = stack.num_shards, chunk.shape[0]
    if stack.placement != "row":  # every device gathers the chunk (its columns); those that hold the table write it
        c0, (owner, start), count, valid = where[0] * S, _whole_start(stack, where[1]), where[2], where[4]
        ids = c0 + jnp.arange(S * m)
        keep = (ids < count) & (ids < valid) & (jax.lax.axis_index(axis) == owner if stack.placement == "table" else True)
        if stack.splits(chunk.shape[1]):  # [S (column block), m, w] -> each device its columns of every source's rows
            w = local.shape[1]
            x = jnp.pad(chunk, ((0, 0), (0, S * w - chunk.shape[1]))).reshape(m, S, w).transpose(1, 0, 2)
            x = jax.lax.all_to_all(x, axis, 0, 0, tiled=True).reshape(S * m, w)
        else:
            x = jax.lax.all_gather(chunk, axis, tiled=True)
        return local.at[jnp.where(keep, start + ids, local.shape[0])].set(x.astype(local.dtype), mode="drop")
    N, R = stack.mod_shards, stack.sc_rows
    C, k = N // S, m // (N // S)
    c0, start, count, rotation, valid = where[0], where[1], where[2], where[3], where[4]
    x = jnp.roll(chunk.reshape(k // S, N, -1), rotation, axis=1)  # [a, MOD shard p]
    x = x.reshape(k // S, S, C, -1).transpose(1, 0, 2, 3)  # [S (target), a, C, w]
    x = jax.lax.all_to_all(x, axis, 0, 0, tiled=True)  # [S (source d), a, C (c), w]: row c0/C + d*k/S + a of me*C + c
    x = x.transpose(2, 0, 1, 3).reshape(C * k, -1)
    j = c0 // C + jnp.arange(k)
    shard = jax.lax.axis_index(axis) * C + jnp.arange(C)[:, None]
    keep = (j < count)[None, :] & (j[None, :] * N + (shard - rotation) % N < valid)  # [C, k]
    rows = jnp.where(keep, (jnp.arange(C) * R)[:, None] + (start + j)[None, :], local.shape[0]).reshape(-1)
    return local.at[rows].set(x.astype(local.dtype), mode="drop")


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
