"""The files of an offloaded table's store that hold rows: the records file (mapped, a row per record, written in
place) and the write log (`log.bin`: records appended in the order they were written back).

Why a write log: with Zipf ids most rows the cache evicts are tail rows,
each on a page of the records file of its own, and most written for the
first time. A record written in place there costs a page fault, a zeroed
page, a block allocated and a whole 4 KiB page written back by the kernel,
for a record of a few hundred bytes (docs/offload.md measures it). Appended
to the log, the same records are one sequential write. The store merges the
log into the records file when it commits (and when the log outgrows its
cap), in row order and each row once: see `RowStore._merge`.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Callable, Iterator

import numpy as np

LOG_NAME = "log.bin"
_CHUNK_BYTES = 64 << 20  # the log is scanned (merged, followed) this much at a time


class MappedRows:
    """`[rows, words]` float32 of a file, mapped: a row is read or written by a copy into or out of the mapping.

    Why mapped: a system call per row (pread/pwrite) cost 1-10 us here, a
    copy into a mapped page 0.2-3 us (the first touch of a page faults it in).
    The pages a process touches count in its RSS, so every `MAPPED_BYTES`
    of rows touched the whole mapping is dropped from the process
    (`madvise(MADV_DONTNEED)`: the data stays in the page cache, and on
    disk once written back), which bounds the RSS of a store far larger
    than memory.
    """

    MAPPED_BYTES = 1 << 30

    def __init__(self, fd: int, shape: tuple[int, int], write: bool) -> None:
        size = 4 * shape[0] * shape[1]
        self._mmap = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if write else mmap.ACCESS_READ) if size else None
        self.map = np.frombuffer(self._mmap, np.float32).reshape(shape) if size else np.zeros(shape, np.float32)
        if size:  # a miss reads one record: no read-around of the pages beside it (a fault of a cold
            self._mmap.madvise(mmap.MADV_RANDOM)  # random row read ~10x the bytes, ~10x slower, `StoreReader`)
        self.touched = 0

    def move(self, rows: np.ndarray, data: np.ndarray, write: bool) -> None:
        """Reads (or writes) record i of `data [n, words]` at row `rows[i]`."""
        rows = np.asarray(rows, np.int64)
        if self.map is None:
            raise ValueError("the store is closed")
        if write:
            self.map[rows] = data
        else:
            np.take(self.map, rows, axis=0, out=data)
        self.touched += rows.size * max(data.shape[1] * 4, 4096)
        if self.touched > self.MAPPED_BYTES and self._mmap is not None:
            self._mmap.madvise(mmap.MADV_DONTNEED)
            self.touched = 0

    def advise_sequential(self, on: bool) -> None:
        """Pages faulted in with the pages after them (`on`: a pass in file order), or one at a time (random rows)."""
        if self._mmap is not None:
            self._mmap.madvise(mmap.MADV_SEQUENTIAL if on else mmap.MADV_RANDOM)

    def sync(self) -> None:
        """Makes every write durable (msync: the dirty pages and the blocks they need, as fdatasync)."""
        if self._mmap is not None:
            self._mmap.flush()

    def close(self) -> None:
        self.map = None  # unmapped when the last view goes (closing the mmap under a view would crash it)


def open_mapped(path: str, shape: tuple[int, int], write: bool) -> MappedRows:
    """The records file at `path` mapped as `[rows, words]` (created sparse, or extended, when `write`)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT if write else os.O_RDONLY, 0o644)
    try:
        if write and os.fstat(fd).st_size < 4 * shape[0] * shape[1]:
            os.ftruncate(fd, 4 * shape[0] * shape[1])  # sparse: unwritten rows take no disk
        return MappedRows(fd, shape, write)
    finally:
        os.close(fd)  # the mapping keeps the file


class WriteLog:
    """A store's write log: entries `[row (int64 as 2 words), record (width words, checksum last)]` appended to
    `log.bin`, and `at [V] uint32`: 1 + each row's newest entry (0: not in the log).

    The training side (`RowStore`) appends its write-backs and reads its misses through `read` first; a
    serving reader (`StoreReader`) opens the same file and `follow`s it. The log is never part of a commit:
    a store opens without it (its rows roll back), and a new log is a new file (a reader notices by its
    inode). Thread-safe: one appender, any number of readers.
    """

    def __init__(self, path: str, fd: int, width: int, vocabulary_size: int) -> None:
        self.path, self.fd, self.ino = path, fd, os.fstat(fd).st_ino
        self.words, self.width = width + 2, width
        self.entry_bytes = 4 * self.words
        self.at = np.zeros(vocabulary_size, np.uint32)  # zeroed on demand: only the pages of logged rows take memory
        self.count = 0  # entries indexed (the appender's: written; a reader's: followed and whole)
        self.rows: list[np.ndarray] = []  # the rows of the entries, in order (to list the log's rows)
        self.lock = threading.Lock()
        self._map: MappedRows | None = None

    @classmethod
    def create(cls, path: str, width: int, vocabulary_size: int) -> "WriteLog":
        """A new, empty log at `path` (a file there is replaced: a log never outlives its store's opening)."""
        if os.path.exists(path):
            os.remove(path)
        return cls(path, os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644), width,
                   vocabulary_size)

    @classmethod
    def open(cls, path: str, width: int, vocabulary_size: int) -> "WriteLog | None":
        """The log at `path` opened to read (`follow`), None if there is none."""
        try:
            return cls(path, os.open(path, os.O_RDONLY), width, vocabulary_size)
        except FileNotFoundError:
            return None

    @property
    def bytes(self) -> int:
        return self.count * self.entry_bytes

    def append(self, rows: np.ndarray, records: np.ndarray) -> None:
        """Appends records `[n, width]` (checksums included) of distinct table rows `rows`."""
        entries = np.empty((rows.size, self.words), np.uint32)
        entries[:, :2] = rows.astype("<i8").view(np.uint32).reshape(-1, 2)
        entries[:, 2:] = records.view(np.uint32)
        view, done = memoryview(entries).cast("B"), 0
        try:
            while done < view.nbytes:
                done += os.write(self.fd, view[done:])
        except OSError:  # (a full disk) a torn entry would shift every entry appended after it: it is cut off, and
            whole = rows[:done // self.entry_bytes]  # the whole ones stay (a reader may have indexed and mapped them)
            os.ftruncate(self.fd, (self.count + whole.size) * self.entry_bytes)
            self._index(whole)
            raise
        self._index(rows)

    def _index(self, rows: np.ndarray) -> None:
        """Indexes the entries just appended, of `rows`."""
        with self.lock:
            self.at[rows] = np.arange(self.count + 1, self.count + 1 + rows.size, dtype=np.uint32)
            self.count += rows.size
            self.rows.append(rows)

    def read(self, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Copies the newest logged record of each of `rows` into `out [n, width]`; bool `[n]`: which were logged."""
        with self.lock:
            at = self.at[rows] if self.fd >= 0 else np.zeros(rows.size, np.uint32)
            logged = at > 0
            if logged.any():
                if self._map is None or self._map.map.shape[0] < self.count:
                    self._map = MappedRows(self.fd, (self.count, self.words), write=False)  # the log has grown
                entries = np.empty((int(logged.sum()), self.words), np.float32)
                self._map.move(at[logged].astype(np.int64) - 1, entries, write=False)
                out[logged] = entries[:, 2:]
        return logged

    def scan(self, start: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """`(first entry, entries uint32 [k, words])` of the whole entries in the file from entry `start` on, read
        sequentially a chunk at a time."""
        end = os.fstat(self.fd).st_size // self.entry_bytes
        step = max(1, _CHUNK_BYTES // self.entry_bytes)
        for lo in range(start, end, step):
            n = min(step, end - lo)
            raw = os.pread(self.fd, n * self.entry_bytes, lo * self.entry_bytes)
            n = len(raw) // self.entry_bytes
            yield lo, np.frombuffer(raw[:n * self.entry_bytes], np.uint32).reshape(n, self.words)

    def follow(self, failing: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
        """Indexes the entries appended to the file since the last call (a reader's), up to the first that fails
        its checksum (`failing(records, rows)`: caught mid-append, indexed by a later call)."""
        with self.lock:
            for lo, entries in self.scan(self.count):
                rows = entries_rows(entries)
                outside = (rows < 0) | (rows >= self.at.size)  # a torn row number
                bad = outside | failing(entries[:, 2:].view(np.float32), np.where(outside, 0, rows))
                whole = int(np.argmax(bad)) if bad.any() else rows.size
                rows = rows[:whole]
                last, first = np.unique(rows[::-1], return_index=True)  # a row logged twice: its newest entry
                self.at[last] = (lo + whole - first).astype(np.uint32)
                self.count = lo + whole
                self.rows.append(rows)
                if whole < entries.shape[0]:
                    return

    def logged_rows(self) -> np.ndarray:
        """The distinct rows with an entry (int64, sorted)."""
        with self.lock:
            return np.unique(np.concatenate(self.rows)) if self.rows else np.zeros(0, np.int64)

    def close(self, remove: bool = False) -> None:
        """Closes the log (a read after it finds nothing logged); `remove`: deletes its file too."""
        with self.lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd, self._map, self.count = -1, None, 0
                if remove and os.path.exists(self.path) and os.stat(self.path).st_ino == self.ino:
                    os.remove(self.path)


def entries_rows(entries: np.ndarray) -> np.ndarray:
    """int64 `[k]`: the table rows of log entries `[k, words]` (uint32)."""
    return np.ascontiguousarray(entries[:, :2]).view("<i8")[:, 0].astype(np.int64)


def log_rows(path: str, width: int, vocabulary_size: int) -> np.ndarray:
    """The distinct rows (int64, sorted) of the entries of the log file at `path` (none if there is no file); rows
    out of range (a torn last entry) are left out."""
    log = WriteLog.open(path, width, vocabulary_size)
    if log is None:
        return np.zeros(0, np.int64)
    try:
        rows = [entries_rows(entries) for _, entries in log.scan()]
    finally:
        log.close()
    rows = np.unique(np.concatenate(rows)) if rows else np.zeros(0, np.int64)
    return rows[(rows >= 0) & (rows < vocabulary_size)]
