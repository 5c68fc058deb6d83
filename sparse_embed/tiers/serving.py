"""Serving lookups from offloaded tables' stores: a bounded RAM cache of rows over each store on disk (host, numpy).

The serving side of issue 42's "hierarchical parameter server": a model's
tables stay in the stores a training run writes (`tiers.store`), a RAM cache
holds the hot rows, and the rest are read from disk a row at a time.

- `StoreServer(path, cache_bytes=...)`: one store, opened read-only
  (`StoreReader`). `lookup(ids)` returns the rows' embeddings `[n, dim]`
  float32 (the embedding columns only, not the optimizer slots).
- `load_parameter_server(config)`: the stores a JSON config file names, by
  model and table; `ParameterServer.lookup(model, table, ids)`.

What a lookup returns, per id:

- `-1` (padding): zeros;
- a row the store has written as of its last commit: the row's newest
  record (a training run appends evicted rows to the store's write log
  between commits, which `StoreReader` follows: this may be newer than
  the commit);
- a row the store never wrote ("not found"): the table's default vector
  (zeros, or the configured value or `[dim]` vector). A row never trained
  still holds its initializer's values on the training side (they are
  generated there, not stored), so a server reads the default for it, as
  HugeCTR's HPS serves its default vector for keys it does not hold;
- an id outside `[0, vocabulary_size)`: a ValueError naming the table.

The cache: `cache_bytes` buys `cache_bytes // (4 * dim + 9)` rows (values,
the row each holds, a reference bit); CLOCK replacement (second chance), all
of a batch at once in numpy. The row -> cache-row map is an int32 per
vocabulary row on top (allocated zeroed, so the OS backs only its pages that
were touched) and the written bitmap a bit per row.

Freshness: the training side commits (`Tiers.flush`) by renaming
`tier.json` after writing the commit's bitmap and `changes.<commit>.npy`
(the rows written since the commit before). `refresh()` reads `tier.json`;
on a new commit it loads the new bitmap and drops the cached rows that the
commits in between changed (the whole cache when the store no longer keeps
those commits' changes: the server missed more than `KEPT_CHANGES`). It runs
inside `lookup` at most every `refresh_seconds`: a read of `tier.json`; the
lookup that finds a new commit also reads its bitmap (`vocabulary_size / 8`
bytes) and changes: 40-170 ms for a 10^8-row table after a commit of 10^5
rows, measured on a loaded 2-core VM (benchmarks/offload_serving.py). A
caller that must keep that off its lookups calls `refresh()` from a timer
thread of its own, with `refresh_seconds=None`. Lookups never
stop: a refresh swaps the bitmap and drops rows under a short lock, and
rows read while a refresh ran are served but not cached. A row cached is
therefore never older than the last commit the server has seen.

Never a torn row: a record read while the writer is in the middle of writing
it fails its checksum; it is read again (`retries` times, sleeping
`retry_seconds`, doubling), and if it still fails, a `CorruptStoreError`
names the table and the row.

Thread-safe: any number of threads may call `lookup`; reads from disk run
outside the lock (numpy copies rows out of the mapped store with the GIL released).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

import numpy as np

from sparse_embed.host.ids import python_ints
from sparse_embed.tiers.store import KEPT_CHANGES, CorruptStoreError, StoreReader, stored_shards

DEFAULT_CACHE_BYTES = 1 << 30
PADDING_ID = -1


@dataclasses.dataclass
class ServingStats:
    """Counts of lookups from one store (`StoreServer.stats()`), or one model's table (`ParameterServer.stats()`).

    `hits + misses + not_found == lookups`; padding ids are counted apart.
    """

    lookups: int = 0  # ids looked up (repeats counted, padding not)
    hits: int = 0  # of those, ids whose row was in the RAM cache
    misses: int = 0  # ids whose row was read from the store
    not_found: int = 0  # ids of rows the store never wrote: served the default vector
    padding: int = 0  # -1 ids: served zeros
    rows_read: int = 0  # distinct rows read from the store (a batch's repeats read once)
    bytes_read: int = 0  # whole records (row, slots, checksum) read
    retries: int = 0  # rows read again because they failed their checksum (caught mid-write)
    read_seconds: float = 0.0  # time the lookups spent reading the store
    # the store's, shared by every model's table that names it:
    refreshes: int = 0  # new commits picked up
    invalidated: int = 0  # cached rows dropped because a commit changed them (or dropped whole, after a gap)
    evictions: int = 0  # cached rows replaced by others
    cached_rows: int = 0  # rows in the cache now
    commit: int = 0  # the store's commit the server serves
    step: int | None = None  # that commit's training step

    @property
    def hit_rate(self) -> float:
        """Hits over the ids of rows the store holds (not-found and padding ids left out)."""
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0


_PER_LOOKUP = ("lookups", "hits", "misses", "not_found", "padding", "rows_read", "bytes_read", "retries",
               "read_seconds")
_ROWS_PER_READER = 256  # a lookup reads its misses on up to read_threads threads, at least this many rows each


def slot_dtype(capacity: int) -> np.dtype:
    """The dtype of a cache's row -> cache row + 1 map: 4 bytes a table row, 8 where a cache row + 1 would pass
    int32 (and wrap to another row's slot)."""
    return np.dtype(np.int32 if capacity < np.iinfo(np.int32).max else np.int64)


class _RowCache:
    """`capacity` cached rows of a `[vocabulary, dim]` table: values, the row each holds, CLOCK reference bits."""

    def __init__(self, vocabulary: int, dim: int, capacity: int) -> None:
        self.capacity = capacity
        self.values = np.empty((max(capacity, 1), dim), np.float32)  # (a row to gather from when there are none)
        self.row_of = np.full(capacity, -1, np.int64)  # cache row -> table row (-1: empty)
        self.slot_of = np.zeros(vocabulary, slot_dtype(capacity))  # table row -> cache row + 1 (0: not cached)
        self.referenced = np.zeros(capacity, bool)
        self.hand = 0
        self.size = 0

    def put(self, rows: np.ndarray, values: np.ndarray) -> int:
        """Caches distinct, uncached `rows` with `values` (as many as fit; the rest are not cached); evictions."""
        m = min(rows.size, self.capacity)
        if m == 0:
            return 0
        victims = self._victims(m)
        old = self.row_of[victims]
        old = old[old >= 0]
        self.slot_of[old] = 0
        self.row_of[victims] = rows[:m]
        self.slot_of[rows[:m]] = victims + 1
        self.values[victims] = values[:m]
        self.referenced[victims] = False
        self.size += m - old.size
        return int(old.size)

    def _victims(self, m: int) -> np.ndarray:
        """`m <= capacity` cache rows to reuse, by CLOCK: the hand clears reference bits and takes rows whose bit
        is clear. Two turns take every row, so it ends; a row taken is marked so that it is not taken twice."""
        out, found = [], 0
        while found < m:
            size = min(self.capacity, max(2 * (m - found), 4096))
            window = (self.hand + np.arange(size)) % self.capacity
            take = np.flatnonzero(~self.referenced[window])[:m - found]
            end = size if take.size < m - found else int(take[-1]) + 1
            self.referenced[window[:end]] = False
            self.referenced[window[take]] = True
            out.append(window[take])
            found += take.size
            self.hand = int((self.hand + end) % self.capacity)
        return np.concatenate(out)

    def drop(self, rows: np.ndarray | None) -> int:
        """Drops `rows` (int64, any) from the cache, or every row (None); how many were cached."""
        slots = np.flatnonzero(self.row_of >= 0) if rows is None else self.slot_of[rows].astype(np.int64) - 1
        slots = np.unique(slots[slots >= 0])  # (a row twice, as changed by two commits: dropped, and counted, once)
        self.slot_of[self.row_of[slots]] = 0
        self.row_of[slots] = -1
        self.referenced[slots] = False
        self.size -= slots.size
        return int(slots.size)


def _default_vector(default: Any, dim: int, label: str) -> np.ndarray:
    if default is None:
        return np.zeros(dim, np.float32)
    bad = ValueError(f"{label}: default must be a finite number or a [{dim}] vector of them, got {default!r}.")
    if isinstance(default, (bool, str, bytes)) or not (np.isscalar(default) or
                                                       isinstance(default, (list, tuple, np.ndarray))):
        raise bad
    try:
        vec = np.asarray(default)
        if vec.dtype.kind not in "iuf":  # (["0.5"]: numpy would parse the text)
            raise bad
        vec = vec.astype(np.float32)
    except (TypeError, ValueError):
        raise bad from None
    if not np.isfinite(vec).all():  # NaN would serve as a row
        raise bad
    if vec.ndim == 0:
        return np.full(dim, vec, np.float32)
    if vec.shape != (dim,):
        raise ValueError(f"{label}: the default vector has shape {vec.shape}, expected ({dim},).")
    return vec


def _is_set(bits: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Which `rows` have their bit set in `np.packbits` order."""
    return ((bits[rows >> 3] >> (7 - (rows & 7)).astype(np.uint8)) & 1).astype(bool)


class StoreServer:
    """Lookups of one offloaded table's store (read-only) through a bounded RAM cache of its rows.

    Args:
      path: the store's directory (`Offload(path)` of the training run).
      cache_bytes: RAM for cached rows (default 1 GiB); 0: no cache.
      default: what a row the store never wrote reads: a number (every column) or a `[dim]` vector; zeros.
      refresh_seconds: `lookup` checks for a new commit when this long has passed since the last check (0: at
        every lookup; None: never, call `refresh()`).
      retries, retry_seconds: re-reads of a row that fails its checksum, and the first sleep (doubling).
      read_threads: threads reading a lookup's misses, 256 rows or more each (a disk serves several reads at
        once: random 4 KiB reads on this VM's disk ran over twice as fast on 4 threads as on one).

    The module doc says what a lookup returns and how freshness works.
    """

    def __init__(self, path: str | os.PathLike, *, cache_bytes: int = DEFAULT_CACHE_BYTES, default: Any = 0.0,
                 refresh_seconds: float | None = 1.0, retries: int = 6, retry_seconds: float = 0.001,
                 read_threads: int = 8) -> None:
        self.store = StoreReader(path)
        self.path, self.table = self.store.path, self.store.table
        self.vocabulary_size, self.embedding_dim = self.store.vocabulary_size, self.store.embedding_dim
        label = f"Table {self.table!r} (store {self.path!r})"
        if self.store.raw_ids or any(n.startswith("idmap.") for n in os.listdir(self.path)):
            self.store.close()
            raise ValueError(f"{label} is keyed by raw ids: its rows belong to the ids of its id map, which a "
                             "StoreServer does not read; serving an offloaded raw-id table, or moving it into an "
                             "in-memory plan to export it (export_serving with its id_maps), is not done yet "
                             "(docs/offload.md, Raw-id tables).")
        if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, (int, np.integer)) or cache_bytes < 0:
            raise ValueError(f"{label}: cache_bytes must be an int >= 0, got {cache_bytes!r}.")
        if refresh_seconds is not None and (isinstance(refresh_seconds, bool) or not isinstance(
                refresh_seconds, (int, float, np.integer, np.floating)) or not refresh_seconds >= 0):
            self.store.close()  # (as the config file's: "5" failed in time's arithmetic, -1 or NaN passed)
            raise ValueError(f"{label}: refresh_seconds must be a number >= 0 or None, got {refresh_seconds!r}.")
        number = (int, float, np.integer, np.floating)  # (a negative sleep failed in the lookup that met a torn row)
        if isinstance(retries, bool) or not isinstance(retries, (int, np.integer)) or retries < 0 or \
                isinstance(retry_seconds, bool) or not isinstance(retry_seconds, number) or not retry_seconds >= 0:
            self.store.close()
            raise ValueError(f"{label}: retries must be an int >= 0 and retry_seconds a number >= 0, got {retries!r} "
                             f"and {retry_seconds!r}.")
        self.cache_bytes = int(cache_bytes)
        self.default = _default_vector(default, self.embedding_dim, label)
        self.refresh_seconds, self.retries, self.retry_seconds = refresh_seconds, int(retries), float(retry_seconds)
        self.read_threads = max(1, int(read_threads))
        self._readers: ThreadPoolExecutor | None = None  # started by the first lookup that needs it
        self.cache = _RowCache(self.vocabulary_size, self.embedding_dim,  # (never more rows than the table has)
                               min(self.cache_bytes // (4 * self.embedding_dim + 9), self.vocabulary_size))
        self._lock = threading.Lock()  # the cache, the bitmap, the counters
        self._refreshing = threading.Lock()  # one refresh at a time
        self._stats = ServingStats()
        self._epoch = 0  # bumped by every refresh that picks up a commit: reads begun before it are not cached
        self._closed = False
        self.commit, self.step, self._bits, self._id = self._load(self.store)
        self._stats.commit, self._stats.step = self.commit, self.step
        self._next_check = time.monotonic() + (refresh_seconds or 0.0)

    def _load(self, store: StoreReader, tries: int = 20) -> tuple[int, int | None, np.ndarray, str | None]:
        """`(commit, step, written bits, commit id)` of the store's last commit; a commit made in between is read
        again."""
        for _ in range(tries):
            meta = store.meta()
            commit = int(meta.get("commit", 0))
            try:
                return commit, meta.get("step"), store.written_bits(commit), meta.get("id")
            except FileNotFoundError:  # a newer commit removed that bitmap: read tier.json again
                continue
        raise CorruptStoreError(f"Table {self.table!r}: the store at {self.path!r} names a commit whose bitmap is "
                                f"missing ({tries} tries).")

    def refresh(self) -> bool:
        """Picks up the store's newest commit, if there is a new one: its bitmap, and drops the cached rows
        written since the commit served (all of them when the store no longer keeps those changes).
        Lookups go on meanwhile. Whether there was a new commit. A FileNotFoundError naming the table while the
        store is gone from its path (removed, or another run's store being made there): lookups serve the commit
        they have meanwhile."""
        with self._refreshing:
            try:
                return self._refresh()
            except FileNotFoundError as e:
                raise FileNotFoundError(f"Table {self.table!r}: the store at {self.path!r} is gone from its path "
                                        f"({e.strerror}: {e.filename!r}): removed, or another run's store being made "
                                        f"there; lookups serve its commit {self.commit} meanwhile.") from None

    def _refresh(self) -> bool:
        store, meta = self.store, self.store.meta()
        commit = int(meta.get("commit", 0))
        # another run's store made at the path (a new records file, or the same commit number under another id):
        # served from scratch, every cached row dropped
        fresh = store.replaced() or (commit == self.commit and meta.get("id") != self._id)
        if fresh:
            store = self._reopened()
        elif commit == self.commit:
            return False
        commit, step, bits, commit_id = self._load(store)
        changed = None
        if not fresh and self.commit < commit <= self.commit + KEPT_CHANGES:
            parts = [self.store.changes(c) for c in range(self.commit + 1, commit + 1)]
            changed = None if any(p is None for p in parts) else np.concatenate(parts)
        if changed is not None and changed.size and (changed.min() < 0 or changed.max() >= self.vocabulary_size):
            changed = None
        with self._lock:
            dropped = self.cache.drop(changed)
            self.store, self._bits, self.commit, self.step, self._id = store, bits, commit, step, commit_id
            self._epoch += 1
            s = self._stats
            s.refreshes, s.invalidated, s.commit, s.step = s.refreshes + 1, s.invalidated + dropped, commit, step
        return True

    def _reopened(self) -> StoreReader:
        """The store now at the path (the one served so far is left to lookups still reading it); a
        CorruptStoreError if it holds another table."""
        new, old = StoreReader(self.path), self.store
        what = lambda s: (s.table, s.vocabulary_size, s.embedding_dim, s.slots)  # noqa: E731
        if what(new) != what(old):
            new.close()
            raise CorruptStoreError(f"Table {self.table!r}: the store at {self.path!r} was replaced by one of "
                                    f"another table (table, rows, dim, slots: {what(new)}, served: {what(old)}).")
        return new

    def _maybe_refresh(self) -> None:
        if self.refresh_seconds is None or time.monotonic() < self._next_check:
            return
        if self._refreshing.acquire(blocking=False):  # another thread refreshing: this lookup does not wait
            try:
                self._next_check = time.monotonic() + self.refresh_seconds
                self._refresh()
            except FileNotFoundError:  # the store gone from its path (removed, or another run's being made there):
                pass  # lookups serve the commit they have (still mapped), and look again after refresh_seconds
            finally:
                self._refreshing.release()

    def lookup(self, ids: Any) -> np.ndarray:
        """`[*ids.shape, dim]` float32 rows of integer `ids` (-1: padding, zeros; rows never written: the default)."""
        return self._serve(ids, self.default, f"Table {self.table!r}")[0]

    def _check_ids(self, ids: Any, label: str, given: Any = None) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.size == 0 and ids.dtype.kind == "f":  # `[]`: numpy's empty list is float64
            ids = ids.astype(np.int64)
        # a list of integers that numpy reads as floats or objects (Python ints past int64, or numpy's uint64 beside
        # int64): read as the integers they are, not refused with "ids must be integers"
        if isinstance(given, (list, tuple)) and ids.dtype.kind in "fO":
            values = python_ints(given)
            if values is not None:
                for i, v in enumerate(values.flat):
                    if not PADDING_ID <= int(v) < self.vocabulary_size:
                        raise ValueError(f"{label}: id {int(v)} (at {i}) is outside [0, {self.vocabulary_size}) of "
                                         f"the store at {self.path!r} (-1 is padding).")
                ids = values.astype(np.int64)
        if ids.dtype.kind not in "iu":
            raise ValueError(f"{label}: ids must be integers, got dtype {ids.dtype}.")
        given = ids.reshape(-1)
        flat = given.astype(np.int64, copy=False)
        bad = (flat < PADDING_ID) | (flat >= self.vocabulary_size)
        if ids.dtype.kind == "u":  # (a uint64 past int64's range would wrap to -1, padding)
            bad |= given >= self.vocabulary_size
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{label}: id {int(given[i])} (at {i}) is outside [0, {self.vocabulary_size}) of the "
                             f"store at {self.path!r} (-1 is padding).")
        return flat

    def _serve(self, ids: Any, default: np.ndarray, label: str) -> tuple[np.ndarray, dict[str, Any]]:
        """The rows of `ids`, and this lookup's counts (`_PER_LOOKUP`)."""
        try:
            given, ids = ids, np.asarray(ids)
        except ValueError as e:  # a ragged list: numpy's message named no table
            raise ValueError(f"{label}: ids must be an integer array (a list of lists of one length), got a ragged "
                             f"{type(ids).__name__} ({e}).") from None
        shape = ids.shape
        flat = self._check_ids(ids, label, given)
        if self._closed:  # (its files are closed: a read would fail with the OS's bare 'Bad file descriptor')
            raise ValueError(f"{label}: the server of the store at {self.path!r} is closed.")
        self._maybe_refresh()
        with self._lock:
            # the store this bitmap is of: a refresh may reopen a replaced store meanwhile, whose rows differ
            epoch, bits, store = self._epoch, self._bits, self.store
            slots = self.cache.slot_of[np.maximum(flat, 0)] - 1
            slots[flat < 0] = -1
            hit = slots >= 0
            out = self.cache.values[np.maximum(slots, 0)]  # (fancy indexing: faster than np.take); misses below
            self.cache.referenced[slots[hit]] = True
        rest = np.flatnonzero(~hit)
        pad = rest[flat[rest] < 0]
        rest = rest[flat[rest] >= 0]
        found = _is_set(bits, flat[rest])
        rows, where = np.unique(flat[rest[found]], return_inverse=True)
        t0 = time.perf_counter()
        values, retried = self._read(store, rows, label)
        seconds = time.perf_counter() - t0
        out[rest[found]] = values[where]
        out[rest[~found]] = default
        out[pad] = 0.0
        counts = dict(hits=int(hit.sum()), misses=int(found.sum()), not_found=int(rest.size - found.sum()),
                      padding=int(pad.size), rows_read=int(rows.size), retries=retried,
                      bytes_read=int(rows.size + retried) * store.record_bytes, read_seconds=seconds)
        counts["lookups"] = counts["hits"] + counts["misses"] + counts["not_found"]
        with self._lock:
            if self._epoch == epoch and rows.size:  # no refresh since the reads began: they are fresh enough
                new = self.cache.slot_of[rows] == 0  # (another thread may have cached some meanwhile)
                self._stats.evictions += self.cache.put(rows[new], values[new])
            for k, v in counts.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)
        return out.reshape(shape + (self.embedding_dim,)), counts

    def _read(self, store: StoreReader, rows: np.ndarray, label: str) -> tuple[np.ndarray, int]:
        """`([n, dim] embeddings of rows, re-reads)` from `store`: a record that fails its checksum is read again,
        sleeping in between (a writer may be in the middle of it); still failing after `retries`: CorruptStoreError."""
        data, bad = self._read_records(store, rows)
        retried, wait = 0, self.retry_seconds
        for _ in range(self.retries):
            if not bad.any():
                break
            time.sleep(wait)
            wait *= 2
            again = np.flatnonzero(bad)
            retried += again.size
            data[again], bad[again] = store.read_records(rows[again])
        if bad.any():
            row = int(rows[int(np.argmax(bad))])
            raise CorruptStoreError(f"{label}: row {row} of the store at {self.path!r} fails its checksum after "
                                    f"{self.retries} re-reads (the file was damaged or written by something else).")
        return data[:, :self.embedding_dim], retried

    def _read_records(self, store: StoreReader, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`store.read_records`, split over `read_threads` threads when there are many rows."""
        k = min(self.read_threads, rows.size // _ROWS_PER_READER)
        if k <= 1:
            return store.read_records(rows)
        if self._readers is None:
            with self._lock:
                if self._readers is None:
                    self._readers = ThreadPoolExecutor(self.read_threads, "sparse_embed.serving.reader")
        data = np.empty((rows.size, store.width), np.float32)
        bad = np.empty(rows.size, bool)

        def part(at: slice) -> None:
            data[at], bad[at] = store.read_records(rows[at])

        bounds = np.linspace(0, rows.size, k + 1).astype(int)
        list(self._readers.map(part, [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]))
        return data, bad

    def stats(self) -> ServingStats:
        """The counts so far (a copy)."""
        with self._lock:
            self._stats.cached_rows = self.cache.size
            return dataclasses.replace(self._stats)

    def close(self) -> None:
        """Closes the store's files; a lookup after it is a ValueError naming the table."""
        self._closed = True
        if self._readers is not None:
            self._readers.shutdown()
        self.store.close()

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_TABLE_FIELDS = {"store", "cache_bytes", "default", "refresh_seconds"}


class ParameterServer:
    """Lookups by model and table over `StoreServer`s (`load_parameter_server` builds one from a config file).

    `entries`: `{model: {table: (server, default [dim] float32)}}`; several entries may share one server (one
    cache), each with its own default and counts.
    """

    def __init__(self, entries: Mapping[str, Mapping[str, tuple[StoreServer, np.ndarray]]]) -> None:
        self._entries = {m: dict(tables) for m, tables in entries.items()}
        self._stats = {(m, t): ServingStats() for m, tables in self._entries.items() for t in tables}
        self._lock = threading.Lock()

    @property
    def models(self) -> dict[str, list[str]]:
        """`{model: [table, ...]}`."""
        return {m: sorted(tables) for m, tables in self._entries.items()}

    def server(self, model: str, table: str) -> StoreServer:
        """The `StoreServer` of a model's table (shared by every entry that names its store)."""
        if model not in self._entries:
            raise ValueError(f"Unknown model {model!r}; the serving config names {sorted(self._entries)}.")
        if table not in self._entries[model]:
            raise ValueError(f"Model {model!r} has no table {table!r}; it has {sorted(self._entries[model])}.")
        return self._entries[model][table][0]

    def lookup(self, model: str, table: str, ids: Any) -> np.ndarray:
        """`[*ids.shape, dim]` float32 rows of a model's table (as `StoreServer.lookup`, with that table's default)."""
        server = self.server(model, table)
        rows, counts = server._serve(ids, self._entries[model][table][1], f"Model {model!r}, table {table!r}")
        with self._lock:
            s = self._stats[model, table]
            for k, v in counts.items():
                setattr(s, k, getattr(s, k) + v)
        return rows

    def refresh(self) -> int:
        """Refreshes every store; how many had a new commit."""
        return sum(s.refresh() for s in self._servers())

    def stats(self) -> dict[tuple[str, str], ServingStats]:
        """`{(model, table): ServingStats}`: that entry's lookup counts, and its store's refreshes, cache and commit."""
        out = {}
        for (m, t), s in self._stats.items():
            store = self._entries[m][t][0].stats()
            with self._lock:
                own = {k: getattr(s, k) for k in _PER_LOOKUP}
            out[m, t] = dataclasses.replace(store, **own)
        return out

    def _servers(self) -> list[StoreServer]:
        return list({id(s): s for tables in self._entries.values() for s, _ in tables.values()}.values())

    def close(self) -> None:
        for s in self._servers():
            s.close()

    def __enter__(self) -> ParameterServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _read_config(config: str | os.PathLike | Mapping) -> tuple[dict, str, str]:
    """`(config dict, the directory relative store paths resolve against, what error messages call it)`."""
    if isinstance(config, Mapping):
        return dict(config), os.getcwd(), "serving config"
    path = os.fspath(config)
    where = f"serving config {path!r}"
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"No serving config at {path!r}.") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON: {e}.") from None
    return cfg, os.path.dirname(os.path.abspath(path)), where


def _table_fields(fields: Any, label: str, base: str) -> dict[str, Any]:
    """One table's checked fields: store (resolved), cache_bytes, default, refresh_seconds."""
    if not isinstance(fields, Mapping):
        raise ValueError(f"{label}: expected an object with a \"store\" path, got {fields!r}.")
    unknown = sorted(set(fields) - _TABLE_FIELDS)
    if unknown:
        raise ValueError(f"{label}: unknown fields {unknown}; a table takes {sorted(_TABLE_FIELDS)}.")
    store = fields.get("store")
    if not isinstance(store, str) or not store:
        raise ValueError(f"{label}: \"store\" must be the path of a store, got {store!r}.")
    store = os.path.realpath(os.path.join(base, os.path.expanduser(store)))
    if not os.path.exists(os.path.join(store, "tier.json")):
        shards = stored_shards(store)
        if shards:  # (not "no store there": it holds one, of several processes)
            raise ValueError(f"{label}: the store at {store!r} was written by {shards} processes (each keeps its rows "
                             "in process<i>of<P>/): serving reads a store of one process; rewrite it as one with "
                             "sparse_embed.offload.store_state and write_store.")
        raise FileNotFoundError(f"{label}: no offloaded table's store at {store!r} (no tier.json there).")
    cache = fields.get("cache_bytes", DEFAULT_CACHE_BYTES)
    if isinstance(cache, bool) or not isinstance(cache, int) or cache < 0:
        raise ValueError(f"{label}: \"cache_bytes\" must be an int >= 0, got {cache!r}.")
    refresh = fields.get("refresh_seconds", 1.0)
    if refresh is not None and (isinstance(refresh, bool) or not isinstance(refresh, (int, float)) or not refresh >= 0):
        raise ValueError(f"{label}: \"refresh_seconds\" must be a number >= 0 or null, got {refresh!r}.")
    return {"store": store, "cache_bytes": cache, "default": fields.get("default", 0.0), "refresh_seconds": refresh}


def load_parameter_server(config: str | os.PathLike | Mapping) -> ParameterServer:
    """A `ParameterServer` over the stores a serving config names.

    The config (a JSON file, or the same as a dict; relative store paths resolve against the file's directory,
    or the working directory for a dict):

        {"models": {"ranker": {"items": {"store": "stores/items", "cache_bytes": 1073741824, "default": 0.0},
                               "users": {"store": "/data/users", "default": [0.1, 0.2, ...]}},
                    "ranker_b": {"items": {"store": "stores/items"}}}}

    Per table: `store` (required), `cache_bytes` (default 1 GiB), `default` (a number or a `[dim]` vector;
    0.0), `refresh_seconds` (1.0; null: only `refresh()`). Models that name the same store share one server
    (one cache: the largest `cache_bytes` they ask for, the shortest `refresh_seconds`); each keeps its own
    default and counts. Errors name the model and table.
    """
    cfg, base, where = _read_config(config)
    if not isinstance(cfg, Mapping) or set(cfg) != {"models"} or not isinstance(cfg["models"], Mapping):
        raise ValueError(f"{where}: expected {{\"models\": {{model: {{table: {{\"store\": path, ...}}}}}}}}, got "
                         f"top-level fields {sorted(cfg) if isinstance(cfg, Mapping) else type(cfg).__name__}.")
    if not cfg["models"]:
        raise ValueError(f"{where}: \"models\" names no model.")
    fields = {}
    for model, tables in cfg["models"].items():
        if not isinstance(tables, Mapping) or not tables:
            raise ValueError(f"{where}: model {model!r} must map table names to their stores, got {tables!r}.")
        for table, f in tables.items():
            fields[model, table] = _table_fields(f, f"{where}: model {model!r}, table {table!r}", base)
    servers: dict[str, StoreServer] = {}
    try:
        for store in dict.fromkeys(f["store"] for f in fields.values()):
            named = [f for f in fields.values() if f["store"] == store]
            refresh = [f["refresh_seconds"] for f in named if f["refresh_seconds"] is not None]
            try:
                servers[store] = StoreServer(store, cache_bytes=max(f["cache_bytes"] for f in named),
                                             refresh_seconds=min(refresh) if refresh else None)
            except ValueError as e:  # (CorruptStoreError too) a store refused: named by the entries that name it
                entries = "; ".join(f"model {m!r}, table {t!r}" for (m, t), f in fields.items() if f["store"] == store)
                raise type(e)(f"{where}: {entries}: {e}") from None
        entries: dict[str, dict[str, tuple[StoreServer, np.ndarray]]] = {}
        for (model, table), f in fields.items():
            server, label = servers[f["store"]], f"{where}: model {model!r}, table {table!r}"
            if server.table != table:  # a path copied from another table: its rows would serve, silently
                raise ValueError(f"{label}: the store at {f['store']!r} holds table {server.table!r}, not {table!r}.")
            default = _default_vector(f["default"], server.embedding_dim, label)
            entries.setdefault(model, {})[table] = (server, default)
    except BaseException:
        for s in servers.values():
            s.close()
        raise
    return ParameterServer(entries)
