"""The optional C kernels of preprocessing (`_native.c`, compiled by `pip install`), loaded on first use.

`extension()` is the compiled module, or None when it was not built (no C
compiler at install time) or when `SPARSE_EMBED_NATIVE=0` is set (read at
each call, so a test or a user can switch to numpy at any time). Both paths
give bit-for-bit the same batches.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

from sparse_embed.core.shadowed import warn_if_shadowed

ENV = "SPARSE_EMBED_NATIVE"  # "0": use the numpy path


@functools.cache
def _load() -> ModuleType | None:
    try:
        return importlib.import_module("sparse_embed.host._native")
    except ImportError:
        warn_if_shadowed("host/_native", "C preprocessing", "preprocessing runs on numpy")
        return None


def extension() -> ModuleType | None:
    """The C extension module, or None (not built, or `SPARSE_EMBED_NATIVE=0`)."""
    return None if os.environ.get(ENV) == "0" else _load()
