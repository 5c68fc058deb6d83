"""A warning for the one common way to lose the compiled extensions without knowing it.

After `pip install .` (not `-e`), a script or `python -m` run from the checkout
imports the checkout's `sparse_embed/`, because the current directory comes
first on `sys.path`; the compiled extensions are in the installed copy only.
The lookup and preprocessing then fall back to XLA and numpy. The loaders of
the extensions call `warn_if_shadowed` when their import fails.
"""

from __future__ import annotations

import importlib.machinery
import os
import pathlib
import sys
import warnings
from typing import Iterator

_HERE = pathlib.Path(__file__).resolve().parent.parent  # the package directory


def _has(package: pathlib.Path, module: str) -> bool:
    return any((package / (module + suffix)).exists() for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def _copies() -> Iterator[pathlib.Path]:
    """Every `sparse_embed` package directory Python could import: under each `sys.path` entry, and where
    the other import finders (an editable install's) would take it from."""
    for entry in sys.path:
        yield pathlib.Path(entry or os.getcwd()).resolve() / "sparse_embed"
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder or not hasattr(finder, "find_spec"):
            continue
        try:
            spec = finder.find_spec("sparse_embed", None)
        except Exception:  # a finder of someone else's: not our concern
            continue
        if spec is not None and spec.origin:
            yield pathlib.Path(spec.origin).resolve().parent


def shadowed_by(module: str) -> pathlib.Path | None:
    """The directory holding another `sparse_embed` that has the extension `module` (a path inside the
    package, e.g. "core/kernels/_native_cpu"), if this one lacks it; else None."""
    if _has(_HERE, module):
        return None  # built here: an import error has another cause
    return next((copy.parent for copy in _copies() if copy != _HERE and _has(copy, module)), None)


def shadow_note(module: str, what: str) -> str | None:
    """Why `module` is missing when another copy has it (see `shadowed_by`), with the fix; else None."""
    other = shadowed_by(module)
    if other is None:
        return None
    return (f"sparse_embed is imported from {_HERE.parent}, which has no compiled {what}, ahead of the copy in "
            f"{other}, which has it. Run from another directory, or `pip install -e .` in {_HERE.parent} to "
            "build it there")


def warn_if_shadowed(module: str, what: str, instead: str) -> None:
    """Warns when `module` is missing here but built in another copy further down `sys.path`."""
    note = shadow_note(module, what)
    if note is not None:
        warnings.warn(f"{note}; until then {instead}.", stacklevel=3)
