"""Raw 64-bit ids on the host: check them, pick each id's owner shard, and partition them for `map_ids`.

A raw-id table's entries are partitioned like a static table's (per
device, per destination shard, entries in row order), but the destination
is the id's *owner* shard, `splitmix64(id) % S`, and instead of a row the
entry carries `j`, the index of its id among the distinct ids of its
partition, numbered in entry order; `keys[d, s * cap + j]` holds that id as
two int32 words. Numbering in entry order keeps `j < cap` for every entry
that fits the capacity. Padding entries have `col_id = cap`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sparse_embed.core.planning import StackPlan
from sparse_embed.host.ids import FlatIds, error, flatten
from sparse_embed.host.partition import Partitioned, gains

MAX_ID = 2**63 - 1


def owner_shards(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard that owns each raw id: splitmix64's finalizer mod `num_shards` (int64 `[N]`)."""
    z = np.asarray(ids).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(num_shards)).astype(np.int64)


def split_words(ids: np.ndarray) -> np.ndarray:
    """int64 ids `[N]` -> `[N, 2]` int32 (hi, lo) words, as `map_ids` holds keys."""
    u = np.asarray(ids).astype(np.uint64)
    return np.stack([(u >> np.uint64(32)).astype(np.uint32), (u & np.uint64(0xFFFFFFFF)).astype(np.uint32)],
                    -1).view(np.int32).reshape(-1, 2)


def join_words(words: np.ndarray) -> np.ndarray:
    """`[N, 2]` int32 (hi, lo) words -> int64 ids."""
    w = np.asarray(words).view(np.uint32).astype(np.uint64).reshape(-1, 2)
    return ((w[:, 0] << np.uint64(32)) | w[:, 1]).astype(np.int64)


def _uint64_parts(x: Any) -> list:
    """The integer arrays inside one feature's input (to find uint64 values >= 2**63)."""
    if isinstance(x, tuple):
        return [x[0]]
    if isinstance(x, list):
        return list(x)
    return [x]


def flatten_raw(feature, ids: Any, weights: Any = None) -> FlatIds:
    """`flatten` for a raw-id table: ids are integers in `[0, 2**63)` (dense -1 = padding), as int64."""
    for part in _uint64_parts(ids):
        a = np.asarray(part)
        if a.dtype == np.uint64 and a.size and int(a.max()) > MAX_ID:
            raise error(feature, f"raw id {int(a.max())} is out of range: raw ids must be < 2**63.")
    return flatten(feature, ids, weights, raw=True)


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


def partition_raw(stack: StackPlan, flats: dict[str, FlatIds], num_devices: int) -> Partitioned:
    """A raw-id stack's entries per partition; `scatter(cap)` also returns the keys `[D * S * cap, 2]`."""
    D, S = num_devices, stack.num_shards
    key, ids, row, val = _entries(stack, flats)
    order = np.argsort(key.astype(np.uint16) if D * S <= 2**16 else key, kind="stable")
    key, ids, row, val = key[order], ids[order], row[order], val[order]
    counts = np.bincount(key, minlength=D * S)
    rank = np.arange(key.size) - (np.cumsum(counts) - counts)[key]
    distinct, inverse = np.unique(ids, return_inverse=True)
    pair = key * max(distinct.size, 1) + inverse.reshape(-1)
    _, first, pair_of = np.unique(pair, return_index=True, return_inverse=True)
    by_first = np.argsort(first, kind="stable")  # pairs in entry order: grouped by partition
    pkey = key[first[by_first]]
    pcounts = np.bincount(pkey, minlength=D * S)
    j_sorted = np.arange(pkey.size) - (np.cumsum(pcounts) - pcounts)[pkey]
    j_pair = np.empty_like(j_sorted)
    j_pair[by_first] = j_sorted
    j = j_pair[pair_of.reshape(-1)]
    max_unique = int(pcounts.max()) if pcounts.size else 0

    def scatter(cap: int):
        keep = rank < cap
        slot = key[keep] * cap + rank[keep]
        col_ids = np.full(D * S * cap, cap, np.int32)
        row_ids = np.full(D * S * cap, stack.rows_per_device, np.int32)
        values = np.zeros(D * S * cap, np.float32)
        col_ids[slot], row_ids[slot], values[slot] = j[keep], row[keep], val[keep]
        words = np.full((D * S * cap, 2), -1, np.int32)
        kslot = key[keep] * cap + j[keep]
        words[kslot] = split_words(ids[keep])
        return col_ids, row_ids, values, words

    return Partitioned(counts, max_unique, scatter)
