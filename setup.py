"""Builds the optional native code (metadata: pyproject.toml).

- `sparse_embed.host._native` (C, the CPython API only): preprocessing's kernels.
- `sparse_embed.tiers._clock` (C, the CPython API only): an offloaded table's cache admission (else numpy).
- `sparse_embed.core.kernels._native_cpu` (C++17, XLA's typed FFI): the native CPU kernel of the lookup
  and of the raw-id map's key search.
  Its headers ship with jaxlib (`jaxlib/include`), a build requirement in pyproject.toml.

Both are `optional=True`: without a compiler (or without jaxlib's headers) the install still succeeds,
preprocessing runs its numpy path (`sparse_embed.host.native.extension()` is None) and the lookup its generic
kernel (`sparse_embed.core.kernels.native_cpu.available()` is False).
"""

import os

from setuptools import Extension, setup


def ffi_include_dir() -> str | None:
    """jaxlib's include directory (what `jax.ffi.include_dir()` returns), if it has the FFI headers."""
    try:
        import jaxlib
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(jaxlib.__file__), "include")
    return path if os.path.exists(os.path.join(path, "xla", "ffi", "api", "ffi.h")) else None


extensions = [
    Extension(
        "sparse_embed.host._native",
        ["sparse_embed/host/_native.c"],
        # portable -O3 (no -march); no FMA contraction, so float sums match numpy's bit for bit
        extra_compile_args=["-O3", "-ffp-contract=off"],
        optional=True,
    ),
    Extension(
        "sparse_embed.tiers._clock",
        ["sparse_embed/tiers/_clock.c"],
        extra_compile_args=["-O3"],
        optional=True,
    ),
]
if ffi_include_dir() is not None:
    extensions.append(
        Extension(
            "sparse_embed.core.kernels._native_cpu",
            ["sparse_embed/core/kernels/_native_cpu.cc", "sparse_embed/core/kernels/_native_keys.cc"],
            depends=["sparse_embed/core/kernels/_native_threads.h", "sparse_embed/core/kernels/_native_isa.h"],
            include_dirs=[ffi_include_dir()],
            language="c++",
            # no FMA contraction: the same rounding as the generic kernel's XLA code where the order matches
            extra_compile_args=["-std=c++17", "-O3", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=hidden"],
            optional=True,
        )
    )
else:
    print("sparse_embed: jaxlib's FFI headers not found; the native CPU kernel is not built (generic kernel only).")

setup(ext_modules=extensions)
