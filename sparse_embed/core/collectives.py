"""The lookup's side of the exchange: a stack as a kernel sees it on one shard, and the collectives around it.

Everything here runs inside `jax.shard_map` on the plan's mesh axis. The
plan (`planning`) is a static value and runs nothing; each placement's
exchange (`placements`) routes entries and activations with the helpers
below, and a kernel (`core.kernels`) gets a `KernelStack`, whose methods are
the only collectives a kernel runs: the sums and gathers over a row whose
columns are split over the devices ("column" placement).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class KernelStack:
    """One stack as a kernel (`core.kernels`) sees it on one shard.

    `num_shards` sources each send entries whose row ids index their
    `rows_per_device` output rows; their col ids index this shard's
    `rows_per_shard` rows. `out_blocks` (when not empty) cuts those output
    rows into consecutive blocks, one per feature, that the forward returns
    as separate arrays and the backward takes as such (see `core.kernels`).
    """

    name: str
    optimizer: Any
    max_norm: float | None
    dtype: Any
    embedding_dim: int  # columns of the local arrays
    num_shards: int
    rows_per_device: int
    rows_per_shard: int
    row_width: int = 0  # elements of a whole row (past embedding_dim when its columns are split)
    row_axis: str | None = None  # the mesh axis a row's columns are split over, else None
    out_blocks: tuple[int, ...] = ()  # output rows of each block (summing to rows_per_device); () = one array

    def row_sum(self, partial: jax.Array) -> jax.Array:
        """Per-row partial sums `[..., k]` -> the whole rows' sums (a psum over `row_axis` if split)."""
        return partial if self.row_axis is None else jax.lax.psum(partial, self.row_axis)

    def row_mean(self, x: jax.Array) -> jax.Array:
        """`x [U, embedding_dim]` -> the mean over each whole row `[U, 1]` (its padding columns left out)."""
        if self.row_axis is None:
            return x.mean(axis=-1, keepdims=True)
        return self.row_sum(self.real_columns(x).sum(axis=-1, keepdims=True)) / self.row_width

    def real_columns(self, x: jax.Array) -> jax.Array:
        """`x [U, embedding_dim]` with the columns past the row's width (a split row's padding, where the devices
        do not divide it) zeroed: an update (a `clip_weight` or `clip_gradient` range without 0) must not give
        them values, which a whole row's statistics (its norm for max_norm, a row-wise mean) would count."""
        if self.row_axis is None or self.row_width % self.num_shards == 0:
            return x
        cols = jax.lax.axis_index(self.row_axis) * self.embedding_dim + jnp.arange(self.embedding_dim)
        return jnp.where(cols < self.row_width, x, jnp.zeros((), x.dtype))

    @property
    def needs_row_sums(self) -> bool:
        """Are this stack's rows split over devices and does it need statistics of whole rows?"""
        return self.row_axis is not None and (self.max_norm is not None or not self.optimizer.elementwise)

    @property
    def gathers_rows(self) -> bool:
        """Are this stack's rows split over devices and does its optimizer see whole rows (`Custom`)?"""
        return self.row_axis is not None and not self.optimizer.splits_columns

    def splits_slot(self, name: str) -> bool:
        """Is slot `name` split by columns like the table (as wide as a row), or whole on every device?"""
        return self.optimizer.slots(self.row_width)[name].width == self.row_width

    def whole(self, x: jax.Array) -> jax.Array:
        """This device's columns `[U, embedding_dim]` -> whole rows `[U, row_width]` (an all_gather)."""
        return jax.lax.all_gather(x, self.row_axis, axis=1, tiled=True)[:, :self.row_width]

    def own(self, x: jax.Array) -> jax.Array:
        """Whole rows `[U, row_width]` -> this device's columns `[U, embedding_dim]` (the inverse of `whole`)."""
        w = self.embedding_dim
        x = jnp.pad(x, ((0, 0), (0, self.num_shards * w - x.shape[1])))
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(self.row_axis) * w, w, axis=1)


def kernel_stack(stack, sources: int | None = None, out_rows: int | None = None, row_axis: str | None = None,
                 per_feature: bool = False) -> KernelStack:
    """What a kernel sees of a `StackPlan`: sources of entries, their output rows and the local rows.

    `row_axis`: the mesh axis a row's columns are split over (a placement that
    splits them passes it). `per_feature`: the partial activations in one
    block per feature (see `KernelStack.out_blocks`).
    """
    blocks = tuple(f.rows_per_device for f in stack.features) if per_feature else ()
    return KernelStack(stack.name, stack.optimizer, stack.max_norm, stack.dtype, stack.array_dim,
                       stack.num_shards if sources is None else sources,
                       stack.partial_rows if out_rows is None else out_rows, stack.rows_per_shard,
                       stack.embedding_dim, row_axis, blocks)


def gather(x: jax.Array, axis: str) -> jax.Array:
    """Every device's `x`, `[D, ...]`. On one device `x[None]`: XLA:CPU copies the array for an all_gather
    even then, while it drops a one-device all_to_all."""
    return x[None] if jax.lax.axis_size(axis) == 1 else jax.lax.all_gather(x, axis, tiled=False)


def send_segments(segments: int, axis: str, arrays) -> tuple[jax.Array, ...]:
    """Segment s of each of this device's `[segments * C]` arrays to device s: `[D, C]` each, from every source."""
    return tuple(jax.lax.all_to_all(x.reshape(segments, -1), axis, 0, 0, tiled=True) for x in arrays)


def joined(blocks: Any) -> jax.Array:
    """Per-feature blocks `([..., n_i, dim], ...)` (or one array) -> one `[..., rows, dim]` array."""
    return jnp.concatenate(blocks, axis=-2) if isinstance(blocks, tuple) else blocks
