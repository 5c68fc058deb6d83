"""Preprocessing's host state for each plan: auto-capacity high-water marks and the exchange count.

A plan is an immutable value, so what preprocessing must remember between
batches lives here, on the host: one `PlanState` per plan object (two plans
made by two `plan()` calls keep separate marks, even if they are equal),
dropped when the plan is garbage-collected:

- With `capacity=None`, each stack's capacity is sized from the first batch
  (with headroom, on a coarse grid, capped at what fixed-length ids can
  fill) and grows, never shrinks, when a later
  batch needs more. The batch carries the capacity it was built with in its
  shapes, so a jitted step recompiles once per growth.
- A backend's own high-water marks (`high_water`; SparseCore: a stack's
  `max_ids_per_partition`, the size of its CSR input) grow the same way,
  from what its batches need.
- Under `jax.distributed`, the processes' preprocess exchanges are matched
  by their count.

Every access takes the state's lock, so `preprocess` may run on any thread
(as `prefetch` does).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import weakref
import zlib
from typing import Any, Callable, Hashable

import jax
import numpy as np

from sparse_embed.core.planning import CAPACITY_ALIGNMENT, EmbeddingPlan, StackPlan, round_up
from sparse_embed.host import distributed


def auto_capacity_for(needed: int, bound: int | None = None) -> int:
    """Capacity for `needed` entries with headroom, on a coarse grid, but no more than `bound`.

    Headroom: 10%, or 3 sqrt(needed) if larger (the batch-to-batch spread of
    small counts); the grid (8 steps per power of two) keeps growth, and so
    recompiles, rare. `bound`: the most entries a partition can get from
    batches of this shape (fixed-length ids), if known: room past it is
    padding that every step would carry and never use (on one device, all
    of the headroom).
    """
    target = max(CAPACITY_ALIGNMENT, math.ceil(needed + max(0.1 * needed, 3 * math.sqrt(needed))))
    granule = max(CAPACITY_ALIGNMENT, 1 << max(0, target.bit_length() - 4))
    capacity = round_up(target, granule)
    if bound is not None:
        capacity = min(capacity, round_up(max(bound, needed, 1), CAPACITY_ALIGNMENT))
    return capacity


class PlanState:
    """What preprocessing remembers about one plan (see the module docstring)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag  # names this plan's exchanges between processes (the same on every process)
        self._lock = threading.Lock()
        self._marks: dict[str, int] = {}
        self._bounded: set[str] = set()  # stacks whose capacity a bound cut short of the usual headroom
        self._outgrown: set[str] = set()  # stacks a batch grew past such a capacity: their shapes vary
        self._high_water: dict = {}  # a backend's marks (`high_water`)
        self._exchanges = 0

    def capacity(self, stack: StackPlan, needed: int, bound: int | None = None) -> int:
        """The capacity of `stack`'s next batch: the explicit one, or the high-water mark grown to `needed`.

        At most `bound` (see `auto_capacity_for`) until a batch outgrows a
        capacity a bound cut short: the stack's batch shapes vary, so from
        then on it keeps the full headroom (else each wider batch recompiles).
        """
        if stack.capacity is not None:
            return stack.capacity
        with self._lock:
            name, current = stack.name, self._marks.get(stack.name, 0)
            if needed > current:
                if name in self._bounded:
                    self._outgrown.add(name)
                headroom = auto_capacity_for(needed)
                current = headroom if name in self._outgrown else auto_capacity_for(needed, bound)
                if current < headroom:
                    self._bounded.add(name)
                self._marks[name] = current
            return current

    def high_water(self, key: Hashable, needed: int, size: Callable[[int], int]) -> int:
        """A high-water mark a backend keeps for the plan's batches (SparseCore: a stack's
        `max_ids_per_partition`): `size(needed)` when `needed` passes the current mark (or there is none yet),
        else the current mark."""
        with self._lock:
            current = self._high_water.get(key, 0)
            if needed > current or not current:
                current = self._high_water[key] = size(needed)
            return current

    def marks(self) -> dict[str, int]:
        """The auto capacities so far, `{stack: capacity}`."""
        with self._lock:
            return dict(self._marks)

    def snapshot(self) -> dict:
        """What this state learned from the batches so far, JSON-serialisable (a checkpoint holds it).

        `layout` is the plan's layout digest: the marks mean something only
        for plans of the same layout (the same stacks over the same devices).
        """
        with self._lock:
            return {"layout": self.tag.split(".")[0], "marks": dict(self._marks), "bounded": sorted(self._bounded),
                    "outgrown": sorted(self._outgrown),
                    "high_water": [[list(k) if isinstance(k, tuple) else k, v] for k, v in self._high_water.items()]}

    def restore(self, snapshot: dict) -> bool:
        """Takes the marks of a `snapshot` of a plan of the same layout (True); another layout's are ignored
        (False: the capacities are learned again from the batches, as for a new run)."""
        if snapshot.get("layout") != self.tag.split(".")[0]:
            return False
        with self._lock:
            self._marks = {str(k): int(v) for k, v in snapshot["marks"].items()}
            self._bounded, self._outgrown = set(snapshot["bounded"]), set(snapshot["outgrown"])
            self._high_water = {tuple(k) if isinstance(k, list) else k: int(v) for k, v in snapshot["high_water"]}
        return True

    def next_exchange(self) -> int:
        """The number of this plan's next exchange between processes (0, 1, ...)."""
        with self._lock:
            self._exchanges += 1
            return self._exchanges - 1


def _layout_key(plan: EmbeddingPlan) -> tuple:
    """What decides a plan's batches, and nothing that differs between processes (such as function ids)."""
    stacks = tuple(
        (s.name, s.num_shards, s.capacity,
         tuple((t.table.name, t.table.vocabulary_size, t.row_offset) for t in s.tables),
         tuple((f.feature.name, f.feature.batch_size, f.feature.max_sequence_length, f.feature.table.combiner,
                f.row_offset) for f in s.features),
         # SparseCores lay the rows out over D x S shards (a key without them stays as it was: saved marks hold)
         *((("sparsecores", s.sparsecores),) if s.sparsecores else ()))
        for s in plan.stacks)
    devices = tuple(int(d.id) for d in plan.mesh.devices.flat)
    return devices, tuple(plan.mesh.axis_names), plan.axis_name, plan.on_overflow, stacks


def _plain(x: Any) -> str:
    """An optimizer's settings as text equal on every process: numbers and strings, not functions (their reprs
    hold addresses), which are named by type only."""
    if dataclasses.is_dataclass(x):
        fields = (f"{f.name}={_plain(getattr(x, f.name))}" for f in dataclasses.fields(x))
        return f"{type(x).__name__}({', '.join(fields)})"
    return repr(x) if isinstance(x, (int, float, str, bool, type(None))) else type(x).__name__


def fingerprint(plan: EmbeddingPlan) -> list[str]:
    """What must be equal on every process that shares the plan, one line each: its layout, each stack's
    placement (its batch layout), each table's optimizer and what else its rows are computed with (each process
    runs the step on its own devices' rows: a width, max_norm, dtype or initializer of its own would train
    them apart silently, or hang the collectives)."""
    return [f"layout {_layout_key(plan)!r}",
            *(f"stack {s.name!r}: {s.batch_layout.summary} ({s.batch_layout.digest})" for s in plan.stacks),
            *(f"table {n!r}: optimizer {_plain(t.resolved_optimizer)}" for n, t in sorted(plan.tables.items())),
            *(f"table {n!r}: embedding_dim={t.embedding_dim}, max_norm={t.max_norm!r}, "
              f"dtype={np.dtype(t.dtype).name}, initializer={_plain(t.resolved_initializer)}, "
              f"dynamic={_plain(t.dynamic)}" for n, t in sorted(plan.tables.items()))]


_CHECKED: dict[int, bool] = {}  # id(plan) -> checked against the other processes
_CHECKS = [0]  # plans checked by this process so far (the check's exchange number)


def check_same_plan(plan: EmbeddingPlan, processes: tuple[int, ...]) -> None:
    """Once per plan, before its first exchange: every process built the same plan (else their exchanges, named
    by its layout, would never meet, and a process would wait for the others until it times out; or, with
    another optimizer, they would train apart silently). A RuntimeError naming the first difference."""
    with _LOCK:  # claimed once: a second thread's preprocess of the plan makes no second check exchange
        if _CHECKED.get(id(plan)):
            return
        _CHECKED[id(plan)] = True
        n, _CHECKS[0] = _CHECKS[0], _CHECKS[0] + 1
    weakref.finalize(plan, _CHECKED.pop, id(plan), None)
    mine = fingerprint(plan)
    texts = distributed.allgather_bytes(processes, "\n".join(mine).encode(), name="plans", n=n)
    for p, text in zip(processes, texts):
        theirs = text.decode().split("\n")
        if theirs != mine:
            a, b = next(((x, y) for x, y in itertools.zip_longest(mine, theirs, fillvalue="(none)") if x != y))
            raise RuntimeError(f"Process {jax.process_index()}'s plan differs from process {p}'s: every process "
                               f"must build the same plan. Here: {a[:300]}; there: {b[:300]}.")


_STATES: dict[int, PlanState] = {}  # id(plan) -> its state, while the plan lives
_SERIES: dict[str, int] = {}  # layout digest -> how many plans with that layout got a state (exchange names)
_LOCK = threading.Lock()


def of(plan: EmbeddingPlan) -> PlanState:
    """The host state of `plan` (created on its first use).

    Its exchange name is the plan's layout digest and how many plans of that
    layout got a state before it: the same on every process, since every
    process makes the same `preprocess` calls in the same order.
    """
    key = id(plan)
    with _LOCK:
        state = _STATES.get(key)
        if state is None:
            digest = f"{zlib.crc32(repr(_layout_key(plan)).encode()):08x}"
            _SERIES[digest] = _SERIES.get(digest, 0) + 1
            state = _STATES[key] = PlanState(f"{digest}.{_SERIES[digest]}")
            weakref.finalize(plan, _STATES.pop, key, None)
        return state
