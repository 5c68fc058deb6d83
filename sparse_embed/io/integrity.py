"""Checksums of the values a checkpoint stores, so that bit rot never restores silently.

Why our own: orbax 0.12 writes zarr3 with a fixed codec chain whose only
checksum covers the shard index, not the data (a same-size overwrite inside
a zstd block restores wrong values), and its PyTree handler offers no way to
add tensorstore's `crc32c` data codec. So each array's checksum is computed
from its *values* when it is saved, kept in the checkpoint's metadata, and
recomputed from the restored values. That checks the whole path (disk,
decompression, the relayout onto another mesh), and it does not depend on
the mesh, the stacking or the stored padding rows: it covers the first
`rows` rows of the array in id order.

The checksum of `x` (flattened in C order to 32-bit words `w_i`: 1- and
2-byte values widened, 8-byte ones split) is two 32-bit sums, mod 2^32, of
`w_i * m_i` and `(w_i ^ w_i >> 15) * n_i`, with odd position-dependent
multipliers `m_i`, `n_i`: a change to any one word always changes both, and
a random corruption of several words escapes with probability about 2^-64.
Being a sum over positions, it is computed shard by shard (each from its
first word's position; replicas counted once; across processes summed),
in C at memory speed (`host/_native.c`), or in numpy without the extension.

The sums see bits only (float32 1.0 and int32 1065353216 sum alike), so
what a checkpoint saves is the checksum bound to what the values mean,
`"<16 hex digits> <dtype> <shape>"` (`bind`), and a reader binds what it
read the same way before comparing (`matches`).
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any, Iterable

import jax
import numpy as np

from sparse_embed.host.native import extension

ALGORITHM = "oddmul32x2/2"  # /2: bound to dtype and shape (`bind`); /1 saved the digest alone
_K1, _K2, _K3 = 0x9E3779B9, 0x85EBCA77, 0x165667B1
_CHUNK_WORDS = 1 << 24  # numpy fallback: words per step (bounded temporaries)
_PIECE_WORDS = 1 << 26  # words per piece handed to a thread (256 MiB of f32)


def words_per_value(dtype: np.dtype) -> int:
    """32-bit words per value of `dtype` (1- and 2-byte values are widened, 8-byte ones split)."""
    size = np.dtype(dtype).itemsize
    if size not in (1, 2, 4, 8):
        raise TypeError(f"cannot checksum values of dtype {dtype}")
    return 2 if size == 8 else 1


def _numpy_sums(x: np.ndarray, start: int) -> tuple[int, int]:
    """The two sums of a C-contiguous host array whose first word is at position `start` (numpy only)."""
    size = x.dtype.itemsize
    words = x.reshape(-1).view(np.uint32) if size == 8 else x.reshape(-1).view(f"u{size}")
    a = b = 0
    with np.errstate(over="ignore"):
        for lo in range(0, words.size, _CHUNK_WORDS):
            w = words[lo:lo + _CHUNK_WORDS].astype(np.uint32)
            p = (np.arange(w.size, dtype=np.uint64) + np.uint64(start + lo)).astype(np.uint32)
            a += int((w * (p * np.uint32(_K1) | np.uint32(1))).sum(dtype=np.uint64))
            b += int(((w ^ (w >> 15)) * ((p ^ np.uint32(_K3)) * np.uint32(_K2) | np.uint32(1))).sum(dtype=np.uint64))
    return a, b


def partial_sums(x: np.ndarray, start: int) -> tuple[int, int]:
    """The two sums of a host array whose first word is at position `start` (add pieces, then `combine`)."""
    x = np.ascontiguousarray(x)
    native = extension()
    if native is None:
        return _numpy_sums(x, start)
    return native.checksum(x, x.dtype.itemsize, start)


def _pieces(x: Any, rows: int) -> Iterable[tuple[np.ndarray, int]]:
    """(host view, first word's position) of the parts of `x` this process holds once, within `rows` rows."""
    if not isinstance(x, jax.Array):
        a = np.asarray(x)
        a = a.reshape(1) if a.ndim == 0 else a
        yield from _split(a[:rows], 0, int(np.prod(a.shape[1:], dtype=np.int64)) * words_per_value(a.dtype))
        return
    x = x.reshape(1) if x.ndim == 0 else x
    row_words = int(np.prod(x.shape[1:], dtype=np.int64)) * words_per_value(x.dtype)
    for shard in x.addressable_shards:
        if shard.replica_id != 0:
            continue
        lo = shard.index[0].start or 0
        yield from _split(np.asarray(shard.data)[:max(0, rows - lo)], lo * row_words, row_words)


def _split(a: np.ndarray, start: int, row_words: int) -> Iterable[tuple[np.ndarray, int]]:
    """`a` in row blocks of about _PIECE_WORDS words, each with its first word's position (for threads)."""
    step = max(1, _PIECE_WORDS // max(1, row_words))
    for lo in range(0, len(a), step):
        yield a[lo:lo + step], start + lo * row_words


def _row_sharded(x: jax.Array) -> bool:
    """Whether every shard of `x` holds whole rows (then it is checksummed in place, shard by shard)."""
    return all(s == slice(None) or (s.start, s.stop) == (0, n)
               for shard in x.addressable_shards for s, n in zip(shard.index[1:], x.shape[1:]))


def _gather(x: jax.Array) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def combine(sums: Iterable[tuple[int, int]], across_processes: bool) -> str:
    """The checksum of the pieces whose `partial_sums` are given (added over every process if `across_processes`)."""
    a = b = 0
    for sa, sb in sums:
        a, b = a + sa, b + sb
    if across_processes:
        from jax.experimental import multihost_utils

        every = np.asarray(multihost_utils.process_allgather(np.array([a & 0xFFFF, a >> 16 & 0xFFFF, b & 0xFFFF,
                                                                          b >> 16 & 0xFFFF], np.int32)))
        a = int(every[:, 0].sum()) + (int(every[:, 1].sum()) << 16)
        b = int(every[:, 2].sum()) + (int(every[:, 3].sum()) << 16)
    return f"{a & 0xFFFFFFFF:08x}{b & 0xFFFFFFFF:08x}"


def checksum(x: Any, rows: int | None = None) -> str:
    """The checksum (16 hex digits) of a host or (sharded) device array, over its first `rows` rows.

    Under `jax.distributed`, every process must call it for the same global array.
    """
    words_per_value(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)  # a clear TypeError if unsupported
    if isinstance(x, jax.Array) and x.ndim and not _row_sharded(x):  # e.g. columns sharded: on the host, whole
        x = np.asarray(jax.device_get(x)) if x.is_fully_addressable else _gather(x)
    shape = np.shape(x)
    rows = (shape[0] if shape else 1) if rows is None else rows
    pieces = list(_pieces(x, rows))
    across = isinstance(x, jax.Array) and not x.is_fully_addressable and jax.process_count() > 1
    if len(pieces) <= 1:
        return combine([partial_sums(*p) for p in pieces], across)
    with concurrent.futures.ThreadPoolExecutor(min(len(pieces), os.cpu_count() or 1)) as pool:  # C drops the GIL
        return combine(pool.map(lambda p: partial_sums(*p), pieces), across)



def meaning(dtype: Any, shape: Iterable[int]) -> str:
    """`"<dtype> <shape>"`, e.g. `"float32 (40, 16)"`: what a bound checksum says its values are."""
    return f"{np.dtype(dtype).name} {tuple(int(n) for n in shape)}"


def bind(digest: str, dtype: Any, shape: Iterable[int]) -> str:
    """`"<digest> <dtype> <shape>"`: a checksum bound to what its values mean (the form a checkpoint saves)."""
    return f"{digest} {meaning(dtype, shape)}"


def matches(saved: str | None, got: str) -> bool:
    """Whether a bound checksum of values as read is the saved one (checkpoints of `oddmul32x2/1`: the digest)."""
    if not saved:
        return False
    return saved == got if " " in saved else saved == got.split(" ", 1)[0]
