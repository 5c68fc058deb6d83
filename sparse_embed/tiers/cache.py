"""Which table row each cache row holds, and which rows a batch brings in and pushes out (host, numpy).

Replacement is CLOCK (second chance), the usual constant-time stand-in for
LRU: every row a batch uses gets its reference bit; to free a cache row the
hand sweeps on, clearing bits, and takes the first rows whose bit is clear.
A row the current batch uses is never taken. The decisions are a function of
the sequence of batches only, so every run (and every mesh) makes the same.
Which rows are cached never changes a value: only how much is read and
written.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Admission(NamedTuple):
    """What one batch changes in the cache. Rows are table rows; slots are cache rows."""

    misses: np.ndarray  # int64 [m] table rows the batch needs that are not cached (sorted)
    slots: np.ndarray  # int32 [m] the cache row each miss goes to
    evicted: np.ndarray  # int64 [m] the table row each of those cache rows held (-1: none)
    dirty: np.ndarray  # bool [m] whether that evicted row changed since it came in (it is written back)
    hits: int  # ids of the batch (repeats counted) whose row is cached
    cached: int  # distinct rows of the batch found in the cache


class CacheMap:
    """The host's map of one offloaded table's cache: `cache_rows` rows over `vocabulary_size`."""

    def __init__(self, table: str, vocabulary_size: int, cache_rows: int) -> None:
        self.table, self.rows = table, cache_rows
        self.slot_of = np.full(vocabulary_size, -1, np.int32)  # table row -> cache row
        self.row_of = np.full(cache_rows, -1, np.int64)  # cache row -> table row
        self.referenced = np.zeros(cache_rows, bool)
        self.dirty = np.zeros(cache_rows, bool)
        self.hand = 0

    def admit(self, rows: np.ndarray, train: bool) -> Admission:
        """Brings the table rows `rows` (int64, any order, repeats allowed) of one batch into the cache.

        `train`: the batch's step updates them (they become dirty).
        Raises a ValueError naming the table when they are more than the cache holds.
        """
        slots = self.slot_of[rows]
        hit = slots >= 0
        misses = np.unique(rows[~hit])  # the hits need no sort: most of a batch, once the cache is warm
        pinned = np.zeros(self.rows, bool)  # the batch's cached rows: never evicted for its misses
        pinned[slots[hit]] = True
        hits = int(np.count_nonzero(pinned))
        if hits + misses.size > self.rows:
            raise ValueError(f"Table {self.table!r}: a batch reads {hits + misses.size} distinct rows, more than "
                             f"its cache of {self.rows} rows (Offload(cache_rows=...)); give it at least "
                             f"{hits + misses.size} rows, and several batches' worth for a useful hit rate.")
        victims = self._victims(misses.size, pinned)
        evicted = self.row_of[victims]
        dirty = self.dirty[victims] & (evicted >= 0)
        self.slot_of[evicted[evicted >= 0]] = -1
        self.slot_of[misses] = victims
        self.row_of[victims] = misses
        self.referenced |= pinned
        self.referenced[victims] = True
        self.dirty[victims] = train
        if train:
            self.dirty |= pinned
        return Admission(misses, victims.astype(np.int32), evicted, dirty, int(np.count_nonzero(hit)), hits)

    def save(self) -> tuple:
        """What `restore` needs to undo the next `admit` (the reference bits, dirty bits and the hand)."""
        return self.hand, self.referenced.copy(), self.dirty.copy()

    def restore(self, saved: tuple, admission: Admission | None) -> None:
        """Undoes the last `admit` (which returned `admission`, or raised: None), given `save()` from before it."""
        self.hand, self.referenced, self.dirty = saved
        if admission is not None:
            self.slot_of[admission.misses] = -1
            back = admission.evicted >= 0
            self.slot_of[admission.evicted[back]] = admission.slots[back]
            self.row_of[admission.slots] = admission.evicted

    def _victims(self, m: int, keep: np.ndarray) -> np.ndarray:
        """`m` cache rows to reuse, by CLOCK, never one where `keep` (the batch's hits; it marks the victims too)."""
        if m == 0:
            return np.zeros(0, np.int64)
        out, found, swept = [], 0, 0
        while found < m:
            if swept >= 2 * self.rows + m:  # two full turns clear every bit: only pinned rows are left
                raise AssertionError(f"Table {self.table!r}: the cache has no {m} rows to reuse.")
            size = min(self.rows, max(2 * (m - found), 4096))
            window = (self.hand + np.arange(size)) % self.rows
            free = ~self.referenced[window] & ~keep[window]
            take = np.flatnonzero(free)[:m - found]
            end = size if take.size < m - found else int(take[-1]) + 1
            self.referenced[window[:end]] = False
            keep[window[take]] = True  # a later turn of the hand must not take them again
            out.append(window[take])
            found += take.size
            swept += end
            self.hand = int((self.hand + end) % self.rows)
        return np.concatenate(out)

    def map(self, rows: np.ndarray) -> np.ndarray:
        """Cache rows of table rows `rows` (any shape; -1 stays -1). Every row must be cached."""
        return np.where(rows < 0, -1, self.slot_of[np.maximum(rows, 0)])
