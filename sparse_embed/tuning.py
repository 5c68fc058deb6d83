"""Process settings for speed on CPU: call them at start, before the first JAX computation.

- `configure_xla_cpu()`: XLA:CPU flags that keep the generic kernel's train
  step from copying whole tables (docs/lookup.md);
- `configure_cpu_allocator()`: glibc malloc settings that reuse XLA's
  per-step temporaries instead of mapping fresh pages (docs/raw_ids.md).

Implemented in `sparse_embed.core.kernels.generic` and `sparse_embed.host.malloc`; loaded on first use.
"""

from sparse_embed import _lazy

__all__ = ["configure_cpu_allocator", "configure_xla_cpu"]

__getattr__, __dir__ = _lazy.attach(__name__, {
    "sparse_embed.core.kernels.generic": ("configure_xla_cpu",),
    "sparse_embed.host.malloc": ("configure_cpu_allocator",),
})
