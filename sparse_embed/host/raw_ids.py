"""Raw 64-bit ids on the host: check them, pick each id's owner shard, and partition them for `map_ids`.

A raw-id table's entries are partitioned like a static table's (per
device, per destination shard, entries in row order), but the destination
is the id's *owner* shard, splitmix64's finalizer of the id mod S, without
the usual increment (`core.raw_keys.owner_shards`, where the key format
lives too), and instead of a row the entry carries `j`, the index of its id
among the distinct ids of its partition (those that fit the capacity),
numbered by first occurrence; `keys[d, s * cap + j]` holds that id as two
int32 words, so `j < cap`. Padding entries have `col_id = cap`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sparse_embed.core.planning import StackPlan
from sparse_embed.core.raw_keys import owner_shards, split_words
from sparse_embed.host.ids import CanonicalIds, FlatIds, canonical, error, flattened, validated
from sparse_embed.host.partition import Partitioned, gains, partition_native


def _within_id_bits(feature, c: CanonicalIds) -> CanonicalIds:
    """Every id below `2**id_bits` if the table declares it (a pass over the ids only then).

    Runs on what `canonical` read (which already rejects uint64 ids >= 2**63), so every input format and
    every malformed one get `canonical`'s checks first; negative ids: `validated`'s or `flattened`'s errors.
    """
    bits = feature.table.dynamic.id_bits
    if bits is not None and c.ids.size and int(c.ids.max()) >= 2**bits:
        raise error(feature, f"raw id {int(c.ids.max())} is out of range: the table's ids must be < 2**{bits} "
                             f"(Dynamic(id_bits={bits})).")
    return c


def flatten_raw(feature, ids: Any, weights: Any = None) -> FlatIds:
    """`flatten` for a raw-id table: ids are integers in `[0, 2**63)` (dense -1 = padding), as int64."""
    return flattened(feature, _within_id_bits(feature, canonical(feature, ids, weights)), raw=True)


def checked_raw(feature, ids: Any, weights: Any = None) -> CanonicalIds:
    """`flatten_raw`'s checks in C, without flattening (the input of `partition_raw`'s C path)."""
    return validated(feature, _within_id_bits(feature, canonical(feature, ids, weights)), raw=True)


def _entries(stack: StackPlan, flats: dict[str, FlatIds]):
    """All entries of a raw-id stack: (partition d*S+s, id, row_id, value), in row order per device."""
    S = stack.num_shards
    keys, ids, rows, vals = [], [], [], []
    for lay in stack.features:
        f, (fid, weights, samples, positions) = lay.feature, flats[lay.feature.name]
        if f.is_sequence:
            keep = positions < f.max_sequence_length
            fid, weights, samples, positions = fid[keep], weights[keep], samples[keep], positions[keep]
        out_row = samples * f.max_sequence_length + positions if f.is_sequence else samples
        device, local_row = np.divmod(out_row, lay.rows_per_device)
        keys.append(device * S + owner_shards(fid, S))
        ids.append(fid)
        rows.append(lay.row_offset + local_row)
        vals.append(gains(lay, out_row, weights))
    return np.concatenate(keys), np.concatenate(ids), np.concatenate(rows), np.concatenate(vals)


def _numbered(key: np.ndarray, ids: np.ndarray, num_partitions: int):
    """Each entry's `j`: the rank of its id among the distinct ids of its partition, by first occurrence.

    Entries come grouped by partition (in row order inside each). Returns
    `(j [N], first [N] bool: the entry that writes its id's key, max distinct per partition)`.
    """
    o = np.argsort(ids, kind="stable")
    o = o[np.argsort(key[o].astype(np.uint16) if num_partitions <= 2**16 else key[o], kind="stable")]
    sk, si = key[o], ids[o]
    first = np.ones(sk.size, bool)
    first[1:] = (sk[1:] != sk[:-1]) | (si[1:] != si[:-1])
    starts = o[first]  # each distinct (partition, id)'s first entry
    by_entry = np.argsort(starts, kind="stable")  # partition-major, as entries are
    pk = sk[first][by_entry]
    distinct = np.bincount(pk, minlength=num_partitions)
    rank = np.empty(starts.size, np.int64)
    rank[by_entry] = np.arange(starts.size) - (np.cumsum(distinct) - distinct)[pk]
    j = np.empty(sk.size, np.int64)
    j[o] = rank[np.cumsum(first) - 1]
    is_first = np.zeros(sk.size, bool)
    is_first[starts] = True
    return j, is_first, int(distinct.max()) if distinct.size else 0


def partition_raw(stack: StackPlan, flats: dict[str, FlatIds | CanonicalIds], num_devices: int) -> Partitioned:
    """`partition_numpy_raw` for `FlatIds`, the C extension's for `CanonicalIds` (bit for bit the same)."""
    if isinstance(flats[stack.features[0].feature.name], CanonicalIds):
        return partition_native(stack, flats, num_devices, raw=True)
    return partition_numpy_raw(stack, flats, num_devices)


def partition_numpy_raw(stack: StackPlan, flats: dict[str, FlatIds], num_devices: int) -> Partitioned:
    """A raw-id stack's entries per partition; `scatter(cap)` also returns the keys `[D * S * cap, 2]`.

    A partition's keys are its distinct ids in order of first occurrence
    (then unused slots), numbered among the entries that fit `cap`.
    """
    D, S = num_devices, stack.num_shards
    key, ids, row, val = _entries(stack, flats)
    order = np.argsort(key.astype(np.uint16) if D * S <= 2**16 else key, kind="stable")
    key, ids, row, val = key[order], ids[order], row[order], val[order]
    counts = np.bincount(key, minlength=D * S)
    rank = np.arange(key.size) - (np.cumsum(counts) - counts)[key]
    numbered = _numbered(key, ids, D * S)

    def scatter(cap: int):
        keep = rank < cap
        j, first, _ = numbered if keep.all() else _numbered(key[keep], ids[keep], D * S)
        k = key[keep]
        slot = k * cap + rank[keep]
        col_ids = np.full(D * S * cap, cap, np.int32)
        row_ids = np.full(D * S * cap, stack.rows_per_device, np.int32)
        values = np.zeros(D * S * cap, np.float32)
        col_ids[slot], row_ids[slot], values[slot] = j, row[keep], val[keep]
        words = np.full((D * S * cap, 2), -1, np.int32)
        words[k[first] * cap + j[first]] = split_words(ids[keep][first])
        return col_ids, row_ids, values, words

    return Partitioned(counts, numbered[2], scatter)
