"""Implementations of the lookup's per-shard work, behind one interface (see `interface`).

- `GenericKernel` ("generic"): jnp/lax code; the reference, used on every
  platform without a faster implementation and for `Custom` optimizers.
- `NativeCpuKernel` ("native"): C++ through XLA's typed FFI, on CPU.
- `sparsecore`: TPU SparseCores (`plan(sparsecores=S)`). It owns the
  exchange too, so `sharded_lookup` calls it for a whole stack, in the TPU
  branch of `platform_dependent`; the other branch runs the kernel chosen here.

`for_stack` picks the implementation a plan asks for: `plan.kernel` is a
name ("auto": native on CPU where it supports the stack, else generic) or
a kernel instance (e.g. `GenericKernel(chunk=5)`, `NativeCpuKernel(threads=1)`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax

from sparse_embed.core import key_set
from sparse_embed.core.kernels.generic import GenericKernel
from sparse_embed.core.kernels.interface import Forward, Kernel, Received
from sparse_embed.core.kernels.native_cpu import NativeCpuKernel
from sparse_embed.core.planning import EmbeddingPlan, StackPlan

GENERIC = GenericKernel()
NATIVE = NativeCpuKernel()


def _platform(plan: EmbeddingPlan) -> str:
    return plan.mesh.devices.flat[0].platform


def for_stack(plan: EmbeddingPlan, stack: StackPlan) -> Kernel:
    """The kernel that runs `stack`'s per-shard work under `plan`."""
    kernel = {"generic": GENERIC, "native": NATIVE}.get(plan.kernel, plan.kernel)
    if kernel == "auto":
        native = _platform(plan) == "cpu" and NATIVE.unsupported(stack) is None
        return NATIVE if native else GENERIC
    why = kernel.unsupported(stack)
    if why is None and kernel.name == "native" and _platform(plan) != "cpu":
        why = f"it runs on CPU only, and the plan's mesh is on {_platform(plan)}"
    if why:
        raise ValueError(f"Stack {stack.name!r}: the {kernel.name} kernel cannot run it: {why}. "
                         f"Use plan(..., kernel='auto') (or 'generic').")
    return kernel


class KeySearch(NamedTuple):
    """How a raw-id stack's shards search and grow their `KeySet`s, deduplicate received keys and hand every
    entry its id's row (`key_set.find` / `touch` / `insert` / `unique` / `take`'s signatures)."""

    find: Callable[[key_set.KeySet, jax.Array], jax.Array]
    touch: Callable[[key_set.KeySet, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]
    insert: Callable[..., key_set.Inserted]
    unique: Callable[[jax.Array], tuple[jax.Array, jax.Array]]
    take: Callable[[jax.Array, jax.Array, int], jax.Array]
    # `touch` of several `(keys, queries, stale_before)` with one step: a list of its results
    touch_many: Callable[[Sequence[tuple[key_set.KeySet, jax.Array, jax.Array]], jax.Array], list]


def _touch_each(sets, step) -> list:
    return [key_set.touch(keys, queries, step, stale_before) for keys, queries, stale_before in sets]


def key_search(plan: EmbeddingPlan, stack: StackPlan) -> KeySearch:
    """The stack's kernel's `find_keys` / `touch_keys` / `insert_keys` / `unique_keys` / `take_rows` /
    `touch_keys_many`, else `key_set`'s."""
    kernel = for_stack(plan, stack)
    return KeySearch(getattr(kernel, "find_keys", key_set.find), getattr(kernel, "touch_keys", key_set.touch),
                     getattr(kernel, "insert_keys", key_set.insert), getattr(kernel, "unique_keys", key_set.unique),
                     getattr(kernel, "take_rows", key_set.take), getattr(kernel, "touch_keys_many", _touch_each))


__all__ = ["GENERIC", "NATIVE", "Forward", "GenericKernel", "Kernel", "NativeCpuKernel", "KeySearch", "Received",
           "for_stack", "key_search"]
