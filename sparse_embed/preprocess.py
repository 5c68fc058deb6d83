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
from typing import Any, Callable, Mapping, NamedTuple

import jax
import numpy as np

from sparse_embed import distributed as _dist
from sparse_embed import inputs as _inputs
from sparse_embed.inputs import CanonicalIds, FlatIds, flatten
from sparse_embed.planning import EmbeddingPlan, FeatureLayout, StackPlan, auto_capacity_for
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


def _stack_entries(stack: StackPlan, flats: dict[str, FlatIds]):
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


def _overflow_error(stack: StackPlan, counts: np.ndarray, capacity: int, positions=None) -> ValueError:
    S = stack.num_shards
    p = int(np.argmax(counts))
    device = p // S if positions is None else positions[p // S]
    feats = [lay.feature.name for lay in stack.features]
    return ValueError(
        f"Stack {stack.name!r} (features {feats}): partition (device {device}, shard {p % S}) "
        f"has {int(counts[p])} ids but the capacity is {capacity}. Raise capacity= in plan() "
        f"(or use sparse_embed.grow_capacity(plan, stats)), or pass on_overflow='drop'."
    )


_Buffers = tuple[np.ndarray, np.ndarray, np.ndarray]  # flat col_ids, row_ids, values


class _Partitioned(NamedTuple):
    """A stack's entries, counted per partition d * S + s (d over the `num_devices` devices built here).

    `scatter(cap)` writes them into flat `[num_devices * S * cap]` col_ids,
    row_ids, values: each partition's first `cap` entries in row order, then
    padding. Entries past `cap` are dropped (the caller checks the policy).
    """

    counts: np.ndarray  # [num_devices * S] int64 entries per partition
    max_unique: int  # most unique rows in a partition
    scatter: Callable[[int], _Buffers]

    @property
    def needed(self) -> int:
        """Most entries in a partition."""
        return int(self.counts.max())

    @property
    def num_ids(self) -> int:
        return int(self.counts.sum())


def _max_unique_per_partition(key: np.ndarray, col: np.ndarray, rows_per_shard: int, num_shards: int,
                              num_devices: int) -> int:
    """Most distinct cols in one (device, shard) partition, in O(N) without a sort.

    Per source device: every entry writes its index into a scratch slot of
    its (shard, col) and reads it back; an entry that reads its own index
    represents its (shard, col) (numpy keeps the last of repeated writes).
    `key` is `device * num_shards + shard`, entries grouped by key.
    """
    if key.size == 0:
        return 0
    scratch = np.empty(num_shards * rows_per_shard, np.int32)  # only the touched pages get mapped
    device, shard = np.divmod(key, num_shards)
    bounds = np.searchsorted(device, np.arange(num_devices + 1))
    best = 0
    for d in range(num_devices):
        lo, hi = bounds[d], bounds[d + 1]
        if lo == hi:
            continue
        slot = shard[lo:hi] * rows_per_shard + col[lo:hi]
        index = np.arange(hi - lo, dtype=np.int32)
        scratch[slot] = index
        first = scratch[slot] == index
        best = max(best, int(np.bincount(shard[lo:hi][first], minlength=num_shards).max()))
    return best


def _partition_numpy(stack: StackPlan, flats: dict[str, FlatIds], num_devices: int) -> _Partitioned:
    """`_partition` in numpy: a stable sort of the entries by partition key."""
    D, S = num_devices, stack.num_shards
    key, col, row, val = _stack_entries(stack, flats)
    # Small keys sort as uint16 (numpy's O(N) radix sort), ~6x faster than int64.
    order = np.argsort(key.astype(np.uint16) if D * S <= 2**16 else key, kind="stable")
    key, col, row, val = key[order], col[order], row[order], val[order]
    counts = np.bincount(key, minlength=D * S)
    rank = np.arange(key.size) - (np.cumsum(counts) - counts)[key]  # position inside its partition

    def scatter(cap: int) -> _Buffers:
        keep = rank < cap
        slot = key[keep] * cap + rank[keep]  # position in the flat [D * S * cap] buffer
        col_ids = np.full(D * S * cap, stack.rows_per_shard, np.int32)
        row_ids = np.full(D * S * cap, stack.rows_per_device, np.int32)
        values = np.zeros(D * S * cap, np.float32)
        col_ids[slot], row_ids[slot], values[slot] = col[keep], row[keep], val[keep]
        return col_ids, row_ids, values

    return _Partitioned(counts, _max_unique_per_partition(key, col, stack.rows_per_shard, S, D), scatter)


_COMBINERS = {"sum": 0, "mean": 1, "sqrtn": 2}  # the C extension's codes


def _native_feature(lay: FeatureLayout, ids: CanonicalIds) -> tuple:
    """One feature as `_native.count` / `_native.fill` read it (see `parse_features` in _native.c)."""
    f = lay.feature
    offsets = None if ids.dense else np.concatenate(([0], np.cumsum(ids.lengths)))
    batch, width = ids.ids.shape if ids.dense else (ids.lengths.size, 0)
    return (ids.ids, ids.weights, offsets, batch, width, f.table.vocabulary_size, lay.table_row_offset,
            lay.row_offset, lay.samples_per_device, f.max_sequence_length, _COMBINERS[f.table.combiner])


def _partition_native(stack: StackPlan, flats: dict[str, CanonicalIds], num_devices: int) -> _Partitioned:
    """`_partition` in C: one counting pass now, a counting sort into the outputs in `scatter`."""
    native, D, S = _inputs._native, num_devices, stack.num_shards
    feats = [_native_feature(lay, flats[lay.feature.name]) for lay in stack.features]
    counts = np.empty(D * S, np.int64)
    max_unique = native.count(feats, D, S, stack.total_rows, counts)

    def scatter(cap: int) -> _Buffers:
        out = np.empty(D * S * cap, np.int32), np.empty(D * S * cap, np.int32), np.empty(D * S * cap, np.float32)
        native.fill(feats, D, S, stack.total_rows, cap, stack.rows_per_device, *out)
        return out

    return _Partitioned(counts, max_unique, scatter)


def _partition(stack: StackPlan, flats: dict[str, FlatIds | CanonicalIds], num_devices: int) -> _Partitioned:
    """Counts a stack's entries per partition: in numpy for `flatten`'s output, else in C."""
    if isinstance(flats[stack.features[0].feature.name], FlatIds):
        return _partition_numpy(stack, flats, num_devices)
    return _partition_native(stack, flats, num_devices)


def _dropped(part: _Partitioned, cap: int) -> int:
    return int(np.maximum(part.counts - cap, 0).sum())


def _fill(stack: StackPlan, part: _Partitioned, cap: int) -> ShardedCooMatrix:
    """The stack's batch: at most `cap` entries per partition (the caller has checked the policy)."""
    S = stack.num_shards
    D = part.counts.size // S
    col_ids, row_ids, values = part.scatter(cap)
    shard_starts = np.tile(np.arange(S, dtype=np.int32) * cap, (D, 1))
    return ShardedCooMatrix(
        shard_starts,
        shard_starts + np.minimum(part.counts, cap).reshape(D, S).astype(np.int32),
        col_ids.reshape(D, S * cap),
        row_ids.reshape(D, S * cap),
        values.reshape(D, S * cap),
    )


def _build_stack(plan: EmbeddingPlan, stack: StackPlan, flats: dict[str, FlatIds | CanonicalIds]):
    part = _partition(stack, flats, stack.num_shards)
    cap = _capacity(plan, stack, max(part.needed, 1))
    if part.needed > cap and plan.on_overflow == "error":
        raise _overflow_error(stack, part.counts, cap)
    return _fill(stack, part, cap), part.needed, part.max_unique, _dropped(part, cap), part.num_ids, cap


def _check_keys(plan: EmbeddingPlan, ids, weights) -> dict:
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
    return weights


def _flatten_one() -> Callable[..., FlatIds | CanonicalIds]:
    """How to validate one feature's ids: in C if the extension is there (then `_partition` runs in C), else numpy."""
    return flatten if _inputs._native is None else _inputs.checked


def _flatten_all(plan: EmbeddingPlan, ids, weights) -> dict[str, FlatIds | CanonicalIds]:
    weights, flat = _check_keys(plan, ids, weights), _flatten_one()
    return {name: flat(f, ids[name], weights.get(name)) for name, f in plan.features.items()}


def _num_samples(x: Any) -> int | None:
    """Samples in one feature's ids (any accepted format), or None if that cannot be told."""
    try:
        if isinstance(x, tuple):
            return len(x[1]) if len(x) == 2 else None
        if isinstance(x, list):
            return len(x)
        return int(np.shape(x)[0])
    except Exception:  # noqa: BLE001 - malformed input: flatten() reports it
        return None


def _flatten_local(plan: EmbeddingPlan, ids, weights, num_local: int) -> dict[str, FlatIds | CanonicalIds]:
    """`_flatten_all` for this process's rows: `num_local` of the plan's devices' share of each batch."""
    weights, flat = _check_keys(plan, ids, weights), _flatten_one()
    flats = {}
    for name, f in plan.features.items():
        local_batch = f.batch_size // plan.num_shards * num_local
        n = _num_samples(ids[name])
        if n is not None and n != local_batch:
            raise ValueError(
                f"Feature {name!r} (table {f.table.name!r}): got {n} samples, but this process (process "
                f"{jax.process_index()} of {jax.process_count()}) must pass {local_batch}: the plan's mesh spans "
                f"several processes, so each process passes only its own rows, {f.batch_size // plan.num_shards} "
                f"samples for each of its {num_local} of the {plan.num_shards} devices (the global batch_size "
                f"is {f.batch_size})."
            )
        flats[name] = flat(dataclasses.replace(f, batch_size=local_batch), ids[name], weights.get(name))
    return flats


_FIELDS = 4  # numbers per stack exchanged between processes: needed, max_unique, num_ids, dropped


def _preprocess_processes(plan: EmbeddingPlan, ids, weights, device_put: bool):
    """`preprocess` when the plan's mesh spans several processes (see its docstring)."""
    processes = _dist.mesh_processes(plan.mesh)
    positions = _dist.local_positions(plan)
    me = jax.process_index()
    error, parts = None, {}
    try:
        flats = _flatten_local(plan, ids, weights, len(positions))
        parts = {s.name: _partition(s, flats, len(positions)) for s in plan.stacks}
    except Exception as e:  # noqa: BLE001 - every process must still take part in the exchange
        error = e
    mine = [int(error is not None)]
    for s in plan.stacks:
        p = parts.get(s.name)
        if p is None:
            mine += [0] * _FIELDS
            continue
        # An explicit capacity is known up front, so each process can count its own drops.
        dropped = _dropped(p, s.capacity) if s.capacity is not None else 0
        mine += [p.needed, p.max_unique, p.num_ids, dropped]
    table = _dist.allgather_ints(processes, mine)
    if error is not None:
        raise error
    failed = [processes[i] for i in np.flatnonzero(table[:, 0])]
    if failed:
        raise ValueError(f"preprocess failed on process(es) {failed} (see their error); this process ({me}) "
                         "raises too, so that no process runs a step the others skip.")

    batch, fields = {}, {k: {} for k in ("max_ids", "max_unique", "dropped", "num_ids", "capacity")}
    for i, s in enumerate(plan.stacks):
        col = table[:, 1 + _FIELDS * i: 1 + _FIELDS * (i + 1)]
        needed, max_unique = int(col[:, 0].max()), int(col[:, 1].max())
        num_ids, dropped = int(col[:, 2].sum()), int(col[:, 3].sum())
        part = parts[s.name]
        cap = _capacity(plan, s, max(needed, 1))  # the same on every process: same high-water mark
        if needed > cap:
            if plan.on_overflow == "error":
                if part.needed == needed:
                    raise _overflow_error(s, part.counts, cap, positions)
                worst = processes[int(np.argmax(col[:, 0]))]
                feats = [lay.feature.name for lay in s.features]
                raise ValueError(
                    f"Stack {s.name!r} (features {feats}): a partition on process {worst} has {needed} ids but "
                    f"the capacity is {cap}. Raise capacity= in plan() (or use sparse_embed.grow_capacity(plan, "
                    f"stats)), or pass on_overflow='drop'."
                )
        coo = _fill(s, part, cap)  # the drops were counted (by every process) before the exchange
        if device_put:
            sharding = plan.batch_sharding()
            coo = ShardedCooMatrix(*(
                jax.make_array_from_process_local_data(sharding, x, (plan.num_shards, *x.shape[1:])) for x in coo
            ))
        batch[s.name] = coo
        for k, v in zip(fields, (needed, max_unique, dropped, num_ids, cap)):
            fields[k][s.name] = v
    stats = Stats(fields["max_ids"], fields["max_unique"], fields["dropped"], fields["num_ids"], fields["capacity"])
    return batch, stats


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

    Multi-process (the plan's mesh has devices of several processes, under
    `jax.distributed`): every process calls `preprocess` with only its own
    rows of each feature: the samples of its devices' positions along the
    plan's axis, in mesh order (`sparse_embed.distributed.process_rows`), so
    `batch_size * local_devices / num_devices` samples per feature. It gets
    global arrays (`jax.make_array_from_process_local_data`) ready for the
    jitted step, or with `device_put=False` numpy arrays for its local
    devices only. The processes agree on every decision (auto capacity
    growth, overflow errors, bad input on any process raises on all of
    them), and the returned `Stats` are global (maxima and sums over all
    processes). Every process must call it the same number of times, in the
    same order.

    Raises:
      ValueError naming the feature for bad ids/weights/structure/batch size,
      or the stack for a capacity overflow under `on_overflow="error"`.
    """
    if _dist.spans_processes(plan):
        return _preprocess_processes(plan, ids, weights, device_put)
    flats = _flatten_all(plan, ids, weights)

    batch, fields = {}, {k: {} for k in ("max_ids", "max_unique", "dropped", "num_ids", "capacity")}
    for stack in plan.stacks:
        coo, *numbers = _build_stack(plan, stack, flats)
        for k, v in zip(fields, numbers):
            fields[k][stack.name] = v
        batch[stack.name] = jax.device_put(coo, plan.batch_sharding()) if device_put else coo
    stats = Stats(fields["max_ids"], fields["max_unique"], fields["dropped"], fields["num_ids"], fields["capacity"])
    return batch, stats
