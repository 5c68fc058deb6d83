"""What the placements that hold each table whole share ("table", "replicated", "column"): their relayout.

A table's natural blocks are gathered whole onto the devices that hold it
(`blocks_to_local`), and a checkpoint chunk is read where its rows lie and
written by every device that holds them. A subclass says which devices
those are (`first_row`, `holds`), how the gathered tables make its local
array (`place`) and how every device's piece of a chunk makes its natural
rows (`pieces`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparse_embed.core.placements.base import Placement


class WholeTables(Placement):
    """A placement whose devices each hold whole tables (or whole tables' columns)."""

    def rows_per_shard(self, stack) -> int:
        return stack.total_rows

    def stack_rows(self, stack, global_rows):
        return global_rows % stack.total_rows

    def first_row(self, stack, start: jax.Array) -> tuple[jax.Array, jax.Array]:
        """A table's stack row of id 0 -> (a device that holds it, its first local row there)."""
        return jnp.int32(0), start

    def holds(self, owner: jax.Array, axis: str):
        """Does this device hold the table `first_row` puts on `owner` (True: every device does)?"""
        return True

    def place(self, stack, whole: list[jax.Array], axis: str) -> jax.Array:
        """Each table's padded rows `[padded_rows, w]`, gathered whole -> this device's array of the stack."""
        raise NotImplementedError

    def pieces(self, stack, x: jax.Array, owner: jax.Array, m: int, width: int) -> jax.Array:
        """`[S (source), m, w]`: what every device sent of a chunk -> this device's natural rows `[m, width]`."""
        raise NotImplementedError

    def gather_chunk(self, stack, chunk: jax.Array, local: jax.Array, axis: str) -> jax.Array:
        """Every device's piece of a chunk `[m, w]` -> the whole chunk `[S * m, w]` as this device holds it."""
        return jax.lax.all_gather(chunk, axis, tiled=True)

    def blocks_to_local(self, stack, blocks: list[jax.Array], axis: str) -> jax.Array:
        whole = [jax.lax.all_gather(b, axis, tiled=True)[: p.padded_rows] for p, b in zip(stack.tables, blocks)]
        return self.place(stack, whole, axis)

    def reader(self, stack, local: jax.Array, where: jax.Array):
        """`(c0 * S, owner, rows)`: a chunk's first id, a device that holds its table and `rows(ids)`, the local
        rows of ids relative to the chunk's table (zero past its padded rows)."""
        c0, (owner, start), count = where[0] * stack.num_shards, self.first_row(stack, where[1]), where[2]

        def rows(ids):
            ok = (ids < count)[..., None]
            return jnp.where(ok, local[jnp.minimum(start + ids, local.shape[0] - 1)], jnp.zeros((), local.dtype))

        return c0, owner, rows

    def to_natural_chunk(self, stack, local, where, m, axis, width):
        """Every device reads the chunk's rows where they lie and sends each device its piece (one all_to_all)."""
        S = stack.num_shards
        c0, owner, rows = self.reader(stack, local, where)
        x = rows(c0 + jnp.arange(S * m).reshape(S, m))  # [S (destination d), m, w]
        x = jax.lax.all_to_all(x, axis, 0, 0, tiled=True)  # [S (source), m, w]
        return self.pieces(stack, x, owner, m, width)

    def from_natural_chunk(self, stack, local, chunk, where, axis):
        """Every device gathers the chunk (its columns); those that hold the table write it."""
        S, m = stack.num_shards, chunk.shape[0]
        c0, (owner, start), count, valid = where[0] * S, self.first_row(stack, where[1]), where[2], where[4]
        ids = c0 + jnp.arange(S * m)
        keep = (ids < count) & (ids < valid) & self.holds(owner, axis)
        x = self.gather_chunk(stack, chunk, local, axis)
        return local.at[jnp.where(keep, start + ids, local.shape[0])].set(x.astype(local.dtype), mode="drop")
