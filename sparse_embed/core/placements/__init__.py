"""Placements: where a stack's tables live, one strategy object per placement (docs/placement.md).

Each placement is a `Placement` (`base`) in a module of its own, which owns
its layout, its relayout to and from natural order, the exchange the
lookup runs for it and its cost:

- `row` (the default): rows MOD-sharded over the devices (or SparseCores);
- `table`: each table whole on one device, a stack's tables balanced;
- `replicated`: every row on every device;
- `column`: every row on every device, each device its share of the columns.

The plan, the relayout, the lookup and the cost model ask the strategy of a
stack (`StackPlan.strategy`, i.e. `get(stack.placement)`) and never branch
on its name. Adding a placement is one module with a `Placement` subclass
and one `register` line below; the order of registration is the order in
which "auto" breaks ties between equal costs.
"""

from __future__ import annotations

from sparse_embed.core.placements.base import CAPACITY_ALIGNMENT, Placement, Where, round_up
from sparse_embed.core.placements.column import Column
from sparse_embed.core.placements.replicated import Replicated
from sparse_embed.core.placements.row import Row
from sparse_embed.core.placements.table import Table

AUTO = "auto"  # not a placement: `plan(placement=...)` lets the cost model choose
_REGISTRY: dict[str, Placement] = {}


def register(placement: Placement) -> Placement:
    """Adds a placement under its `name` (ties in "auto" go to the earlier registered)."""
    if not isinstance(placement, Placement):
        raise TypeError(f"register() takes a Placement, got {type(placement).__name__}.")
    if placement.name in _REGISTRY or placement.name == AUTO:
        raise ValueError(f"A placement named {placement.name!r} is already registered.")
    _REGISTRY[placement.name] = placement
    return placement


def get(name: str) -> Placement:
    """The placement registered as `name`."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"Unknown placement {name!r}; placements are {names()}.") from None


def names() -> tuple[str, ...]:
    """Every registered placement's name, in order of registration."""
    return tuple(_REGISTRY)


def raw_id_names() -> tuple[str, ...]:
    """The placements that can hold a raw-id (dynamic=) table."""
    return tuple(n for n, p in _REGISTRY.items() if p.raw_ids)


DEFAULT = register(Row()).name  # plan()'s default, and where raw-id tables always go
register(Table())
register(Replicated())
register(Column())

__all__ = ["AUTO", "CAPACITY_ALIGNMENT", "DEFAULT", "Placement", "Where", "get", "names", "raw_id_names", "register",
           "round_up"]
