"""Which table row each cache row holds, and which rows a batch brings in and pushes out (host, numpy).

Replacement is CLOCK (second chance), the usual constant-time stand-in for
LRU: every row a batch uses gets its reference bit; to free a cache row the
hand sweeps on, clearing bits, and takes the first rows whose bit is clear.
A row the current batch uses is never taken. The decisions are a function of
the sequence of batches only, so every run (and every mesh) makes the same.
Which rows are cached never changes a value: only how much is read and
written.

An admission touches only the batch's rows and the rows the hand sweeps (no
pass over the whole cache), and records what it changed, so that `restore`
can undo it when the rest of the batch's preprocessing fails. Its two passes
over every id and over the swept rows run in C (`_clock.c`) where built,
else in numpy, with the same results.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from sparse_embed.host.native import ENV


class Admission(NamedTuple):
    """What one batch changes in the cache. Rows are table rows; slots are cache rows."""

    misses: np.ndarray  # int64 [m] table rows the batch needs that are not cached (sorted)
    slots: np.ndarray  # int32 [m] the cache row each miss goes to
    evicted: np.ndarray  # int64 [m] the table row each of those cache rows held (-1: none)
    dirty: np.ndarray  # bool [m] whether that evicted row changed since it came in (it is written back)
    hits: int  # ids of the batch (repeats counted) whose row is cached
    lookups: int  # ids of the batch (repeats counted; -1 entries not counted)
    mapped: np.ndarray  # int32, the shape of the rows admitted: the cache row of each (-1 stays -1)
    used: np.ndarray  # int32 [u] the cache rows the batch uses (distinct: its cached rows, then the misses')
    undo: tuple  # what `restore` needs


def distinct(a: np.ndarray) -> np.ndarray:
    """`np.unique(a)` of a 1-D array, by a sort (numpy's hash-based unique is ~3x slower for ~10^4 int64)."""
    s = np.sort(a)
    keep = np.empty(s.size, bool)
    keep[:1] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def _extension():
    """The C passes (`_clock.c`), or None: not built, or `SPARSE_EMBED_NATIVE=0` (read at each call)."""
    if os.environ.get(ENV) == "0":
        return None
    try:
        from sparse_embed.tiers import _clock
    except ImportError:
        return None
    return _clock


class CacheMap:
    """The host's map of one offloaded table's cache: `cache_rows` rows over `vocabulary_size`."""

    def __init__(self, table: str, vocabulary_size: int, cache_rows: int) -> None:
        self.table, self.rows = table, cache_rows
        self.slot_of = np.full(vocabulary_size, -1, np.int32)  # table row -> cache row
        self.row_of = np.full(cache_rows, -1, np.int64)  # cache row -> table row
        self.referenced = np.zeros(cache_rows, bool)
        self.dirty = np.zeros(cache_rows, bool)
        self.hand = 0
        self._pinned = np.zeros(cache_rows, bool)  # all False between admissions

    def admit(self, rows: np.ndarray, train: bool) -> Admission:
        """Brings the table rows `rows` (int64, any shape and order, repeats allowed, -1: none) of one batch into
        the cache.

        `train`: the batch's step updates them (they become dirty).
        Raises a ValueError naming the table when they are more than the cache holds (changing nothing).
        """
        rows = np.ascontiguousarray(rows, np.int64)
        flat = rows.reshape(-1)
        ext = _extension()
        pinned = self._pinned  # the batch's cached rows: never evicted for its misses
        try:
            mapped, hits, cached, miss_at = self._lookup(ext, flat)
            wanted = flat[miss_at]
            misses = distinct(wanted)
            if cached.size + misses.size > self.rows:
                need = cached.size + misses.size
                raise ValueError(f"Table {self.table!r}: a batch reads {need} distinct rows, more than its cache of "
                                 f"{self.rows} rows (Offload(cache_rows=...)); give it at least {need} rows, and "
                                 f"several batches' worth for a useful hit rate.")
            undo = (self.hand, cached, self.referenced[cached], self.dirty[cached])
            victims, first_bits = self._victims(ext, misses.size, pinned)
        finally:
            pinned[:] = False
        evicted = self.row_of[victims]
        dirty = self.dirty[victims] & (evicted >= 0)
        undo += (first_bits, victims, self.dirty[victims], evicted)
        self.slot_of[evicted[evicted >= 0]] = -1
        self.slot_of[misses] = victims
        self.row_of[victims] = misses
        self.referenced[cached] = True
        self.referenced[victims] = True
        self.dirty[victims] = train
        if train:
            self.dirty[cached] = True
        mapped[miss_at] = self.slot_of[wanted]
        used = np.concatenate([cached, victims]).astype(np.int32)
        return Admission(misses, victims.astype(np.int32), evicted, dirty, hits, hits + wanted.size,
                         mapped.reshape(rows.shape), used, undo)

    def restore(self, admission: Admission) -> None:
        """Undoes `admission`, the last `admit`'s."""
        hand, cached, referenced, dirty, first_bits, victims, victims_dirty, evicted = admission.undo
        self.referenced[cached] = referenced
        self.referenced[(hand + np.arange(first_bits.size)) % self.rows] = first_bits
        self.dirty[victims] = victims_dirty
        self.dirty[cached] = dirty
        self.hand = hand
        self.slot_of[admission.misses] = -1
        back = evicted >= 0
        self.slot_of[evicted[back]] = victims[back]
        self.row_of[victims] = evicted

    def _lookup(self, ext, flat: np.ndarray) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
        """`(mapped, hits, cached, miss_at)`: the cache row of each of `flat`'s rows (-1: none or a miss), how
        many are cached, the distinct cache rows they use (also marked in `_pinned`), and where the misses are."""
        if ext is not None:
            mapped, cached, miss_at = (np.empty(flat.size, np.int32), np.empty(flat.size, np.int64),
                                       np.empty(flat.size, np.int64))
            hits, c, m = ext.lookup(flat, self.slot_of, self._pinned, mapped, cached, miss_at)
            return mapped, hits, cached[:c], miss_at[:m]
        mapped = self.slot_of[flat]  # a -1 row reads the last table row's entry: set back to -1 below
        miss = mapped < 0
        none = flat < 0
        if none.any():
            mapped[none] = -1
            miss &= ~none
        hits = mapped[mapped >= 0]
        self._pinned[hits] = True
        return mapped, hits.size, np.flatnonzero(self._pinned), np.flatnonzero(miss)

    def _victims(self, ext, m: int, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`m` cache rows to reuse, by CLOCK, never one where `keep` (the batch's hits; it marks the victims too);
        and the reference bits the hand found on its first turn over the rows it swept (from the old hand on)."""
        if m == 0:
            return np.zeros(0, np.int64), np.zeros(0, bool)
        if ext is not None:
            victims, first_bits = np.empty(m, np.int64), np.empty(self.rows, bool)
            self.hand, swept = ext.sweep(self.referenced, keep, self.hand, m, victims, first_bits)
            if swept < 0:
                raise AssertionError(f"Table {self.table!r}: the cache has no {m} rows to reuse.")
            return victims, first_bits[:min(swept, self.rows)].copy()
        out, bits, found, swept = [], [], 0, 0
        while found < m:
            if swept >= 2 * self.rows + m:  # two full turns clear every bit: only pinned rows are left
                raise AssertionError(f"Table {self.table!r}: the cache has no {m} rows to reuse.")
            size = min(self.rows, max(2 * (m - found), 4096))
            window = (self.hand + np.arange(size)) % self.rows
            free = ~self.referenced[window] & ~keep[window]
            take = np.flatnonzero(free)[:m - found]
            end = size if take.size < m - found else int(take[-1]) + 1
            bits.append(self.referenced[window[:end]])
            self.referenced[window[:end]] = False
            keep[window[take]] = True  # a later turn of the hand must not take them again
            out.append(window[take])
            found += take.size
            swept += end
            self.hand = int((self.hand + end) % self.rows)
        return np.concatenate(out), np.concatenate(bits)[:self.rows]

    def map(self, rows: np.ndarray) -> np.ndarray:
        """Cache rows of table rows `rows` (any shape; -1 stays -1). Every row must be cached."""
        return np.where(rows < 0, -1, self.slot_of[np.maximum(rows, 0)])


class ShardedCacheMap:
    """A raw-id table's cache (or a static table's under an explicit capacity, which bounds each shard's
    entries: a row on its in-memory shard overflows alike): one `CacheMap` per shard, so that a row stays on the
    shard its id map (its row number) put it on.

    The id map gives each id a row on the id's owner shard (`core.id_maps`), and the batch sends each id there;
    so table row `t` (shard `t % S`'s row `t // S`) is cached in a cache row `c` with `c % S == t % S` (that
    shard's cache row `c // S`), and the batch's entries keep their shards and their order (only their rows
    change): the step over the cache is the in-memory step's. Shard `s` caches `len(range(s, cache_rows, S))`
    rows of its `len(range(s, vocabulary_size, S))`. The same interface as `CacheMap`, over the whole table.
    """

    def __init__(self, table: str, vocabulary_size: int, cache_rows: int, num_shards: int) -> None:
        if cache_rows < num_shards:
            raise ValueError(f"Table {table!r}: its cache is spread over its {num_shards} shards (raw ids, or an "
                             "explicit capacity); "
                             f"give it at least {num_shards} rows (Offload(cache_rows={cache_rows})).")
        self.table, self.rows, self.num_shards = table, cache_rows, num_shards
        self.shards = [CacheMap(table, len(range(s, vocabulary_size, num_shards)),
                                len(range(s, cache_rows, num_shards))) for s in range(num_shards)]

    def _global(self, local: np.ndarray, s: int) -> np.ndarray:
        return np.where(local >= 0, local * self.num_shards + s, -1)

    def admit(self, rows: np.ndarray, train: bool) -> Admission:
        """`CacheMap.admit` of table rows `rows`, each on its shard's cache (misses by shard, each sorted)."""
        rows = np.ascontiguousarray(rows, np.int64)
        flat, S = rows.reshape(-1), self.num_shards
        owner = np.where(flat >= 0, flat % S, -1)
        mapped, parts = np.full(flat.size, -1, np.int32), []
        try:
            for s, c in enumerate(self.shards):
                at = np.flatnonzero(owner == s)
                try:
                    a = c.admit(flat[at] // S, train)
                except ValueError:
                    need = distinct(flat[at]).size
                    raise ValueError(f"Table {self.table!r}: a batch reads {need} distinct rows on shard {s} of {S}, "
                                     f"more than that shard's {c.rows} cache rows (Offload(cache_rows={self.rows}) "
                                     f"is spread over the shards as the table's rows are); give it at least "
                                     f"{need * S} rows, and several batches' worth for a useful hit rate.") from None
                mapped[at] = self._global(a.mapped, s)
                parts.append(a)
        except BaseException:
            for s, a in reversed(list(enumerate(parts))):
                self.shards[s].restore(a)
            raise
        cat = lambda f: np.concatenate([self._global(getattr(a, f), s) for s, a in enumerate(parts)])  # noqa: E731
        return Admission(cat("misses"), cat("slots").astype(np.int32), cat("evicted"),
                         np.concatenate([a.dirty for a in parts]), sum(a.hits for a in parts),
                         sum(a.lookups for a in parts), mapped.reshape(rows.shape),
                         cat("used").astype(np.int32), tuple(parts))

    def restore(self, admission: Admission) -> None:
        """Undoes `admission`, the last `admit`'s."""
        for c, a in zip(self.shards, admission.undo):
            c.restore(a)

    def map(self, rows: np.ndarray) -> np.ndarray:
        """Cache rows of table rows `rows` (any shape; -1 stays -1). Every row must be cached."""
        rows = np.asarray(rows, np.int64)
        out = np.full(rows.shape, -1, np.int64)
        for s, c in enumerate(self.shards):
            at = (rows >= 0) & (rows % self.num_shards == s)
            out[at] = self._global(c.map(rows[at] // self.num_shards), s)
        return out

    @property
    def dirty(self) -> np.ndarray:
        """bool `[cache_rows]` (a copy; assign to change)."""
        out = np.zeros(self.rows, bool)
        for s, c in enumerate(self.shards):
            out[s::self.num_shards] = c.dirty
        return out

    @dirty.setter
    def dirty(self, value: np.ndarray) -> None:
        for s, c in enumerate(self.shards):
            c.dirty[:] = value[s::self.num_shards]
