"""The batch contract between host preprocessing and the lookup: `ShardedCooMatrix` and `Stats`.

For every device d and destination shard s a stack's batch holds a
fixed-capacity segment of COO entries `(col_id, row_id, value)`: `col_id` is
the row inside shard s, `row_id` the output row on device d, `value` the
gain with the combiner folded in (see `pooling`). Entries are ordered by
`row_id` inside a segment. Padding entries have `col_id = rows_per_shard`
and `row_id = rows_per_device` (both out of range, so they never touch a
real row) and value 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple


class ShardedCooMatrix(NamedTuple):
    """One stack's batch. Leading axis = device (sharded over the plan's axis).

    shard_starts, shard_ends: `[D, S]` int32, entry range of each destination shard's segment.
    col_ids, row_ids: `[D, S * capacity]` int32. values: `[D, S * capacity]` float32.
    keys: None, or for a table keyed by raw ids (before `map_ids`) `[D, S * capacity, 2]`
      int32: the distinct raw ids (hi, lo words; -1 unused) that each segment sends
      its owner shard; `col_ids` then index them (padding: `capacity`).
    """

    shard_starts: Any
    shard_ends: Any
    col_ids: Any
    row_ids: Any
    values: Any
    keys: Any = None
    defaults: Any = None  # [D, rows_per_device] f32 after `map_ids` with a `Dynamic.default`: gains of ids without a row
    csr: Any = None  # a SparseCore stack's `CsrBatch` (each field `[D, ...]`): the same entries, for the TPU

    @property
    def capacity(self) -> int:
        return self.col_ids.shape[1] // self.shard_starts.shape[1]


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
        )


PAD_ID = 2**31 - 1  # a CSR's embedding and sample ids in its alignment gaps (jax-tpu-embedding's PADDING_VALUE)


class CsrBatch(NamedTuple):
    """A SparseCore stack's input in the CSR format of jax-tpu-embedding's primitives (`host.csr`).

    Every SparseCore's slice, one after the other (device d's S slices together).
    """

    row_pointers: Any  # int32 [num_slices * max(num_sc, 8)]
    embedding_ids: Any  # int32 [num_slices * round_up(max_ids_per_partition, 8) * num_sc]
    sample_ids: Any  # int32, like embedding_ids
    gains: Any  # float32, like embedding_ids
