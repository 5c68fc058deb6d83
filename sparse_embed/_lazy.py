"""Names of a namespace module loaded on first use (PEP 562), and old names kept behind a `DeprecationWarning`.

`import sparse_embed` then costs nothing, and `import sparse_embed.core.x`
(which runs `sparse_embed/__init__.py` first) loads no checkpoint, serving
or integration code, nor orbax, tensorstore, flax or optax.

    __getattr__, __dir__ = attach(__name__, {"sparse_embed.core.planning": ("plan", ...)},
                                  submodules=("optimizers",), moved={"to_jte": "sparse_embed.jte"})
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any, Callable, Iterable, Mapping


def _invert(names: Mapping[str, Iterable[str]]) -> dict[str, str]:
    """{module: (name, ...)} -> {name: module}; a name listed twice is a mistake."""
    out: dict[str, str] = {}
    for module, listed in names.items():
        for name in listed:
            if name in out:
                raise ValueError(f"{name!r} is listed under both {out[name]} and {module}")
            out[name] = module
    return out


def attach(
    package: str,
    names: Mapping[str, Iterable[str]],
    *,
    submodules: Iterable[str] = (),
    moved: Mapping[str, str] | None = None,
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of module `package`.

    `names` maps an implementation module to the names it provides (each
    imported, then kept in the module's globals, on first use); `submodules`
    are `package`'s own submodules (imported on first use); `moved` maps an
    old name to the namespace module that now holds it: the name still
    resolves to the same object, with a `DeprecationWarning` on each use,
    and `__dir__` leaves it out.
    """
    where = _invert(names)
    subs, moved = frozenset(submodules), dict(moved or {})

    def __getattr__(name: str) -> Any:
        if name in where:
            value = getattr(importlib.import_module(where[name]), name)
        elif name in subs:
            value = importlib.import_module(f"{package}.{name}")
        elif name in moved:
            warnings.warn(f"{package}.{name} has moved to {moved[name]}.{name}; the old name goes in the next "
                          f"release", DeprecationWarning, stacklevel=2)
            return getattr(importlib.import_module(moved[name]), name)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where) | subs)

    return __getattr__, __dir__
