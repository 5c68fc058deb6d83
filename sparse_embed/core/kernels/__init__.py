"""Implementations of the lookup's per-shard work, behind one interface (see `interface`).

- `GenericKernel` ("generic"): jnp/lax code; the reference, used on every
  platform without a faster implementation and for `Custom` optimizers.

`for_stack` picks the implementation a plan asks for: `plan.kernel` is a
name ("auto" picks the fastest that supports the stack on the mesh's
platform) or a kernel instance (e.g. `GenericKernel(chunk=5)` in tests).
"""

from __future__ import annotations

from sparse_embed.core.kernels.generic import GenericKernel
from sparse_embed.core.kernels.interface import Forward, Kernel, Received
from sparse_embed.core.planning import EmbeddingPlan, StackPlan

GENERIC = GenericKernel()


def for_stack(plan: EmbeddingPlan, stack: StackPlan) -> Kernel:
    """The kernel that runs `stack`'s per-shard work under `plan`."""
    kernel = plan.kernel
    if not isinstance(kernel, str):
        why = kernel.unsupported(stack)
        if why:
            raise ValueError(f"Stack {stack.name!r}: kernel {kernel.name!r} cannot run it: {why}.")
        return kernel
    return GENERIC


__all__ = ["GENERIC", "Forward", "GenericKernel", "Kernel", "Received", "for_stack"]
