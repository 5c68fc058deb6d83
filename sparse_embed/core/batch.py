"""The batch contract between host preprocessing and the lookup: one batch type per shape of batch, and `Stats`.

For every device d and destination shard s a stack's batch holds a
fixed-capacity segment of COO entries `(col_id, row_id, value)`: `col_id` is
the row inside shard s, `row_id` the output row on device d, `value` the
gain with the combiner folded in (see `pooling`). Entries are ordered by
`row_id` inside a segment. Padding entries have `col_id = rows_per_shard`
and `row_id = rows_per_device` (both out of range, so they never touch a
real row) and value 0.

Every batch type starts with those five COO arrays, in that order, so that
code that only routes COO entries (a placement's exchange, the CSR builder)
reads any of them; what a stack's batch carries besides depends on where it
is on its way to the lookup, one type each instead of optional fields:

- `ShardedCooMatrix`: rows (what `lookup` reads for most stacks);
- `RawIdBatch`: a raw-id stack's batch from `preprocess`, before `map_ids`
  (the distinct raw ids each segment sends its owner shard);
- `MappedIdBatch`: `map_ids`' result for a stack whose `Dynamic.default`
  is set (the gains of the ids that got no row, which read the default);
- a backend's own type where its kernel reads more than COO entries
  (SparseCore: `core.sparsecore.batch.SparseCoreBatch`, COO and CSR).

Every batch also has a `layout`: the `BatchLayout` of the plan's stack it
was built for. It is not one of the tuple's fields (iterating or unpacking a
batch gives its arrays) and holds no array: it travels in the pytree's
structure, so a jitted `lookup` sees it as a static value. Two plans can
give a stack batches of equal shapes that mean other rows (row against
table placement, other vocabularies): `lookup` and `map_ids` refuse a batch
whose layout is not their plan's. A batch built by hand has `layout=None`
and is not checked.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """What a stack's batch was built for: `digest` of the stack's layout (placement, shards, tables' rows,
    features' output rows; not its capacity, which the arrays' shapes show), `summary` for error messages."""

    stack: str
    digest: str
    summary: str = dataclasses.field(compare=False)


def layout_error(name: str, got: BatchLayout | None, want: BatchLayout) -> str | None:
    """Why a batch with layout `got` cannot be read by a plan whose stack `name` has layout `want` (None: it can,
    or the batch is unmarked)."""
    if got is None or got == want:
        return None
    how = (f"({got.summary}; this plan: {want.summary})" if got.summary != want.summary else
           f"({want.summary}, but other tables, vocabularies or features in it)")
    return (f"Stack {name!r}: the batch was built for another plan's stack {got.stack!r} {how}; its entries "
            "would mean other rows or gains here. Build it with sparse_embed.preprocess(plan, ...) for the plan "
            "you look it up with.")


def capacity_of(batch) -> int:
    """COO entries per (device, segment) partition."""
    return batch.col_ids.shape[1] // batch.shard_starts.shape[1]


class _Marked:
    """A batch type's `layout` beside its tuple of arrays (see the module doc); `_replace` keeps it."""

    layout: BatchLayout | None = None

    def __new__(cls, *arrays, layout: BatchLayout | None = None, **named):
        self = super().__new__(cls, *arrays, **named)
        if layout is not None:
            self.layout = layout
        return self

    def _replace(self, **changes):
        layout = changes.pop("layout", self.layout)
        return type(self)(*super()._replace(**changes), layout=layout)


def marked(fields: type) -> type:
    """The batch type of the NamedTuple `fields` (its name, doc and fields) with a `layout`, a pytree whose
    children are the fields and whose static data is the layout."""
    cls = type(fields.__name__, (_Marked, fields), {"__doc__": fields.__doc__, "__module__": fields.__module__,
                                                    "__qualname__": fields.__qualname__})
    keys = tuple(jax.tree_util.GetAttrKey(f) for f in fields._fields)
    jax.tree_util.register_pytree_with_keys(cls, lambda b: (tuple(zip(keys, b)), b.layout),
                                            lambda layout, arrays: cls(*arrays, layout=layout),
                                            flatten_func=lambda b: (tuple(b), b.layout))
    return cls


@marked
class ShardedCooMatrix(NamedTuple):
    """One stack's batch of rows. Leading axis = device (sharded over the plan's axis).

    shard_starts, shard_ends: `[D, S]` int32, entry range of each destination shard's segment.
    col_ids, row_ids: `[D, S * capacity]` int32. values: `[D, S * capacity]` float32.
    """

    shard_starts: Any
    shard_ends: Any
    col_ids: Any
    row_ids: Any
    values: Any

    capacity = property(capacity_of)


@marked
class RawIdBatch(NamedTuple):
    """A raw-id stack's batch from `preprocess` (its table is `dynamic=`), which `map_ids` maps to rows.

    The COO arrays of `ShardedCooMatrix`, and `keys [D, S * capacity, 2]` int32: the distinct raw ids (hi, lo
    words; -1 unused) that each segment sends its owner shard; `col_ids` index them (padding: `capacity`).
    """

    shard_starts: Any
    shard_ends: Any
    col_ids: Any
    row_ids: Any
    values: Any
    keys: Any

    capacity = property(capacity_of)


@marked
class MappedIdBatch(NamedTuple):
    """`map_ids`' batch of rows for a raw-id stack with a `Dynamic.default`: the COO arrays of
    `ShardedCooMatrix`, and `defaults [D, rows_per_device]` f32, per output row the gains of its ids that have no
    row (they read the default vector)."""

    shard_starts: Any
    shard_ends: Any
    col_ids: Any
    row_ids: Any
    values: Any
    defaults: Any

    capacity = property(capacity_of)


def coo(batch) -> ShardedCooMatrix:
    """The COO arrays of any batch type."""
    return batch if type(batch) is ShardedCooMatrix else ShardedCooMatrix(*batch[:5], layout=batch.layout)


def is_batch(entry) -> bool:
    """Is `entry` one of the batch types (the five COO arrays first), if perhaps not the one a stack needs?"""
    return tuple(getattr(type(entry), "_fields", ())[:5]) == ShardedCooMatrix._fields


def default_gains(batch) -> Any:
    """A mapped batch's `defaults` (`MappedIdBatch`), else None."""
    return batch.defaults if isinstance(batch, MappedIdBatch) else None


@dataclasses.dataclass(frozen=True)
class Stats:
    """What preprocessing saw, per stack (so capacities can be sized from real data).

    When the plan's mesh spans several processes, the stats are already
    combined over all of them (maxima of maxima, sums of counts) and equal on
    every process; `merge` combines the stats of several batches.
    """

    max_ids_per_partition: dict[str, int]
    max_unique_ids_per_partition: dict[str, int]
    dropped_ids: dict[str, int]
    num_ids: dict[str, int]
    capacity: dict[str, int]
    sparsecore_ids_per_partition: dict[str, int] = dataclasses.field(default_factory=dict)
    """SparseCore stacks: the most ids a SparseCore partition got from one slice (before merging duplicates)."""
    batches: int = 1
    """How many batches these stats count (`merge` adds them): `num_ids / batches` is a batch's ids."""
    layouts: dict[str, str] = dataclasses.field(default_factory=dict)
    """Each stack's `BatchLayout.digest`: the layout its counts were measured under (`grow_capacity` refuses
    stats of another; empty for stats built by hand)."""
    truncated_ids: dict[str, int] = dataclasses.field(default_factory=dict)
    """Ids of the stack's sequence features past their `max_sequence_length`, left out of the batch (a
    sequence feature's output holds its first L positions; docs/bad_input.md)."""

    def merge(self, other: "Stats") -> "Stats":
        """Combines the stats of two batches (max of maxima, sum of counts)."""
        mx = lambda a, b: {k: max(a.get(k, 0), b.get(k, 0)) for k in a.keys() | b.keys()}
        sm = lambda a, b: {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}
        return Stats(
            mx(self.max_ids_per_partition, other.max_ids_per_partition),
            mx(self.max_unique_ids_per_partition, other.max_unique_ids_per_partition),
            sm(self.dropped_ids, other.dropped_ids),
            sm(self.num_ids, other.num_ids),
            mx(self.capacity, other.capacity),
            mx(self.sparsecore_ids_per_partition, other.sparsecore_ids_per_partition),
            self.batches + other.batches,
            _same_layouts(self.layouts, other.layouts),
            sm(self.truncated_ids, other.truncated_ids),
        )


def _same_layouts(a: dict[str, str], b: dict[str, str]) -> dict[str, str]:
    """The union of two stats' stack layouts; a stack measured under two layouts is a ValueError."""
    other = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
    if other:
        raise ValueError(f"Stats.merge: stacks {other} were measured under different plans' layouts (placement, "
                         "shards or tables): merge stats of one plan.")
    return {**a, **b}
