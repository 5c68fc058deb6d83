"""The kernels behind the lookup's seam (`interface.Kernel`), and which one runs a stack (`for_stack`).

- `GenericKernel` ("generic"): jnp/lax code; the reference, used on every
  platform without a faster implementation and for `Custom` optimizers.
- `NativeCpuKernel` ("native"): C++ through XLA's typed FFI, on CPU.
- a backend's kernel, for the stacks that backend runs (`StackPlan.backend`;
  `BACKENDS`): SparseCore's (`core.sparsecore.kernel.SparseCoreKernel`)
  runs the primitives on TPU and the kernel chosen here elsewhere.

Each is a `base.KernelBase`: it writes its per-shard work, and gets the
defaults of the rest of the protocol. `for_stack` picks the implementation
a plan asks for: `plan.kernel` is a name ("auto": native on CPU where it
supports the stack, else generic) or a kernel instance (e.g.
`GenericKernel(chunk=5)`, `NativeCpuKernel(threads=1)`), wrapped in the
stack's backend's kernel if it has one.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax

from sparse_embed.core import key_set, sparsecore
from sparse_embed.core.kernels.base import KernelBase
from sparse_embed.core.kernels.generic import GenericKernel, warn_if_slow_on_cpu
from sparse_embed.core.kernels.interface import Forward, Kernel, Received, StackForward
from sparse_embed.core.kernels.native_cpu import NativeCpuKernel
from sparse_embed.core.planning import EmbeddingPlan, StackPlan
from sparse_embed.core.sparsecore import kernel as sparsecore_kernel

GENERIC = GenericKernel()
NATIVE = NativeCpuKernel()
# A backend's kernel by `StackPlan.backend`: built around the kernel the plan runs otherwise. (Looked up in its
# module when called: the backend's module imports this package's interface, and either may be imported first.)
BACKENDS: dict[str, Callable[[Kernel], Kernel]] = {
    sparsecore.NAME: lambda kernel: sparsecore_kernel.SparseCoreKernel(kernel),
}


def _platform(plan: EmbeddingPlan) -> str:
    return plan.mesh.devices.flat[0].platform


def _chosen(plan: EmbeddingPlan, stack: StackPlan) -> Kernel:
    """The kernel `plan.kernel` asks for, for `stack` (checked against it)."""
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


def for_stack(plan: EmbeddingPlan, stack: StackPlan) -> Kernel:
    """The kernel that runs `stack` under `plan`: the one the plan asks for, in its backend's kernel if any."""
    kernel = _chosen(plan, stack)
    backend = BACKENDS.get(stack.backend)
    return kernel if backend is None else backend(kernel)


def warn_if_slow(plan: EmbeddingPlan) -> None:
    """Warns when a train step is traced for CPU with kernels that then copy whole tables (`generic.CPU_FLAGS`)."""
    warn_if_slow_on_cpu(plan, [s.name for s in plan.stacks if for_stack(plan, s).needs_xla_cpu_flags])


class KeySearch(NamedTuple):
    """How a raw-id stack's shards search and grow their `KeySet`s, deduplicate received keys and hand every
    entry its id's row (`key_set.find` / `touch` / `insert` / `unique` / `take`'s signatures)."""

    find: Callable[[key_set.KeySet, jax.Array], jax.Array]
    touch: Callable[[key_set.KeySet, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]
    insert: Callable[..., key_set.Inserted]
    unique: Callable[[jax.Array], tuple[jax.Array, jax.Array]]
    take: Callable[[jax.Array, jax.Array, int], jax.Array]
    # `touch` of several `(keys, queries, stale_before[, (slot_of, values)])` with one step: a list of its results
    # (with entries, `key_set.entry_rows` of each set's too)
    touch_many: Callable[[Sequence[tuple], jax.Array], list]


def key_search(plan: EmbeddingPlan, stack: StackPlan) -> KeySearch:
    """The stack's kernel's `find_keys` / `touch_keys` / `insert_keys` / `unique_keys` / `take_rows` /
    `touch_keys_many` (`KernelBase`'s are `key_set`'s)."""
    k = for_stack(plan, stack)
    return KeySearch(k.find_keys, k.touch_keys, k.insert_keys, k.unique_keys, k.take_rows, k.touch_keys_many)


__all__ = ["BACKENDS", "GENERIC", "NATIVE", "Forward", "GenericKernel", "Kernel", "KernelBase", "KeySearch",
           "NativeCpuKernel", "Received", "StackForward", "for_stack", "key_search",
           "warn_if_slow"]
