"""Host preprocessing: ids -> static-shape `ShardedCooMatrix` batches, one per stack.

For every device d and destination shard s the batch holds a fixed-capacity
segment of COO entries `(col_id, row_id, value)`: `col_id` is the row inside
shard s, `row_id` the output row on device d, `value` the gain with the
combiner folded in (mean: w/Σw, sqrtn: w/√Σw²; a row whose denominator is 0
gets gains 0, i.e. a zero activation). Entries are ordered by `row_id`
inside a segment. Padding entries have `col_id = rows_per_shard` and
`row_id = rows_per_device` (both out of range, so they never touch a real
row) and value 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple

import jax
import numpy as np

from sparse_embed.inputs import FlatIds, flatten
from sparse_embed.planning import EmbeddingPlan, StackPlan, auto_capacity_for
from sparse_embed.specs import FeatureSpec


class ShardedCooMatrix(NamedTuple):
    """One stack's batch. Leading axis = device (sharded over the plan's axis).

    shard_starts, shard_ends: `[D, S]` int32, entry range of each destination shard's segment.
    col_ids, row_ids: `[D, S * capacity]` int32. values: `[D, S * capacity]` float32.
    """

    shard_starts: Any
    shard_ends: Any
    col_ids: Any
    row_ids: Any
    values: Any

    @property
    def capacity(self) -> int:
        return self.col_ids.shape[1] // self.shard_starts.shape[1]


@dataclasses.dataclass(frozen=True)
class Stats:
    """What preprocessing saw, per stack (so capacities can be sized from real data)."""

    max_ids_per_partition: dict[str, int]
    max_unique_ids_per_partition: dict[str, int]
    dropped_ids: dict[str, int]
    num_ids: dict[str, int]
    capacity: dict[str, int]

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
        )


def _output_rows(feature: FeatureSpec, samples: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Output row of each id: its sample, or (sample, position) for sequence features."""
    if feature.is_sequence:
        return samples * feature.max_sequence_length + positions
    return samples


def _gains(feature: FeatureSpec, row: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Folds the table's combiner into the weights, per output row (ids `[N]`, rows `[N]`)."""
    combiner = feature.table.combiner
    if combiner == "sum":
        return weights
    w = weights.astype(np.float64)
    n_rows = feature.batch_size * max(feature.max_sequence_length, 1)
    if combiner == "mean":
        denom = np.bincount(row, weights=w, minlength=n_rows)[row]
    else:  # sqrtn
        denom = np.sqrt(np.bincount(row, weights=w * w, minlength=n_rows))[row]
    with np.errstate(divide="ignore", invalid="ignore"):
        g = np.where(denom != 0, w / np.where(denom != 0, denom, 1.0), 0.0)
    return g.astype(np.float32)


def _stack_entries(plan: EmbeddingPlan, stack: StackPlan, flats: dict[str, FlatIds]):
    """All entries of a stack: (partition key d*S+s, col_id, row_id, value), in row order per device."""
    S = stack.num_shards
    keys, cols, rows, vals = [], [], [], []
    for lay in stack.features:
        f, (ids, weights, samples, positions) = lay.feature, flats[lay.feature.name]
        if f.is_sequence:  # ids past max_sequence_length are truncated
            keep = positions < f.max_sequence_length
            ids, weights, samples, positions = ids[keep], weights[keep], samples[keep], positions[keep]
        out_row = _output_rows(f, samples, positions)
        device, local_row = np.divmod(out_row, lay.rows_per_device)
        stack_row = ids + lay.table_row_offset
        keys.append(device * S + stack_row % S)
        cols.append(stack_row // S)
        rows.append(lay.row_offset + local_row)
        vals.append(_gains(f, out_row, weights))
    return (np.concatenate(keys), np.concatenate(cols), np.concatenate(rows), np.concatenate(vals))


def _capacity(plan: EmbeddingPlan, stack: StackPlan, needed: int) -> int:
    if stack.capacity is not None:
        return stack.capacity
    current = plan.auto_capacity.get(stack.name, 0)
    if needed > current:
        current = plan.auto_capacity[stack.name] = auto_capacity_for(needed)
    return current


def _overflow_error(stack: StackPlan, counts: np.ndarray, capacity: int) -> ValueError:
    S = stack.num_shards
    p = int(np.argmax(counts))
    feats = [lay.feature.name for lay in stack.features]
    return ValueError(
        f"Stack {stack.name!r} (features {feats}): partition (device {p // S}, shard {p % S}) "
        f"has {int(counts[p])} ids but the capacity is {capacity}. Raise capacity= in plan() "
        f"(or use sparse_embed.grow_capacity(plan, stats)), or pass on_overflow='drop'."
    )


def _build_stack(plan: EmbeddingPlan, stack: StackPlan, flats: dict[str, FlatIds]):
    D = S = stack.num_shards
    key, col, row, val = _stack_entries(plan, stack, flats)
    order = np.argsort(key, kind="stable")
    key, col, row, val = key[order], col[order], row[order], val[order]
    counts = np.bincount(key, minlength=D * S)
    starts = np.cumsum(counts) - counts
    rank = np.arange(key.size) - starts[key]
    uniq = np.unique(key * stack.rows_per_shard + col) // stack.rows_per_shard
    max_unique = int(np.bincount(uniq, minlength=D * S).max()) if uniq.size else 0
    needed = int(counts.max()) if counts.size else 0
    cap = _capacity(plan, stack, max(needed, 1))
    dropped = 0
    if needed > cap:
        if plan.on_overflow == "error":
            raise _overflow_error(stack, counts, cap)
        keep = rank < cap
        dropped = int((~keep).sum())
        key, col, row, val, rank = key[keep], col[keep], row[keep], val[keep], rank[keep]
        counts = np.minimum(counts, cap)

    slot = key * cap + rank  # position in the flat [D * S * cap] buffer
    col_ids = np.full(D * S * cap, stack.rows_per_shard, np.int32)
    row_ids = np.full(D * S * cap, stack.rows_per_device, np.int32)
    values = np.zeros(D * S * cap, np.float32)
    col_ids[slot], row_ids[slot], values[slot] = col, row, val
    shard_starts = np.tile(np.arange(S, dtype=np.int32) * cap, (D, 1))
    coo = ShardedCooMatrix(
        shard_starts,
        shard_starts + counts.reshape(D, S).astype(np.int32),
        col_ids.reshape(D, S * cap),
        row_ids.reshape(D, S * cap),
        values.reshape(D, S * cap),
    )
    return coo, needed, max_unique, dropped, int(key.size) + dropped, cap


def preprocess(
    plan: EmbeddingPlan,
    ids: Mapping[str, Any],
    weights: Mapping[str, Any] | None = None,
    *,
    device_put: bool = True,
) -> tuple[dict[str, ShardedCooMatrix], Stats]:
    """Builds the per-stack `ShardedCooMatrix` batch for one global batch of ids.

    Args:
      plan: the `EmbeddingPlan`.
      ids: feature name -> ids in any format of `sparse_embed.inputs` (1-D,
        dense 2-D with -1 padding, ragged list, or `(values, row_lengths)`).
        Every feature of the plan must be present. The global batch of each
        feature is split evenly over the mesh devices in order.
      weights: feature name -> weights of the same structure (default 1).
      device_put: place the arrays on the plan's mesh (sharded over the
        device axis); False returns numpy arrays.

    Returns:
      `({stack: ShardedCooMatrix}, Stats)`.

    Raises:
      ValueError naming the feature for bad ids/weights/structure/batch size,
      or the stack for a capacity overflow under `on_overflow="error"`.
    """
    features = plan.features
    if not isinstance(ids, Mapping):
        raise TypeError(f"ids must be a mapping feature name -> ids, got {type(ids).__name__}.")
    weights = {} if weights is None else weights
    for what, given in (("ids", ids), ("weights", weights)):
        unknown = sorted(set(given) - set(features))
        if unknown:
            raise ValueError(f"{what} has unknown features {unknown}; the plan's features are {sorted(features)}.")
    missing = sorted(set(features) - set(ids))
    if missing:
        raise ValueError(f"ids is missing features {missing}; every feature of the plan needs ids.")
    flats = {name: flatten(f, ids[name], weights.get(name)) for name, f in features.items()}

    batch, fields = {}, {k: {} for k in ("max_ids", "max_unique", "dropped", "num_ids", "capacity")}
    for stack in plan.stacks:
        coo, *numbers = _build_stack(plan, stack, flats)
        for k, v in zip(fields, numbers):
            fields[k][stack.name] = v
        batch[stack.name] = jax.device_put(coo, plan.batch_sharding()) if device_put else coo
    stats = Stats(fields["max_ids"], fields["max_unique"], fields["dropped"], fields["num_ids"], fields["capacity"])
    return batch, stats
