"""The cost model: memory per device and bytes through collectives per train step, of tables and of plans.

It reads the plan's data (a `TableLoad` per table before there is a plan;
the frozen `StackPlan`s after) and takes each placement's formulas from its
strategy (`placements`; docs/placement.md lists them). Bytes count what one
device receives in one forward and backward of `lookup`: an all_to_all or
all_gather `(D-1)/D` of its result, an all-reduce twice that (a ring). Raw-id
tables' `map_ids` exchange is not counted. `plan.collective_bytes()` is
exact for explicit capacities: a test compares it with the compiled train
step's HLO.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from sparse_embed.core import placements
from sparse_embed.core.placements.base import CAPACITY_ALIGNMENT, round_up
from sparse_embed.core.placements.column import column_row_sums

SLOT_ITEMSIZE = 4  # optimizer slots are float32 (`core.state.SLOT_DTYPE`)


@dataclasses.dataclass(frozen=True)
class TableLoad:
    """What one table costs to keep and to read, per device and step."""

    vocab: int
    dim: int
    row_bytes: int  # bytes of one row of the table and its slots
    rows: int  # output rows of its features on one device
    ids: float  # ids of its features on one device
    row_sums: int | None = 0  # "column": whole-row statistics all-reduced per id (None: it cannot be split)
    whole_bytes: int = 0  # bytes of a row that "column" keeps whole on every device (per-row slots)

    def traffic(self, placement: str, num_devices: int, share: float | None = None) -> float:
        """Bytes one device receives through collectives per train step (`Placement.traffic`; `share`: see
        `Placement.share`)."""
        return 0.0 if num_devices == 1 else placements.get(placement).traffic(self, num_devices, share)

    def cost(self, placement: str, num_devices: int, share: float | None = None) -> float:
        """Traffic, plus the placement's extra work (a replicated table's dense gradient pass)."""
        work = placements.get(placement).work(self, num_devices) if num_devices > 1 else 0.0
        return self.traffic(placement, num_devices, share) + work

    def memory(self, placement: str, num_devices: int) -> float:
        """Bytes of the table and its slots on the devices that hold it, as the plan pads them.

        Exact for every placement but "table", where a device holds as many
        rows as the busiest device of the stack.
        """
        return placements.get(placement).memory(self, num_devices)


def row_bytes(table) -> int:
    """Bytes of one row of a `TableSpec` and of its optimizer's slots."""
    slots = table.resolved_optimizer.slots(table.embedding_dim)
    return int(table.embedding_dim * np.dtype(table.dtype).itemsize + sum(s.width for s in slots.values()) * SLOT_ITEMSIZE)


def table_loads(feats: dict, tables: dict, num_devices: int, ids_per_sample: dict[str, float],
                skip_nonfinite: bool = True) -> dict[str, TableLoad]:
    """`{table: TableLoad}` from the features (`{name: FeatureSpec}`) that read each table (`skip_nonfinite`: the
    plan's policy, which decides whether "column" all-reduces a non-finite flag per id)."""
    out = {}
    for name, t in tables.items():
        users = [f for f in feats.values() if f.table.name == name]
        rows = sum(f.batch_size // num_devices * max(f.max_sequence_length, 1) for f in users)
        ids = sum(f.batch_size / num_devices * ids_per_sample[f.name] for f in users)
        o = t.resolved_optimizer
        sums = (column_row_sums(t.max_norm is not None, o.elementwise, skip_nonfinite)
                if o.splits_columns and not t.dynamic else None)
        whole = sum(s.width for s in o.slots(t.embedding_dim).values() if s.width != t.embedding_dim) * SLOT_ITEMSIZE
        out[name] = TableLoad(t.vocabulary_size, t.embedding_dim, row_bytes(t), rows, ids, sums, whole)
    return out


# ----------------------------------------------------------------------- a plan's stacks
def expected_capacity(stack) -> int:
    """The explicit capacity, else the cost model's: the most ids one device is expected to send one segment."""
    if stack.capacity is not None:
        return stack.capacity
    return round_up(max(1, math.ceil(stack.strategy.most_ids(stack))), CAPACITY_ALIGNMENT)


def collective_bytes(stack, capacity: int | None = None, skip_nonfinite: bool = True) -> int:
    """Bytes one device receives through the collectives of one train step of `lookup` for this stack.

    Forward and backward (the exchanged COO entries, the partial
    activations, the activation gradients; "replicated": the all-reduce of
    the dense gradient), at `capacity` (default: `expected_capacity`).
    """
    C = expected_capacity(stack) if capacity is None else capacity
    return stack.strategy.collective_bytes(stack, C, skip_nonfinite)


def row_sums(stack, skip_nonfinite: bool = True) -> int:
    """f32 all-reduced per received entry in a train step for statistics of rows split over devices (0: none)."""
    return stack.strategy.row_sums(stack, skip_nonfinite)


def row_gathers(stack) -> int:
    """f32 arrays `[D*C, array_dim]` all_gathered whole per train step for an optimizer that sees whole rows
    of rows split over devices (0: none)."""
    return stack.strategy.row_gathers(stack)


def stack_row_bytes(stack) -> int:
    """Bytes of one row of the stacked table and slots, as one device holds it."""
    return stack.array_dim * np.dtype(stack.dtype).itemsize + sum(stack.slot_widths().values()) * SLOT_ITEMSIZE


def memory_per_device(stack) -> int:
    """Bytes of this stack's table and slots on each device."""
    return stack.rows_per_shard * stack_row_bytes(stack)


# ----------------------------------------------------------------------- a plan
def checked_capacities(plan, capacities: Mapping[str, int] | None) -> dict[str, int]:
    """`capacities` as given (`{stack: positive int}`, e.g. `Stats.capacity`): a ValueError naming the stack
    for another plan's stack or a capacity that is not a positive int (a negative one gave negative bytes)."""
    if capacities is None:
        return {}
    if not isinstance(capacities, Mapping):
        raise TypeError(f"capacities must be a mapping {{stack: int}} (e.g. Stats.capacity), got "
                        f"{type(capacities).__name__}.")
    unknown = sorted(set(capacities) - set(plan.stack_names))
    if unknown:
        raise ValueError(f"capacities name stacks {unknown} that this plan does not have (its stacks: "
                         f"{list(plan.stack_names)}).")
    for name, c in capacities.items():
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c <= 0:
            raise ValueError(f"capacities[{name!r}] must be a positive int, got {c!r}.")
    return {k: int(c) for k, c in capacities.items()}


def plan_collective_bytes(plan, capacities: Mapping[str, int] | None = None) -> int:
    """Bytes one device receives through collectives in one train step of `lookup`; `capacities` (e.g.
    `Stats.capacity`) for stacks of auto capacity."""
    skip, caps = plan.nonfinite_gradients == "skip", checked_capacities(plan, capacities)
    return sum(collective_bytes(s, caps.get(s.name), skip) for s in plan.stacks)


def plan_memory(plan) -> int:
    """Bytes of tables and optimizer slots on each device."""
    return sum(memory_per_device(s) for s in plan.stacks)


def describe(plan, capacities: Mapping[str, int] | None = None, offload: Mapping[str, Any] | None = None) -> str:
    """A table of where every table lives, its memory per device and the bytes its stack exchanges.

    Bytes are per device and train step (`plan_collective_bytes`), at the
    stacks' explicit capacities, else `capacities` (e.g. `Stats.capacity`),
    else the cost model's expectation. Offloaded tables add a line each: the
    store, the cache and, from `offload` (`Tiers.stats()`), the observed hit
    rate and rows read and written.
    """
    D, caps = plan.num_shards, checked_capacities(plan, capacities)
    skip = plan.nonfinite_gradients == "skip"  # the stacks' bytes under the plan's policy, as the total counts them
    lines = [f"EmbeddingPlan on {D} device(s) of mesh axis {plan.axis_name!r}: "
             f"{_size(plan_memory(plan))} of tables and slots per device, "
             f"{_size(plan_collective_bytes(plan, caps))} through collectives per device and train step",
             f"{'table':<24} {'stack':<24} {'placement':<16} {'rows x dim':>16} {'memory/device':>14} "
             f"{'stack bytes/step':>17}"]
    for s in plan.stacks:
        stack_bytes = _size(collective_bytes(s, caps.get(s.name), skip))
        for p in s.tables:
            where = s.placement if p.shard is None else f"{s.placement} (device {p.shard})"
            per_device = s.strategy.held_rows(s, p) * stack_row_bytes(s)
            stack = s.name if len(s.name) <= 24 else s.name[:23] + "…"
            lines.append(f"{p.table.name:<24} {stack:<24} {where:<16} "
                         f"{f'{p.table.vocabulary_size} x {p.table.embedding_dim}':>16} "
                         f"{_size(per_device):>14} {stack_bytes:>17}")
    for t in plan.tiered:
        line = (f"offloaded {t.name!r}: {t.vocabulary_size} rows in {t.storage.path}, a cache of {t.cache_rows} "
                f"rows ({t.cache_rows / t.vocabulary_size:.1%})")
        seen = (offload or {}).get(t.name)
        if seen is not None and seen.lookups:
            line += (f"; observed: hit rate {seen.hit_rate:.3f} over {seen.lookups} ids, {seen.rows_read} rows "
                     f"read, {seen.rows_written} written")
        lines.append(line)
    return "\n".join(lines)


def _size(n: float) -> str:
    """Bytes, human-readable (KiB, MiB, GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
