"""The "column" placement: every device holds every row, but only its `ceil(dim / D)` columns.

Layout: the stacked array is the S column blocks of the `total_rows` rows,
one after the other (the dim padded to a multiple of S); global row g holds
column block `g // total_rows` of stack row `g % total_rows`. An array
narrower than a row (a per-row slot, e.g. RowwiseAdagrad's) is held whole
on every device, its copies equal.

Exchange: every device's entries go to every device (`all_gather`); each
device sends its columns of every output row to that row's device
(`all_to_all`), and the backward sends each device its columns of the
activation gradients. Statistics of whole rows (a row's norm for max_norm,
a row-wise optimizer's mean) are summed over the devices that hold the
row's columns (`KernelStack.row_sum`, a psum of one float per entry); a
`Custom` optimizer gets the touched rows whole (`KernelStack.whole`).

Cost per device and train step: `12 ids (D-1) + 8 rows ceil(dim/D) (D-1)`
bytes through collectives, plus `8 ids (D-1)` per whole-row statistic
(`column_row_sums`); `vocab` rows of `ceil(dim/D)` columns of memory (a
per-row slot whole). Never chosen by "auto" for `Custom` optimizers or
raw-id tables, and never a memory budget's target (it needs at least what
"row" needs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparse_embed.core.collectives import gather, kernel_stack
from sparse_embed.core.placements.base import padded_vocab
from sparse_embed.core.placements.whole import WholeTables


def column_row_sums(max_norm: bool, elementwise: bool, skip_nonfinite: bool = True) -> int:
    """f32 per id that a "column" table all-reduces per train step for statistics of whole rows.

    A row's norm (max_norm: 1 in the forward, 2 in the backward), a
    row-wise optimizer's mean (1), and on that path, under the "skip"
    policy, whether any device's columns of a row's summed gradient are
    non-finite (1), so every device skips the same rows.
    """
    n = 3 * max_norm + (not elementwise)
    return n + (skip_nonfinite and n > 0)


def columns(x: jax.Array, num_shards: int, block) -> jax.Array:
    """Column block `block` of `x [n, width]`: `ceil(width / S)` columns, zero past `width`."""
    w = -(-x.shape[1] // num_shards)
    x = jnp.pad(x, ((0, 0), (0, num_shards * w - x.shape[1])))
    return jax.lax.dynamic_slice_in_dim(x, block * w, w, axis=1)


class Column(WholeTables):
    name = "column"
    memory_target = False

    # ------------------------------------------------------------------ layout
    def array_dim(self, stack) -> int:
        return -(-stack.embedding_dim // stack.num_shards)

    def splits(self, stack, width: int) -> bool:
        """The table and the slots as wide as it; a per-row slot is whole on every device."""
        return width == stack.embedding_dim

    def segments(self, stack) -> int:
        return 1  # the device's own ids, gathered by every device

    # ---------------------------------------------------------------- relayout
    def from_shard_major(self, stack, array, width):
        """The column blocks side by side (a per-row slot: D copies; the first)."""
        D, w = stack.num_shards, array.shape[-1]
        return array.reshape(D, stack.total_rows, w).transpose(1, 0, 2).reshape(stack.total_rows, D * w)[:, :width]

    def local_columns(self, stack, global_rows, x, fill, xp):
        if not stack.splits(x.shape[1]):
            return x
        D, w = stack.num_shards, stack.array_dim
        x = xp.pad(x, ((0, 0), (0, D * w - x.shape[1])), constant_values=fill).reshape(-1, D, w)
        return xp.take_along_axis(x, (global_rows // stack.total_rows).astype(xp.int32)[:, None, None], axis=1)[:, 0]

    def place(self, stack, whole, axis):
        if stack.splits(whole[0].shape[1]):
            me = jax.lax.axis_index(axis)
            return jnp.concatenate([columns(x, stack.num_shards, me) for x in whole], axis=0)
        return jnp.concatenate(whole, axis=0)

    def pieces(self, stack, x, owner, m, width):
        return x.transpose(1, 0, 2).reshape(m, -1)[:, :width]  # every source sent its columns of the rows

    def gather_chunk(self, stack, chunk, local, axis):
        """`[S (column block), m, w]` -> each device its columns of every source's rows."""
        if not stack.splits(chunk.shape[1]):
            return super().gather_chunk(stack, chunk, local, axis)
        S, m, w = stack.num_shards, chunk.shape[0], local.shape[1]
        x = jnp.pad(chunk, ((0, 0), (0, S * w - chunk.shape[1]))).reshape(m, S, w).transpose(1, 0, 2)
        return jax.lax.all_to_all(x, axis, 0, 0, tiled=True).reshape(S * m, w)

    # ---------------------------------------------------------------- exchange
    def exchange(self, stack, axis, coo):
        return tuple(gather(x, axis) for x in (coo.col_ids, coo.row_ids, coo.values))  # every device's entries

    def view(self, stack, axis, per_feature=False):
        return kernel_stack(stack, row_axis=axis, per_feature=per_feature)

    def activations(self, stack, axis, partials):
        pooled = jax.lax.all_to_all(partials, axis, 0, 0, tiled=True)  # [S, rows, w], each shard's columns
        return pooled.transpose(1, 0, 2).reshape(pooled.shape[1], -1)[:, :stack.embedding_dim]

    def to_columns(self, stack, axis, grads, poison):
        """This device's activation gradients `[rows_per_device, dim]` -> each shard's columns of every source's,
        `[D, rows_per_device, w]`. With `poison`, a row with a NaN/inf anywhere becomes NaN in every column, so
        every shard skips the table rows it reaches (as one device holding whole rows would)."""
        D, w = stack.num_shards, stack.array_dim
        if poison:
            grads = jnp.where(jnp.isfinite(grads).all(axis=-1, keepdims=True), grads, jnp.nan)
        g = jnp.pad(grads, ((0, 0), (0, D * w - grads.shape[1]))).reshape(grads.shape[0], D, w).transpose(1, 0, 2)
        return jax.lax.all_to_all(g, axis, 0, 0, tiled=True)

    def backward(self, stack, axis, kernel, rec, saved, state, grads, step, skip):
        g = self.to_columns(stack, axis, grads, skip)
        return kernel.backward(self.view(stack, axis, stack.activations_per_feature), rec, saved, state, g, step,
                               skip)

    def nonfinite_rows(self, stack, axis, rec, grads, count):
        """Every shard counts the same rows: counted once."""
        return jax.lax.pmax(count(kernel_stack(stack), rec, self.to_columns(stack, axis, grads, True)), axis)

    # -------------------------------------------------------------------- cost
    def choosable(self, load) -> bool:
        return load.row_sums is not None  # None: its rows cannot be split (a Custom optimizer, raw ids)

    def traffic(self, load, num_devices, share=None):
        D = num_devices
        return (12.0 + 8.0 * load.row_sums) * load.ids * (D - 1) + 8.0 * load.rows * -(-load.dim // D) * (D - 1)

    def memory(self, load, num_devices):
        """Each device `ceil(dim/D)` columns of every row and its per-row slots whole: more than "row" needs
        when D does not divide the dim."""
        split = (load.row_bytes - load.whole_bytes) // max(load.dim, 1)  # bytes of one column of a row
        return float(padded_vocab(load, num_devices) * (-(-load.dim // num_devices) * split + load.whole_bytes))

    def collective_bytes(self, stack, capacity, skip_nonfinite):
        """Every device's entries to every device; activations by columns; whole-row sums and gathers."""
        D, C = stack.num_shards, capacity
        sums = 8 * C * self.row_sums(stack, skip_nonfinite)  # each an all-reduce of D*C f32: 2 (D-1)/D * 4 D C
        gathers = 4 * D * C * stack.array_dim * self.row_gathers(stack)  # (D-1)/D of [D*C, D*array_dim] f32 each
        return (D - 1) * (12 * C + 2 * 4 * stack.rows_per_device * stack.array_dim + sums + gathers)

    def row_sums(self, stack, skip_nonfinite=True):
        """A row's norm (max_norm: 1 forward, 2 backward), a row-wise optimizer's mean (1) and, when either
        needs them, whether any column's summed gradient is non-finite (1, under `skip_nonfinite`)."""
        if not stack.optimizer.splits_columns:  # the update gathers whole rows: only max_norm sums
            return 3 * (stack.max_norm is not None)
        return column_row_sums(stack.max_norm is not None, stack.optimizer.elementwise, skip_nonfinite)

    def row_gathers(self, stack):
        """With an optimizer that sees whole rows: the touched rows, their gradients and the slots as wide as
        a row."""
        if stack.optimizer.splits_columns:
            return 0
        slots = stack.optimizer.slots(stack.embedding_dim).values()
        return 2 + sum(self.splits(stack, s.width) for s in slots)
