"""The seam between the lookup and the kernels: every method a kernel can be asked for.

`sharded_lookup` runs the custom VJP, `shard_map` and the reshapes into
features, the same for every stack. Inside `shard_map` it hands each stack
to the stack's kernel (`core.kernels.for_stack`) through three methods, and
does not know which kernel or backend it got:

- `lookup_forward(stack, axis, batch, table)`: this device's activations
  of the stack, from this device's batch entry;
- `lookup_backward(stack, axis, batch, saved, variables, grads, step,
  skip_nonfinite)`: the stack's updated `EmbeddingVariables` on this
  device, from its activation gradients;
- `nonfinite_rows(stack, axis, batch, grads)`: the table rows a NaN/inf
  activation gradient reaches (what the backward skips).

Their default (`base.KernelBase`) routes entries and activations between
the devices by the stack's placement (`core.placements`: `exchange`,
`activations`, `backward`) and leaves the per-shard work to two methods,
which are what a kernel usually implements:

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

A backend that owns the exchange too (SparseCore: `core.sparsecore`)
overrides `lookup_forward` and `lookup_backward` instead and reads its own
batch type. Every kernel also says what it can run and read: `name`,
`unsupported(stack)` (why it cannot run a stack; `for_stack` raises it),
`batch_error(stack, entry)` (why an entry is not the batch it reads; the
lookup raises it) and `needs_xla_cpu_flags` (the lookup warns when a CPU
train step lacks them).

The raw-id map (`id_maps`) asks the kernel of a raw-id stack for its
`KeySet` work (`key_set`'s signatures; the defaults are `key_set`'s
functions): `find_keys(keys, queries)`, `touch_keys(keys, queries, step,
stale_before)`, `touch_keys_many([(keys, queries, stale_before[, entries]), ...],
step)` (a train step touches all its raw-id stacks' sets at once, and
hands one source's entries their rows in the same call),
`insert_keys(keys, capacity, queries, want, removed, step)`,
`unique_keys(queries)` and `take_rows(values, index, fill)`.

A kernel owns its tricks: the lookup never knows which algorithm runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from sparse_embed.core import key_set
from sparse_embed.core.collectives import KernelStack
from sparse_embed.core.state import EmbeddingVariables

if TYPE_CHECKING:
    from sparse_embed.core.planning import StackPlan


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
    """What a kernel's per-shard `forward` returns for one stack on one shard."""

    partials: Any  # [D, rows_per_device, dim] f32: this shard's share of every source's activations (or blocks)
    table: jax.Array  # the table the backward updates (`table`, or one ordered after the forward's reads)
    saved: Any  # residuals of the kernel's own backward: a pytree of arrays with leading axis D, or None


class StackForward(NamedTuple):
    """What `lookup_forward` returns for one stack on one device (inside `shard_map`)."""

    activations: Any  # [rows_per_device, dim] f32 this device's activations (or per-feature blocks)
    table: jax.Array  # the table `lookup_backward` updates (see `Forward.table`)
    saved: Any  # what `lookup_backward` reads back: a pytree of arrays, or None


def split_blocks(stack: KernelStack, partials: jax.Array) -> Any:
    """`[D, rows, dim]` -> the view's blocks `([D, n_i, dim], ...)`, or the array itself if it has none."""
    if not stack.out_blocks:
        return partials
    ends = np.cumsum(stack.out_blocks)
    return tuple(partials[:, e - n:e] for n, e in zip(stack.out_blocks, ends))


def join_blocks(blocks: Any) -> jax.Array:
    """The inverse of `split_blocks`: blocks `([..., n_i, dim], ...)` (or one array) -> `[..., rows, dim]`."""
    return jnp.concatenate(blocks, axis=-2) if isinstance(blocks, tuple) else blocks


@runtime_checkable
class Kernel(Protocol):
    """One implementation of the lookup's work on a stack (see the module docstring). `base.KernelBase` gives
    every method but `forward` and `backward` a default."""

    name: str
    # Does a train step of this kernel on CPU copy whole tables unless XLA_FLAGS has `generic.CPU_FLAGS`?
    needs_xla_cpu_flags: bool

    # ---- what it runs
    def unsupported(self, stack: StackPlan) -> str | None:
        """Why this kernel cannot run `stack` (None if it can)."""

    def batch_error(self, stack: StackPlan, entry: Any) -> str | None:
        """Why `entry` is not a batch entry this kernel reads for `stack`: an error message naming the stack (None
        if it is)."""

    # ---- a whole stack on one device, inside shard_map (what the lookup calls)
    def lookup_forward(self, stack: StackPlan, axis: str, batch: Any, table: jax.Array) -> StackForward:
        """This device's activations of `stack`, from its batch entry (leaves without the device axis)."""

    def lookup_backward(self, stack: StackPlan, axis: str, batch: Any, saved: Any, variables: EmbeddingVariables,
                        grads: Any, step: jax.Array | None, skip_nonfinite: bool) -> EmbeddingVariables:
        """The updated variables on this device; `grads [rows_per_device, dim]` this device's activation
        gradients (or blocks, as `lookup_forward` returned the activations), `saved` its `StackForward.saved`."""

    def nonfinite_rows(self, stack: StackPlan, axis: str, batch: Any, grads: jax.Array) -> jax.Array:
        """The table rows, over every device, that a NaN/inf in this device's activation gradients reaches."""

    # ---- one shard's share (what the default whole-stack methods call)
    def forward(self, stack: KernelStack, received: Received, table: jax.Array) -> Forward:
        """Gather, clip, scale and pool the received entries."""

    def backward(self, stack: KernelStack, received: Received, saved: Any, variables: EmbeddingVariables,
                 grads: Any, step: jax.Array | None, skip_nonfinite: bool) -> EmbeddingVariables:
        """Combine duplicate rows' gradients and apply the optimizer to the touched rows, in place."""

    # ---- the raw-id map's search of one shard's KeySet (`key_set`'s functions and signatures)
    def find_keys(self, keys: key_set.KeySet, queries: jax.Array) -> jax.Array:
        """`key_set.find`: slots `[Q]` of `queries [Q, 2]` (-1: absent)."""

    def touch_keys(self, keys: key_set.KeySet, queries: jax.Array, step: jax.Array,
                   stale_before: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`key_set.touch`: `(slots [Q], last [N], missing [])` with the found keys' last-use steps set."""

    def touch_keys_many(self, sets: Sequence[tuple], step: jax.Array) -> list[tuple[jax.Array, ...]]:
        """`touch_keys` of several `(keys, queries, stale_before[, (slot_of, values)])` with one step; a set with
        entries also gets `key_set.entry_rows(slots, slot_of, values, N)` (two more results)."""

    def insert_keys(self, keys: key_set.KeySet, capacity: jax.Array, queries: jax.Array, want: jax.Array,
                    removed: jax.Array | None, step: jax.Array) -> key_set.Inserted:
        """`key_set.insert`."""

    def unique_keys(self, queries: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`key_set.unique`: the distinct keys and each query's index among them."""

    def take_rows(self, values: jax.Array, index: jax.Array, fill: int) -> jax.Array:
        """`key_set.take`."""


def missing_methods(kernel: Any) -> list[str]:
    """The members of `Kernel` that `kernel` lacks (a plan checks a kernel it is given)."""
    members = [m for m in Kernel.__dict__ if not m.startswith("_")] + list(Kernel.__annotations__)
    return sorted({m for m in members if not hasattr(kernel, m)})


__all__ = ["Forward", "Kernel", "Received", "StackForward", "join_blocks", "missing_methods",
           "split_blocks"]
