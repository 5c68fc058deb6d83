"""A shard's received entries as the backward reads them, and the rows a NaN/inf activation gradient reaches.

Shared by the generic kernel (its backward) and every kernel's default
`nonfinite_rows` (`base.KernelBase`), so that the count `nonfinite_rows`
reports is the rule the backward skips by.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from sparse_embed.core.collectives import KernelStack
    from sparse_embed.core.kernels.interface import Received


def nonfinite(grads: jax.Array) -> jax.Array:
    """Per gradient row `[N, dim]`: does it hold a NaN or inf? `[N]` bool."""
    return ~jnp.isfinite(grads).all(axis=-1)


def segments(cols: jax.Array):
    """Groups equal cols: the sorting order, the sorted cols and each sorted entry's group index."""
    order = jnp.argsort(cols)
    sorted_cols = cols[order]
    is_new = jnp.concatenate([jnp.ones((1,), bool), sorted_cols[1:] != sorted_cols[:-1]])
    return order, sorted_cols, jnp.cumsum(is_new) - 1


def bad_groups(cols: jax.Array, bad: jax.Array):
    """Per group of equal cols: does any of its entries have `bad` set? And the sort order and groups."""
    order, _, segment = segments(cols)
    hits = jax.ops.segment_sum(bad[order].astype(jnp.int32), segment, num_segments=cols.shape[0],
                               indices_are_sorted=True)
    return hits > 0, order, segment


class Entries(NamedTuple):
    """The received entries of one shard, flat `[N]`, with the activation gradients they read.

    An entry's gradient is `grads_all[src] * value`; it is computed chunk by
    chunk where it is used, never as an `[N, dim]` array.
    """

    cols: jax.Array  # row on this shard; padding = rows_per_shard (out of range)
    src: jax.Array  # row of grads_all; padding entries read a zero row
    values: jax.Array
    grads_all: jax.Array  # [D * (rows_per_device + 1), dim] activation gradients of every source
    bad: jax.Array  # [N] bool: the entry's activation gradient holds a NaN/inf

    def grads(self, src: jax.Array, values: jax.Array) -> jax.Array:
        return self.grads_all[src] * values[:, None]


def output_rows(stack: KernelStack, rec: Received) -> jax.Array:
    """Each entry's row in `[D * (rows_per_device + 1)]` (row rows_per_device of each source: padding)."""
    D, rpd = stack.num_shards, stack.rows_per_device
    return (jnp.arange(D, dtype=jnp.int32)[:, None] * (rpd + 1) + rec.row_ids).reshape(-1)


def entries(stack: KernelStack, rec: Received, grads: jax.Array) -> Entries:
    """The received entries with the activation gradients `grads [D, rows_per_device, dim]` they read."""
    # Activation gradients of every source device, with a zero row rpd per source for padding entries.
    grads_all = jnp.pad(grads, ((0, 0), (0, 1), (0, 0))).reshape(-1, stack.embedding_dim)
    src = output_rows(stack, rec)
    # NaN/inf checked per activation row (cheaper than per entry).
    return Entries(rec.col_ids.reshape(-1), src, rec.values.reshape(-1), grads_all, nonfinite(grads_all)[src])


def nonfinite_row_count(stack: KernelStack, rec: Received, grads: jax.Array) -> jax.Array:
    """How many of this shard's rows a NaN/inf activation gradient reaches (int32 scalar)."""
    e = entries(stack, rec, grads)
    return jnp.sum(bad_groups(e.cols, e.bad)[0], dtype=jnp.int32)
