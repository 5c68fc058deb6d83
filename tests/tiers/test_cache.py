"""`CacheMap` (CLOCK over an offloaded table's cache rows) against a plain-Python CLOCK, one row at a time:
the same misses, cache rows, evictions, dirty bits and per-id cache rows; `restore` undoes an admission. On
the numpy path and on the C passes alike."""

from __future__ import annotations

import numpy as np
import pytest

from sparse_embed.host.native import ENV
from sparse_embed.tiers.cache import CacheMap, _extension, distinct

PATHS = ["numpy", pytest.param("C", marks=pytest.mark.skipif(_extension() is None, reason="_clock.c not built"))]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Each test on the numpy path and on the C passes (`_clock.c`)."""
    if request.param == "numpy":
        monkeypatch.setenv(ENV, "0")
    else:
        monkeypatch.delenv(ENV, raising=False)
    return request.param


class ReferenceClock:
    """CLOCK as a textbook states it: the hand visits one cache row at a time."""

    def __init__(self, cache_rows: int) -> None:
        self.n, self.slot_of, self.row_of = cache_rows, {}, [-1] * cache_rows
        self.referenced, self.dirty, self.hand = [False] * cache_rows, [False] * cache_rows, 0

    def admit(self, rows: list[int], train: bool) -> tuple:
        valid = [r for r in rows if r >= 0]
        cached = {self.slot_of[r] for r in valid if r in self.slot_of}
        misses = sorted({r for r in valid if r not in self.slot_of})
        victims: list[int] = []
        for _ in misses:
            while True:
                p, self.hand = self.hand, (self.hand + 1) % self.n
                if p in cached or p in victims:
                    continue
                if self.referenced[p]:
                    self.referenced[p] = False
                    continue
                victims.append(p)
                break
        evicted = [self.row_of[v] for v in victims]
        dirty = [self.dirty[v] and e >= 0 for v, e in zip(victims, evicted)]
        for r, v, e in zip(misses, victims, evicted):
            self.slot_of.pop(e, None)
            self.slot_of[r], self.row_of[v] = v, r
        for p in list(cached) + victims:
            self.referenced[p] = True
            self.dirty[p] = train or (p in cached and self.dirty[p])
        mapped = [self.slot_of[r] if r >= 0 else -1 for r in rows]
        hits = sum(1 for r in valid if self.slot_of[r] in cached)
        return misses, victims, evicted, dirty, hits, len(valid), mapped, sorted(cached) + victims  # used


def _state(c: CacheMap) -> tuple:
    return c.slot_of.copy(), c.row_of.copy(), c.referenced.copy(), c.dirty.copy(), c.hand


@pytest.mark.parametrize("cache_rows", [40, 150])
def test_admissions_equal_a_plain_clock(cache_rows, path):
    rng = np.random.default_rng(cache_rows)
    vocab = 1000
    c, ref = CacheMap("t", vocab, cache_rows), ReferenceClock(cache_rows)
    written_back = 0
    for step in range(60):
        rows = np.minimum(rng.zipf(1.2, size=(6, 5)) - 1, vocab - 1) * 7 % vocab  # skewed, with repeats
        rows[rng.random(rows.shape) < 0.2] = -1  # a dense feature's empty places
        train = step % 4 != 3
        if step % 5 == 2:  # an admission undone (its batch failed later) changes nothing
            before = _state(c)
            c.restore(c.admit(rows, not train))
            for x, y in zip(before, _state(c)):
                np.testing.assert_array_equal(x, y)
        a = c.admit(rows, train)
        misses, victims, evicted, dirty, hits, lookups, mapped, used = ref.admit(rows.reshape(-1).tolist(), train)
        np.testing.assert_array_equal(a.misses, misses)
        np.testing.assert_array_equal(a.slots, victims)
        np.testing.assert_array_equal(a.evicted, evicted)
        np.testing.assert_array_equal(a.dirty, dirty)
        np.testing.assert_array_equal(a.mapped, np.reshape(mapped, rows.shape))
        np.testing.assert_array_equal(np.sort(a.used[:a.used.size - a.slots.size]), used[:len(used) - len(victims)])
        np.testing.assert_array_equal(a.used[a.used.size - a.slots.size:], victims)
        assert (a.hits, a.lookups) == (hits, lookups) and a.mapped.dtype == np.int32
        np.testing.assert_array_equal(c.referenced, ref.referenced)
        np.testing.assert_array_equal(c.dirty, ref.dirty)
        assert c.hand == ref.hand
        written_back += int(a.dirty.sum())
    assert 0 < a.hits < a.lookups and written_back > 0  # the cache churned


def test_a_batch_larger_than_the_cache_changes_nothing(path):
    c = CacheMap("items", 100, 8)
    c.admit(np.arange(6), True)
    before = _state(c)
    with pytest.raises(ValueError, match=r"Table 'items': a batch reads 10 distinct rows, more than its cache of 8"):
        c.admit(np.array([[0, 1, 50, 51], [52, 53, 54, 55], [56, 57, -1, -1]]), True)
    for x, y in zip(before, _state(c)):
        np.testing.assert_array_equal(x, y)
    assert not c._pinned.any()


def test_distinct_is_np_unique():
    a = np.random.default_rng(0).integers(0, 50, 300)
    np.testing.assert_array_equal(distinct(a), np.unique(a))
    assert distinct(np.zeros(0, np.int64)).size == 0


@pytest.mark.skipif(_extension() is None, reason="_clock.c not built")
def test_c_passes_refuse_rows_outside_the_map(monkeypatch):
    """The C pass checks every row against the map (ids are validated before, but no input may read out of
    bounds), and the buffers' types."""
    monkeypatch.delenv(ENV, raising=False)
    c = CacheMap("t", 10, 4)
    with pytest.raises(IndexError, match=r"row 10 \(entry 1\) outside the table"):
        c.admit(np.array([3, 10]), True)
    assert not c._pinned.any()
    n = 3
    with pytest.raises(TypeError, match="rows: unexpected buffer format"):
        _extension().lookup(np.zeros(n, np.int32), c.slot_of, c._pinned, np.empty(n, np.int32),
                            np.empty(n, np.int64), np.empty(n, np.int64))
