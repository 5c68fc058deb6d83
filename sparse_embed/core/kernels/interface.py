"""The seam between the lookup and its per-shard work: what a kernel implementation provides.

`sharded_lookup` does the same everywhere: the exchange of COO entries and
activations between devices (`all_to_all`, `all_gather`), the custom VJP
and the reshapes into features. What each shard does with what it received
is a `Kernel`'s, one stack at a time, inside `shard_map`:

- `forward(stack, received, table)`: gather the received rows, apply
  `max_norm`, scale them by the gains and pool them into the partial
  activations of every source device, `[D, rows_per_device, dim]` f32.
  It also returns the table the backward will update (the same array, or
  one the kernel tied to the forward's reads) and anything else it saves
  for its backward (a pytree of arrays, or None). The lookup passes both
  through untouched. When the view has `out_blocks` (the lookup asks for
  them where the partials are the activations: one shard, or a replicated
  table), the partials are a tuple of `[D, n_i, dim]`, one per block of
  output rows (one per feature), so that each feature's activations are
  an array of their own, with no copy to cut them out.
- `backward(stack, received, saved, variables, grads, step, skip_nonfinite)`:
  combine the gradients of duplicate rows (`grads[d, row]` is the
  activation gradient of source d's output row) and apply the stack's
  optimizer to each touched row and its slots, in place; return the
  updated `EmbeddingVariables`. With `out_blocks`, `grads` comes in the
  same blocks (a tuple).
- `find_keys(keys, queries)` and `touch_keys(keys, queries, step,
  stale_before)`: the raw-id map's search of one shard's `KeySet`
  (`key_set.find`), and the same with the found keys' last-use steps set
  (`key_set.touch`, in a train step), for the stacks this kernel runs;
  `touch_keys_many(sets, step)` the touches of several stacks' sets at
  once (a train step maps all its raw-id stacks together). Optional: a
  kernel without them gets `key_set`'s (one set after another).

A kernel owns its tricks: the lookup never knows which algorithm runs.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from sparse_embed.core.planning import KernelStack, StackPlan
from sparse_embed.core.state import EmbeddingVariables


class Received(NamedTuple):
    """The COO entries one shard received, `[D, C]` each: row d came from source device d.

    `col_ids` are rows of this shard (padding: `rows_per_shard`, out of
    range), `row_ids` output rows of the source device (padding:
    `rows_per_device`), `values` the gains (padding: 0).
    """

    col_ids: jax.Array
    row_ids: jax.Array
    values: jax.Array


class Forward(NamedTuple):
    """What a kernel's forward returns for one stack on one shard."""

    partials: Any  # [D, rows_per_device, dim] f32: this shard's share of every source's activations (or blocks)
    table: jax.Array  # the table the backward updates (`table`, or one ordered after the forward's reads)
    saved: Any  # residuals of the kernel's own backward: a pytree of arrays with leading axis D, or None


def split_blocks(stack: KernelStack, partials: jax.Array) -> Any:
    """`[D, rows, dim]` -> the view's blocks `([D, n_i, dim], ...)`, or the array itself if it has none."""
    if not stack.out_blocks:
        return partials
    ends = np.cumsum(stack.out_blocks)
    return tuple(partials[:, e - n:e] for n, e in zip(stack.out_blocks, ends))


def join_blocks(blocks: Any) -> jax.Array:
    """The inverse of `split_blocks`: blocks `([..., n_i, dim], ...)` (or one array) -> `[..., rows, dim]`."""
    return jnp.concatenate(blocks, axis=-2) if isinstance(blocks, tuple) else blocks


class Kernel(Protocol):
    """One implementation of the per-shard work (see the module docstring)."""

    name: str

    def unsupported(self, stack: StackPlan) -> str | None:
        """Why this kernel cannot run `stack` (None if it can)."""

    def forward(self, stack: StackPlan, received: Received, table: jax.Array) -> Forward:
        """Gather, clip, scale and pool the received entries."""

    def backward(self, stack: StackPlan, received: Received, saved: Any, variables: EmbeddingVariables,
                 grads: Any, step: jax.Array | None, skip_nonfinite: bool) -> EmbeddingVariables:
        """Combine duplicate rows' gradients and apply the optimizer to the touched rows, in place."""

    # Optional, see the module docstring:
    # find_keys(keys: KeySet, queries [Q, 2]) -> slots [Q] (-1: absent)
    # touch_keys(keys: KeySet, queries [Q, 2], step [], stale_before []) -> (slots [Q], last [N], missing [])
    # touch_keys_many([(keys, queries, stale_before), ...], step) -> [touch_keys' result, ...]
