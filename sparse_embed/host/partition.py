"""One stack's entries, counted per (device, shard) partition and filled into padded COO buffers.

Two implementations with bit-for-bit equal results: numpy (`FlatIds` input)
and the C extension (`CanonicalIds` input, already validated by
`ids.checked`): a counting pass, then a stable counting sort straight into
the outputs. Entries keep their order (features in plan order, samples,
ids) inside a partition, so `row_id`s are nondecreasing in each segment.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from sparse_embed.core.batch import RawIdBatch, ShardedCooMatrix
from sparse_embed.core.planning import FeatureLayout, StackPlan
from sparse_embed.host import gains as gains_lib
from sparse_embed.host import native
from sparse_embed.host.ids import CanonicalIds, FlatIds

Buffers = tuple[np.ndarray, np.ndarray, np.ndarray]  # flat col_ids, row_ids, values


class Partitioned(NamedTuple):
    """A stack's entries, counted per partition d * S + s (d over the `num_devices` devices built here).

    `scatter(cap)` writes them into flat `[num_devices * S * cap]` col_ids,
    row_ids, values: each partition's first `cap` entries in row order, then
    padding. Entries past `cap` are dropped (the caller checks the policy).
    """

    counts: np.ndarray  # [num_devices * S] int64 entries per partition
    max_unique: int  # most unique rows in a partition
    scatter: Callable[[int], Buffers]

    @property
    def needed(self) -> int:
        """Most entries in a partition."""
        return int(self.counts.max())

    @property
    def num_ids(self) -> int:
        return int(self.counts.sum())

    def dropped(self, cap: int) -> int:
        """Entries past `cap` in their partition."""
        return int(np.maximum(self.counts - cap, 0).sum())

    def fill(self, stack: StackPlan, cap: int) -> ShardedCooMatrix | RawIdBatch:
        """The stack's batch (numpy): at most `cap` entries per partition; a `RawIdBatch` for a raw-id stack."""
        S = stack.segments
        D = self.counts.size // S
        col_ids, row_ids, values, *keys = self.scatter(cap)  # keys: raw-id stacks (`raw_ids`)
        shard_starts = np.tile(np.arange(S, dtype=np.int32) * cap, (D, 1))
        ends = shard_starts + np.minimum(self.counts, cap).reshape(D, S).astype(np.int32)
        coo = (shard_starts, ends, col_ids.reshape(D, S * cap), row_ids.reshape(D, S * cap), values.reshape(D, S * cap))
        mark = stack.batch_layout
        return (RawIdBatch(*coo, keys[0].reshape(D, S * cap, 2), layout=mark) if keys else
                ShardedCooMatrix(*coo, layout=mark))


# ------------------------------------------------------------------ numpy
def gains(lay: FeatureLayout, row: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The combiner folded into the weights, per output row (`host.gains`: the C kernel's bits)."""
    f = lay.feature
    return gains_lib.gains(f.table.combiner, weights, row, f.batch_size * max(f.max_sequence_length, 1))


def _stack_entries(stack: StackPlan, flats: dict[str, FlatIds]):
    """All entries of a stack: (partition key d*S+s, col_id, row_id, value), in row order per device."""
    S = stack.segments
    keys, cols, rows, vals = [], [], [], []
    for lay in stack.features:
        f, (ids, weights, samples, positions) = lay.feature, flats[lay.feature.name]
        if f.is_sequence:  # ids past max_sequence_length are truncated
            keep = positions < f.max_sequence_length
            ids, weights, samples, positions = ids[keep], weights[keep], samples[keep], positions[keep]
        out_row = samples * f.max_sequence_length + positions if f.is_sequence else samples
        device, local_row = np.divmod(out_row, lay.rows_per_device)
        stack_row = ids + lay.table_row_offset
        if stack.sparsecores:  # MOD over every SparseCore, the table rotated (`planning`)
            N, C = stack.mod_shards, stack.sparsecores
            p = (stack_row % N + lay.table_rotation) % N
            shard, col = p // C, p % C * stack.sc_rows + stack_row // N
        elif lay.shard is None:  # MOD over S segments ("replicated": S = 1, the device's own)
            shard, col = np.divmod(stack_row, S)[::-1]
        else:  # the table's one shard
            shard, col = lay.shard, stack_row - lay.shard * stack.rows_per_shard
        keys.append(device * S + shard)
        cols.append(col)
        rows.append(lay.out_rows(local_row))
        vals.append(gains(lay, out_row, weights))
    return np.concatenate(keys), np.concatenate(cols), np.concatenate(rows), np.concatenate(vals)


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


def _partition_numpy(stack: StackPlan, flats: dict[str, FlatIds], num_devices: int) -> Partitioned:
    """A stable sort of the entries by partition key."""
    D, S = num_devices, stack.segments
    key, col, row, val = _stack_entries(stack, flats)
    # Small keys sort as uint16: numpy radix-sorts 16-bit keys in O(N), and they are a quarter of int64 bytes.
    order = np.argsort(key.astype(np.uint16) if D * S <= 2**16 else key, kind="stable")
    key, col, row, val = key[order], col[order], row[order], val[order]
    counts = np.bincount(key, minlength=D * S)
    rank = np.arange(key.size) - (np.cumsum(counts) - counts)[key]  # position inside its partition

    def scatter(cap: int) -> Buffers:
        keep = rank < cap
        slot = key[keep] * cap + rank[keep]  # position in the flat [D * S * cap] buffer
        col_ids = np.full(D * S * cap, stack.rows_per_shard, np.int32)
        row_ids = np.full(D * S * cap, stack.partial_rows, np.int32)
        values = np.zeros(D * S * cap, np.float32)
        col_ids[slot], row_ids[slot], values[slot] = col[keep], row[keep], val[keep]
        return col_ids, row_ids, values

    return Partitioned(counts, _max_unique_per_partition(key, col, stack.rows_per_shard, S, D), scatter)


# ------------------------------------------------------------------ C
_COMBINER_CODES = {"sum": 0, "mean": 1, "sqrtn": 2}  # the C extension's codes


def native_feature(stack: StackPlan, lay: FeatureLayout, ids: CanonicalIds, *, raw: bool = False) -> tuple:
    """One feature as `count` / `fill` of the C extension read it (see `parse_features` in _native.c)."""
    f = lay.feature
    offsets = None if ids.dense else np.concatenate(([0], np.cumsum(ids.lengths)))
    batch, width = ids.ids.shape if ids.dense else (ids.lengths.size, 0)
    vocab, offset = (0, 0) if raw else (f.table.vocabulary_size, lay.table_row_offset)  # raw ids: no rows
    return (ids.ids, ids.weights, offsets, batch, width, vocab, offset, lay.partial_row_offset,
            lay.samples_per_device, f.max_sequence_length, _COMBINER_CODES[f.table.combiner],
            -1 if lay.shard is None else lay.shard, stack.sparsecores, stack.sc_rows if stack.sparsecores else 0,
            lay.table_rotation, lay.slice_rows)


def partition_native(stack: StackPlan, flats: dict[str, CanonicalIds], num_devices: int, *,
                     raw: bool = False) -> Partitioned:
    """One counting pass now, a counting sort into the outputs in `scatter`.

    `raw`: a raw-id stack (`raw_ids`): the pass also numbers each entry's id among its partition's distinct
    ids (two scratch arrays), and `scatter` also returns the keys `[D * S * cap, 2]`.
    """
    ext, D, S = native.extension(), num_devices, stack.segments
    feats = [native_feature(stack, lay, flats[lay.feature.name], raw=raw) for lay in stack.features]
    counts = np.empty(D * S, np.int64)
    n_ids = sum(f[0].size for f in feats)
    scratch = (np.empty(n_ids, np.int32), np.empty(n_ids, np.int32)) if raw else ()  # partition, id number
    rows = 0 if raw else S * stack.rows_per_shard  # the stack rows the C layout splits over S shards
    max_unique = ext.count(feats, D, S, rows, counts, *scratch)

    def scatter(cap: int) -> Buffers:
        n = D * S * cap
        out = (np.empty(n, np.int32), np.empty(n, np.int32), np.empty(n, np.float32),
               *((np.empty((n, 2), np.int32),) if raw else ()))
        ext.fill(feats, D, S, rows, cap, stack.partial_rows, *out, *scratch)
        return out

    return Partitioned(counts, max_unique, scatter)


def partition(stack: StackPlan, flats: dict[str, FlatIds | CanonicalIds], num_devices: int) -> Partitioned:
    """Counts a stack's entries per partition: in numpy for `FlatIds`, in C for `CanonicalIds`."""
    if isinstance(flats[stack.features[0].feature.name], FlatIds):
        return _partition_numpy(stack, flats, num_devices)
    return partition_native(stack, flats, num_devices)
