"""Raw 64-bit ids as keys: their two int32 words, and the hash that picks the shard that owns each id.

The one definition of both, below everything that uses them: `key_set`
and `id_maps` hold keys on the device as `(hi, lo)` words, `host.raw_ids`
partitions a batch's ids by `owner_shards`, and `io` stores keys as words
in checkpoints. `host/_native.c` computes `splitmix64` again in C (the
preprocess's speed path, with these constants); tests check it against
this one.

Numpy, on the host: ids are int64 in `[0, 2**63)`.
"""

from __future__ import annotations

import numpy as np

# splitmix64's output mix, its finalizer (Steele, Lea & Flood 2014), alone: no golden-ratio increment first.
# z ^= z >> 30; z *= M1; z ^= z >> 27; z *= M2; z ^= z >> 31 (mod 2**64). docs/raw_ids.md writes it out for users.
SPLITMIX64_SHIFTS = (30, 27, 31)
SPLITMIX64_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def splitmix64(ids: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer of each id (without the increment most libraries add first): uint64 `[N]`."""
    (s1, s2, s3), (m1, m2) = SPLITMIX64_SHIFTS, SPLITMIX64_MULTIPLIERS
    z = np.asarray(ids).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(s1))) * np.uint64(m1)
        z = (z ^ (z >> np.uint64(s2))) * np.uint64(m2)
        return z ^ (z >> np.uint64(s3))


def owner_shards(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard that owns each raw id: `splitmix64(id) % num_shards`, int64 `[N]`."""
    return (splitmix64(ids) % np.uint64(num_shards)).astype(np.int64)


def split_words(ids: np.ndarray) -> np.ndarray:
    """int64 ids `[N]` -> `[N, 2]` int32 (hi, lo) words, as `key_set` holds keys."""
    u = np.asarray(ids).astype(np.uint64)
    return np.stack([(u >> np.uint64(32)).astype(np.uint32), (u & np.uint64(0xFFFFFFFF)).astype(np.uint32)],
                    -1).view(np.int32).reshape(-1, 2)


def join_words(words: np.ndarray) -> np.ndarray:
    """`[N, 2]` int32 (hi, lo) words -> int64 ids `[N]` (the inverse of `split_words`)."""
    w = np.asarray(words).view(np.uint32).astype(np.uint64).reshape(-1, 2)
    return ((w[:, 0] << np.uint64(32)) | w[:, 1]).astype(np.int64)
