"""The placement planner: the cost model's choice of a placement per table ("auto"), and the memory budget.

With D devices, a table's `TableLoad` (`core.cost`: `vocab` rows, `dim`
wide, read by features with `rows` output rows and `ids` ids per device)
costs each placement the bytes its strategy's `traffic` says a device
receives through collectives per train step, plus its `work`
(docs/placement.md and each module of `core.placements` give the
formulas). `cheapest` takes the least; ties go to the earlier registered
placement (row, table, replicated, column); `choose` then corrects the
placements whose traffic depends on the stacks they make ("table"). Memory
per device (`TableLoad.memory`: the padded rows and columns a device
holds, times the bytes of the table's and its slots' row) decides where
`to_move` takes a table when the plan exceeds a `memory_budget`.
"""

from __future__ import annotations

from sparse_embed.core import placements
from sparse_embed.core.cost import SLOT_ITEMSIZE, TableLoad, row_bytes, table_loads  # noqa: F401 (the planner's inputs)
from sparse_embed.core.placements.column import column_row_sums  # noqa: F401 (docs/placement.md names it here)


def _order(name: str) -> int:
    return placements.names().index(name)


def cheapest(load: TableLoad, num_devices: int, share: float | None = None) -> str:
    """The placement with the least `cost` among those "auto" may choose (ties: the earlier registered)."""
    allowed = [p for p in placements.names() if placements.get(p).choosable(load)]
    return min(allowed, key=lambda p: (load.cost(p, num_devices, share), _order(p)))


def choose(loads: dict[str, TableLoad], fixed: dict[str, str], stack_of, num_devices: int) -> dict[str, str]:
    """Each table's cheapest placement, then again with the stacks the choices of `shares_stacks` placements make.

    A stack of k tables placed "table" sends every shard `ceil(k/D)` tables'
    activation rows, not `k/D`: `stack_of(chosen)` (`{table: stack key}`)
    gives the k of each table's stack, and a table whose stack is too small
    to spread goes back to its cheapest other placement; so does one that
    those moves leave alone in its stack.
    """
    D = num_devices
    chosen = {n: fixed.get(n) or cheapest(load, D) for n, load in loads.items()}
    for alone in (False, True):
        keys, together = stack_of(chosen), {}
        for n, p in chosen.items():
            if placements.get(p).shares_stacks:
                together.setdefault(keys[n], []).append(n)
        for group in together.values():
            if alone and len(group) > 1:
                continue
            share = placements.get(chosen[group[0]]).share(len(group), D)
            for n in group:
                if n not in fixed:
                    chosen[n] = cheapest(loads[n], D, share)
    return chosen


def stack_mates_alike(fixed: dict[str, str], groups: list[list[str]], loads: dict[str, TableLoad],
                      num_devices: int) -> dict[str, str]:
    """`fixed` with each explicit stack's tables placed alike (a stack has one placement): a group with a fixed
    table gives its placement to the others; one with none gets the placement cheapest for the group as a whole.
    A group whose fixed tables disagree is left as it is (the plan names the disagreement)."""
    out = dict(fixed)
    for group in groups:
        given = {fixed[n] for n in group if n in fixed}
        if len(given) > 1:
            continue
        if given:
            out.update(dict.fromkeys(group, given.pop()))
            continue
        allowed = [p for p in placements.names() if all(placements.get(p).choosable(loads[n]) for n in group)]
        if allowed:
            out.update(dict.fromkeys(group, min(allowed, key=lambda p: (_group_cost(p, group, loads, num_devices),
                                                                        _order(p)))))
    return out


def _group_cost(placement: str, group: list[str], loads: dict[str, TableLoad], num_devices: int) -> float:
    """The cost of a stack of `group`'s tables all placed `placement` (a "table" stack spreads its k tables)."""
    strategy = placements.get(placement)
    share = strategy.share(len(group), num_devices) if strategy.shares_stacks else None
    return sum(loads[n].cost(placement, num_devices, share) for n in group)


def to_move(chosen: dict[str, str], fixed: dict[str, str], loads: dict[str, TableLoad],
            num_devices: int) -> tuple[str, str] | None:
    """`(table, placement)`: where to move a table so the plan needs less memory per device, or None.

    The largest table (by its memory where it is) that is not fixed and has
    a placement that is a `memory_target` and needs less memory goes to the
    cheapest of those (`cost`; ties in order of registration): replicated
    to table, table to row, column to row when its padding or per-row slots
    make it larger. "column" is no target: it needs at least what "row"
    needs, so "row" is always among the least. Each move lowers one
    table's memory, so the moves end, at worst with every movable table on
    "row".
    """
    D = num_devices
    targets = [q for q in placements.names() if placements.get(q).memory_target]
    moves = {}
    for n, p in chosen.items():
        now = loads[n].memory(p, D)
        less = [q for q in targets if q != p and loads[n].memory(q, D) < now]
        if n not in fixed and less:
            moves[n] = min(less, key=lambda q: (loads[n].cost(q, D), _order(q)))
    n = max(moves, key=lambda n: (loads[n].memory(chosen[n], D), n), default=None)
    return None if n is None else (n, moves[n])
