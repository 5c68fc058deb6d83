"""`KernelBase`: the defaults of every `Kernel` method but the per-shard `forward` and `backward`.

A kernel that subclasses it writes only its per-shard work; the whole-stack
methods route entries and activations between the devices by the stack's
placement (`StackPlan.strategy`: `exchange`, `view`, `activations`,
`backward`, `nonfinite_rows`), its batch is a COO batch of rows, and the
raw-id map searches its `KeySet`s with `key_set`'s functions.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import jax

from sparse_embed.core import key_set
from sparse_embed.core.batch import MappedIdBatch, RawIdBatch, ShardedCooMatrix
from sparse_embed.core.collectives import KernelStack
from sparse_embed.core.kernels.entries import nonfinite_row_count
from sparse_embed.core.kernels.interface import Forward, Received, StackForward
from sparse_embed.core.planning import StackPlan
from sparse_embed.core.state import EmbeddingVariables


def _received(stack: StackPlan, axis: str, batch: Any) -> Received:
    """The entries this device's kernel reads (inside shard_map), `[sources, C]`, by the stack's placement."""
    return Received(*stack.strategy.exchange(stack, axis, batch))


class KernelBase:
    """The `Kernel` protocol's defaults (see the module docstring); subclasses implement `forward`, `backward`
    and set `name`."""

    name: ClassVar[str]
    needs_xla_cpu_flags: ClassVar[bool] = False

    def unsupported(self, stack: StackPlan) -> str | None:
        return None

    def batch_error(self, stack: StackPlan, entry: Any) -> str | None:
        if isinstance(entry, RawIdBatch):
            return (f"Stack {stack.name!r}: the batch holds raw ids (its table is dynamic); map them to rows first: "
                    "batch, tables, id_maps, stats = sparse_embed.map_ids(plan, batch, tables, id_maps, step).")
        if not isinstance(entry, (ShardedCooMatrix, MappedIdBatch)):
            return f"Stack {stack.name!r}: batch entry must be a ShardedCooMatrix, got {type(entry).__name__}."
        return None

    # ------------------------------------------------------------ a whole stack on one device
    def lookup_forward(self, stack: StackPlan, axis: str, batch: Any, table: jax.Array) -> StackForward:
        rec = _received(stack, axis, batch)
        fwd = self.forward(stack.strategy.view(stack, axis, stack.activations_per_feature), rec, table)
        if isinstance(fwd.partials, tuple):  # blocks `([1, n_i, dim], ...)`: the activations as they are
            acts = tuple(p[0] for p in fwd.partials)
        else:
            acts = stack.strategy.activations(stack, axis, fwd.partials)
        return StackForward(acts, fwd.table, (rec, fwd.saved))

    def lookup_backward(self, stack: StackPlan, axis: str, batch: Any, saved: Any, variables: EmbeddingVariables,
                        grads: Any, step: jax.Array | None, skip_nonfinite: bool) -> EmbeddingVariables:
        rec, mine = saved
        return stack.strategy.backward(stack, axis, self, rec, mine, variables, grads, step, skip_nonfinite)

    def nonfinite_rows(self, stack: StackPlan, axis: str, batch: Any, grads: jax.Array) -> jax.Array:
        return stack.strategy.nonfinite_rows(stack, axis, _received(stack, axis, batch), grads, nonfinite_row_count)

    # ------------------------------------------------------------ one shard's share
    def forward(self, stack: KernelStack, received: Received, table: jax.Array) -> Forward:
        raise NotImplementedError(f"{type(self).__name__} must implement forward")

    def backward(self, stack: KernelStack, received: Received, saved: Any, variables: EmbeddingVariables,
                 grads: Any, step: jax.Array | None, skip_nonfinite: bool) -> EmbeddingVariables:
        raise NotImplementedError(f"{type(self).__name__} must implement backward")

    # ------------------------------------------------------------ the raw-id map's KeySet search
    def find_keys(self, keys: key_set.KeySet, queries: jax.Array) -> jax.Array:
        return key_set.find(keys, queries)

    def touch_keys(self, keys: key_set.KeySet, queries: jax.Array, step: jax.Array,
                   stale_before: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return key_set.touch(keys, queries, step, stale_before)

    def touch_keys_many(self, sets: Sequence[tuple], step: jax.Array) -> list[tuple[jax.Array, ...]]:
        out = []
        for keys, queries, stale_before, *entries in sets:
            slots, last, missing = self.touch_keys(keys, queries, step, stale_before)
            rows = key_set.entry_rows(slots, *entries[0], keys.last.shape[0]) if entries and entries[0] else ()
            out.append((slots, last, missing, *rows))
        return out

    def insert_keys(self, keys: key_set.KeySet, capacity: jax.Array, queries: jax.Array, want: jax.Array,
                    removed: jax.Array | None, step: jax.Array) -> key_set.Inserted:
        return key_set.insert(keys, capacity, queries, want, removed, step)

    def unique_keys(self, queries: jax.Array) -> tuple[jax.Array, jax.Array]:
        return key_set.unique(queries)

    def take_rows(self, values: jax.Array, index: jax.Array, fill: int) -> jax.Array:
        return key_set.take(values, index, fill)
