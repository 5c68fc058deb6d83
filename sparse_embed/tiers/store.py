"""An offloaded table's store on disk: every row with its optimizer slots, read and written a row at a time.

Layout of the store's directory (one table):

- `records/`: a zarr v3 array `[vocabulary_size, dim + slot widths + 1]`
  float32 in one uncompressed chunk (`records/c/0/0`, the raw row-major
  bytes), so tensorstore or any zarr reader opens it, and a row is one
  copy at `row * record_bytes` of the mapped file. The last column holds
  the row's checksum (its bits as a uint32). Why not tensorstore's own row
  access, or small or sharded chunks with crc32c: a miss reads a few
  hundred scattered bytes, and tensorstore reads or rewrites whole chunks
  (measured in docs/offload.md: 40-250 ms per 1000 random rows against
  about 1 ms here).
- `tier.json`: what the table is (so a store never opens under another
  table's spec), and the last commit: its number and step.
- `written.<commit>.bin`: which rows the store holds as of that commit (a
  bit per row; its CRC32 in `tier.json`, for the commit and each kept one).
  A row never written holds the table initializer's values and the slots'
  initial values; it is generated, not read.
- `changes.<commit>.npy`: the rows (int64) written since the commit before
  (and any a rollback restored), so that a reader serving the store
  (`tiers.serving`) drops exactly its cached rows that changed; the last
  `KEPT_CHANGES` commits' are kept.
- `rolled_back.npy`: the rows that openings since the last commit rolled
  back (their logs are gone), until the next commit lists them in its
  changes: a store opened, rolled back and closed again before a commit
  (killed twice, or read by `store_state` in between) still lists them.
- `log.bin`: the write log. Rows written back between commits are
  appended here (each entry: the row number, then its record), not written
  in place: a tail row's first write into the records file costs a page
  (`tiers.rows_file`). The store merges the log into the records file at
  each commit (each row's newest entry, in row order), and between commits
  once it holds `log_bytes`. The log is never part of a commit: opening the
  store drops it.
- `undo.<commit + 1>.log`: the records file is written in place (by a
  merge), so before a row is first overwritten after a commit, its
  committed record is appended here (and made durable). Opening the store
  rolls every row back to the last commit and deletes the log, so a store
  killed mid-write (a write-back, a merge, a flush) always opens as exactly
  its last commit: never two steps' rows. A commit (`flush`) merges the
  write log (the rows changed since the last commit), then writes the
  bitmap, then renames `tier.json` (the commit point). The undo log then
  stays, as the way back from that commit to the one before: `tier.json`'s
  `history` lists the last `KEPT_COMMITS` commits (number, id, step), whose
  undo logs and bitmaps are kept, and `rollback_to(id)` makes the store one
  of them again (a checkpoint's, `io.offload_checkpoint`).

The committed state (records file, bitmaps, undo logs, changes) is laid out
as in the stores of earlier versions (`FORMAT` unchanged): the write log is
a file they ignore, and a store they left opens here.

A row's checksum covers its values and its row number: a flipped byte, or a
row written at the wrong place, is a `CorruptStoreError` naming the table
and the row when it is read.

`RowStore` is the training side's (it creates, writes, commits and rolls
back); `StoreReader` opens an existing store read-only for serving: it never
rolls back, writes, truncates or creates a file, and reads each row's newest
record, following the write log (a record caught mid-write fails its
checksum: the caller re-reads).
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import re
import threading
import zlib
from typing import Any, Callable

import numpy as np

from sparse_embed.core.specs import TableSpec
from sparse_embed.tiers.rows_file import LOG_NAME, WriteLog, log_rows, open_mapped

FORMAT = "sparse_embed.offload/1"
KEPT_CHANGES = 8  # commits whose `changes.<commit>.npy` a store keeps
ROLLED_BACK_NAME = "rolled_back.npy"  # rows rolled back since the last commit, until it lists them (`_rollback`)
KEPT_COMMITS = 8  # commits a store can go back to (`RowStore.rollback_to`): their undo logs and bitmaps are kept
LOG_BYTES = 1 << 30  # a store's write log is merged once it holds this much or half the records file's size
_MERGE_ROWS = 1 << 18  # rows a merge of the write log copies at a time
_OPEN: dict[str, int] = {}  # real path -> `RowStore`s of this process open on it
_SHARD = re.compile(r"process(\d+)of(\d+)$")  # a process's store of a table trained by several (`tiers.processes`)
_K = 0x9E3779B9


class StoreInUseError(RuntimeError):
    """An offloaded table's store is already open for training (`RowStore`), in this process or another."""


class CorruptStoreError(ValueError):
    """A row of an offloaded table's store fails its checksum, or the store does not match its table."""


def shard_path(path: str, index: int, count: int) -> str:
    """The directory of process `index` of `count`'s store of the table stored at `path`."""
    return path if count == 1 else os.path.join(path, f"process{index}of{count}")


def stored_shards(path: str) -> int | None:
    """How many processes wrote the store at `path` (1: a store of one process), None if there is none yet.
    Raises a ValueError if it holds shards of different process counts."""
    if os.path.exists(os.path.join(path, "tier.json")):
        return 1
    counts = {int(m.group(2)) for m in map(_SHARD.match, os.listdir(path) if os.path.isdir(path) else []) if m}
    if len(counts) > 1:
        raise ValueError(f"The store at {path!r} holds shards of {sorted(counts)} processes; keep one set.")
    return counts.pop() if counts else None


def record_width(table: TableSpec) -> int:
    """Float32 words of one stored record: the row, each slot in the optimizer's order, the checksum."""
    return table.embedding_dim + sum(s.width for s in slot_specs(table).values()) + 1


def slot_specs(table: TableSpec) -> dict:
    return table.resolved_optimizer.slots(table.embedding_dim)


def row_checksums(words: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """`[n]` uint32 checksums of records `words [n, w]` (uint32, without the checksum) at table rows `rows`.

    A sum mod 2^32 of each word times an odd multiplier of its column, plus a
    mix of the row number; never 0 (0 marks a record never written). Any one
    changed word changes it (the multipliers are odd).
    """
    mult = (np.arange(words.shape[1], dtype=np.uint64) * 2 * _K + 0x85EBCA77 | 1).astype(np.uint32)
    with np.errstate(over="ignore"):
        h = (words * mult).sum(axis=1, dtype=np.uint32)
        r = rows.astype(np.uint64)
        r = ((r ^ (r >> np.uint64(29))) * np.uint64(0xBF58476D1CE4E5B9)) >> np.uint64(32)
        h = h + r.astype(np.uint32)
    return np.where(h == 0, np.uint32(1), h)


def _spec_json(table: TableSpec) -> dict[str, Any]:
    """What `tier.json` says the table is. "raw_ids": its rows belong to the ids of its id map (stores written
    before it was recorded lack it: unknown)."""
    return {"format": FORMAT, "table": table.name, "vocabulary_size": table.vocabulary_size,
            "embedding_dim": table.embedding_dim, "optimizer": type(table.resolved_optimizer).__name__,
            "slots": {k: s.width for k, s in slot_specs(table).items()}, "raw_ids": table.dynamic is not None}


def _zarr_json(shape: tuple[int, int]) -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "array", "shape": list(shape), "data_type": "float32",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(shape)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": 0.0, "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
            "attributes": {"sparse_embed": "rows, then each optimizer slot, then the row's checksum bits"}}


def _read_newest(log: WriteLog | None, read: Callable, rows: np.ndarray, data: np.ndarray) -> None:
    """Copies the newest record of each of `rows` into `data [n, width]`: the write log's, else the records file's
    (`read(rows, data, write=False)`)."""
    logged = log.read(rows, data) if log is not None else None
    if logged is None or not logged.any():
        read(rows, data, write=False)
    elif not logged.all():
        rest = np.flatnonzero(~logged)
        part = np.empty((rest.size, data.shape[1]), np.float32)
        read(rows[rest], part, write=False)
        data[rest] = part


def _failing(data: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """bool `[n]`: which records `data [n, width]` (checksum last) fail their checksum at table rows `rows`."""
    words = data.view(np.uint32)
    return row_checksums(words[:, :-1], rows) != words[:, -1]


def _corrupt_row(table: str, path: str, row: int) -> CorruptStoreError:
    return CorruptStoreError(f"Table {table!r}: row {row} of the store at {path!r} fails its checksum (the file was "
                             "damaged or written by something else).")


def _numbered(name: str, prefix: str, suffix: str) -> int:
    """The commit number of a file named `<prefix><commit><suffix>`, else -1."""
    middle = name[len(prefix):len(name) - len(suffix)]
    return int(middle) if name.startswith(prefix) and name.endswith(suffix) and middle.isdigit() else -1


def _write_json(path: str, value: Any) -> None:
    """Atomically (a temporary file, fsync, rename)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RowStore:
    """One offloaded table's rows and slots on disk (the module doc has the layout). Thread-safe for reads
    and writes of distinct rows (copies into and out of one mapping)."""

    def __init__(self, table: TableSpec, path: str | None = None, *, create: bool = True,
                 init: dict[str, Any] | None = None) -> None:
        """Opens (`create`: or creates) the store of `table` at `path` (default: its `Offload` path), rolled back
        to its last commit. One `RowStore` at a time may have a store open, in any process (a lock file): a second
        would roll it back under the first. `init` (`init_record`): what its never-stored rows are generated
        from, recorded in a new store and checked against an existing one's."""
        if table.storage is None:
            raise ValueError(f"Table {table.name!r} has no storage=Offload(...).")
        self.table, self.path = table, table.storage.path if path is None else path  # path: a process's shard
        self._init = init
        if not create and not os.path.exists(os.path.join(self.path, "tier.json")):
            raise FileNotFoundError(f"Table {table.name!r}: there is no store at {self.path!r} (no tier.json): "
                                    "check the path of its Offload(...).")
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise NotADirectoryError(f"Table {table.name!r}: its store path {self.path!r} is a file; Offload(...) "
                                     "takes a directory (one for each table).")
        try:
            os.makedirs(self.path, exist_ok=True)
            self._lock_file = _lock(table.name, self.path)
        except OSError as e:
            raise _not_writable(table.name, self.path, e) from e
        try:
            self._open(table)
        except BaseException as e:
            if self._lock_file is not None:
                self._lock_file.close()
            if isinstance(e, OSError):
                raise _not_writable(table.name, self.path, e) from e
            raise

    def _open(self, table: TableSpec) -> None:
        self.width = record_width(table)
        self.record_bytes = 4 * self.width
        shape = (table.vocabulary_size, self.width)
        os.makedirs(os.path.join(self.path, "records", "c", "0"), exist_ok=True)
        meta = self._open_meta(shape)
        self.step, self.commit, self.id = meta.get("step"), int(meta.get("commit", 0)), meta.get("id")
        # the commits it can go back to, oldest first, the last one the state of the last commit (`rollback_to`)
        self.history = list(meta.get("history") or [{"commit": self.commit, "id": self.id, "step": self.step}])
        self._written_crc = meta.get("written_crc32")  # the last commit's bitmap's (stores before it: none)
        self._records_path = os.path.join(self.path, "records", "c", "0", "0")
        self._records = open_mapped(self._records_path, shape, write=True)
        self.written = self._load_written()
        self._committed = self.written.copy()  # as of the last commit: what the undo log restores
        self._rolled_back = np.zeros(0, np.int64)  # rows the rollback restored: in the next commit's changes
        self._rollback()
        self._logged = np.zeros(self.table.vocabulary_size, bool)  # rows with an undo record since the commit
        self._undo = open(self._undo_path(self.commit + 1), "ab")
        self._log = WriteLog.create(os.path.join(self.path, LOG_NAME), self.width, table.vocabulary_size)
        self._lock = threading.Lock()  # `written`, the counters, and `_log` when a merge replaces it
        # the log is merged at each commit, and before then once it holds this much (disk: at most this on top)
        self.log_bytes = max(LOG_BYTES, shape[0] * self.record_bytes // 2)
        self.rows_read = self.rows_written = 0
        self._real = os.path.realpath(self.path)
        _OPEN[self._real] = _OPEN.get(self._real, 0) + 1

    def _open_meta(self, shape: tuple[int, int]) -> dict[str, Any]:
        """`tier.json`, checked against the table (a new store: created)."""
        meta_path = os.path.join(self.path, "tier.json")
        table = self.table
        if not os.path.exists(meta_path):
            left = sorted(os.path.relpath(os.path.join(d, n), self.path) for d, _, names in os.walk(self.path)
                          for n in names)
            left = [n for n in left if n not in ("lock", "tier.json.tmp", os.path.join("records", "zarr.json"))]
            if left:  # a store whose commit record is lost: starting it over would drop its trained rows, silently
                raise CorruptStoreError(f"Table {table.name!r}: the store at {self.path!r} has no tier.json (its "
                                        f"commit record) but holds a store's files ({', '.join(left[:4])}"
                                        f"{', ...' if len(left) > 4 else ''}): restore the directory from a backup or "
                                        "a checkpoint, or remove it to start the table over.")
            _write_json(os.path.join(self.path, "records", "zarr.json"), _zarr_json(shape))
            first = _new_id()
            meta = {**_spec_json(table), "step": None, "commit": 0, "id": first,
                    "history": [{"commit": 0, "id": first, "step": None}], **self._init_json()}
            _write_json(meta_path, meta)
            return meta
        try:
            with open(meta_path) as f:
                meta = json.load(f)
            if not isinstance(meta, dict):
                raise ValueError(f"a JSON {type(meta).__name__}, not an object")
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptStoreError(f"Table {table.name!r}: the store's tier.json at {meta_path!r} is damaged "
                                    f"({type(e).__name__}: {e}).") from None
        want = _spec_json(table)
        got = {k: meta.get(k, want[k] if k == "raw_ids" else None) for k in want}  # (raw_ids: older stores lack it)
        if got != want:
            diff = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
            raise CorruptStoreError(f"Table {table.name!r}: the store at {self.path!r} holds another table "
                                    f"(stored vs declared: {diff}).")
        stored = meta.get("init")
        if stored is not None and self._init is not None and stored != self._init:
            raise ValueError(f"Table {table.name!r}: the store at {self.path!r} was trained with another key or "
                             f"initializer (stored {stored}, given {self._init}): its rows never stored would be "
                             "generated otherwise than its training generated them. Pass the rng the training "
                             "used (Tiers(plan, rng), store_state(table, rng)) and the same initializer.")
        self._init = stored if stored is not None else self._init  # (a store written by write_store: the first)
        return meta

    def _init_json(self) -> dict[str, Any]:
        return {} if self._init is None else {"init": self._init}

    def _undo_path(self, commit: int) -> str:
        return os.path.join(self.path, f"undo.{commit}.log")

    def _written_path(self, commit: int) -> str:
        return os.path.join(self.path, f"written.{commit}.bin")

    def _write_changes(self, commit: int) -> None:
        """`changes.<commit>.npy`: the rows written since the last commit (and those the rollback restored), made
        durable before the commit point; the changes of commits older than the last `KEPT_CHANGES` are removed."""
        rows = np.union1d(np.flatnonzero(self._logged), self._rolled_back).astype(np.int64)
        with open(os.path.join(self.path, f"changes.{commit}.npy"), "wb") as f:
            np.save(f, rows)
            f.flush()
            os.fsync(f.fileno())
        for name in os.listdir(self.path):
            if 0 <= _numbered(name, "changes.", ".npy") <= commit - KEPT_CHANGES:
                os.remove(os.path.join(self.path, name))

    def _rollback(self) -> None:
        """Restores every row written since the last commit from the undo log and drops the write log (then
        deletes them, and any file no kept commit needs): the store is then exactly its last commit. Idempotent,
        so a crash here is harmless."""
        # a reader may have seen the newer records of the rows in either log: they go in the next commit's changes
        self._rolled_back = log_rows(os.path.join(self.path, LOG_NAME), self.width, self.table.vocabulary_size)
        path = self._undo_path(self.commit + 1)
        if os.path.exists(path):
            rows, records = _read_log(path, self.record_bytes)
            self._rolled_back = np.union1d(self._rolled_back, rows)
        saved = os.path.join(self.path, ROLLED_BACK_NAME)
        if os.path.exists(saved):  # an earlier opening's, never committed: its logs are gone, its rows are here
            self._rolled_back = np.union1d(self._rolled_back, np.load(saved).astype(np.int64))
        if self._rolled_back.size:  # durable before the logs that list them are deleted
            with open(saved + ".tmp", "wb") as f:
                np.save(f, self._rolled_back)
                f.flush()
                os.fsync(f.fileno())
            os.replace(saved + ".tmp", saved)
        if os.path.exists(path):
            keep = self._committed[rows]  # rows unwritten at the commit need nothing: the bitmap says so
            if keep.any():
                self._io(rows[keep], np.ascontiguousarray(records[keep]), write=True)
                self._records.sync()
        self._prune()

    def _prune(self) -> None:
        """Removes the undo logs and bitmaps that neither the last commit nor a kept one needs (and `changes` of
        commits after the last: a commit that never happened)."""
        keep = {f"written.{self.commit}.bin", *(f"written.{h['commit']}.bin" for h in self.history),
                *(f"undo.{h['commit']}.log" for h in self.history[1:])}
        for name in os.listdir(self.path):
            if (name.startswith(("undo.", "written.")) and name not in keep) or \
                    _numbered(name, "changes.", ".npy") > self.commit:
                os.remove(os.path.join(self.path, name))

    def _log_undo(self, rows: np.ndarray) -> None:
        """Appends the committed records of `rows` not yet logged since the commit, durably, before they are
        overwritten."""
        new = rows[~self._logged[rows]]
        was = new[self._committed[new]]
        if was.size:
            data = np.empty((was.size, self.width), np.float32)
            self._io(was, data, write=False)
            entries = np.empty((was.size, 8 + self.record_bytes), np.uint8)
            entries[:, :8] = was.astype(np.int64).view(np.uint8).reshape(-1, 8)
            entries[:, 8:] = data.view(np.uint8)
            whole = os.fstat(self._undo.fileno()).st_size  # (every earlier append was flushed)
            try:
                self._undo.write(entries.tobytes())
                self._undo.flush()
                os.fdatasync(self._undo.fileno())
            except OSError:
                self._cut_undo(whole)
                raise
        self._logged[new] = True

    def _cut_undo(self, size: int) -> None:
        """After a failed append (a full disk): the undo log cut back to its `size` bytes of whole entries and
        reopened without the bytes left unwritten in its buffer. A torn entry is harmless last (opening drops it),
        but a retried commit appends after it, and every later entry would be read shifted: garbage rows."""
        path = self._undo.name
        try:
            self._undo.close()  # (it tries its unwritten bytes again, which may fail again, or land: cut below)
        except OSError:
            pass
        os.truncate(path, size)
        self._undo = open(path, "ab")

    def _load_written(self, commit: int | None = None) -> np.ndarray:
        """bool `[V]`: the rows stored as of `commit` (default: the last)."""
        n, commit = self.table.vocabulary_size, self.commit if commit is None else commit
        path = self._written_path(commit)
        if not os.path.exists(path):
            if commit:
                raise CorruptStoreError(f"Table {self.table.name!r}: {path}, the rows stored as of commit "
                                        f"{commit}, is missing.")
            return np.zeros(n, bool)
        bits = np.fromfile(path, np.uint8)
        if bits.size != (n + 7) // 8:
            raise CorruptStoreError(f"Table {self.table.name!r}: {path} has {bits.size} bytes, expected "
                                    f"{(n + 7) // 8}.")
        meta = {"commit": self.commit, "written_crc32": self._written_crc, "history": self.history}
        _check_bits(self.table.name, path, bits, written_crc(meta, commit))
        return np.unpackbits(bits, count=n).astype(bool)

    def _io(self, rows: np.ndarray, data: np.ndarray, write: bool) -> None:
        self._records.move(rows, data, write)

    def _allocate(self, rows: np.ndarray) -> None:
        """Allocates the disk blocks of the records of sorted rows `rows` before they are written through the
        mapping: a row written for the first time fills a hole of the sparse records file, and on a full disk a
        page the mapping cannot get is a SIGBUS that kills the process (no error, no message). Here it is an
        OSError (ENOSPC); the store keeps its last commit (opening it rolls the merge back)."""
        if not rows.size:
            return
        page, size = mmap.PAGESIZE, self.table.vocabulary_size * self.record_bytes
        start = rows.astype(np.int64) * self.record_bytes // page * page
        end = np.minimum(-(-(rows.astype(np.int64) + 1) * self.record_bytes // page) * page, size)
        first = np.flatnonzero(np.r_[True, start[1:] > end[:-1]])  # one range per run of rows on adjacent pages
        fd = os.open(self._records_path, os.O_RDWR)
        try:
            for lo, hi in zip(start[first], np.maximum.reduceat(end, first)):
                os.posix_fallocate(fd, int(lo), int(hi - lo))
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):  # a file system that cannot preallocate: as before
                raise
        finally:
            os.close(fd)

    def read(self, rows: np.ndarray) -> np.ndarray:
        """`[n, width - 1]` float32 records (row, then slots) of stored rows `rows` (the newest: the write log's,
        else the records file's), checksums verified."""
        rows = np.asarray(rows, np.int64)
        data = np.empty((rows.size, self.width), np.float32)
        with self._lock:
            log = self._log  # a merge may replace it meanwhile: the old one's rows are in the records file by then
        _read_newest(log, self._io, rows, data)
        bad = _failing(data, rows)
        if bad.any():
            raise _corrupt_row(self.table.name, self.path, int(rows[int(np.argmax(bad))]))
        with self._lock:
            self.rows_read += rows.size
        return data[:, :-1]

    def write(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Writes records `values [n, width - 1]` (row, then slots) of distinct rows `rows`, with their checksums:
        appended to the write log, merged into the records file at the next commit (or when the log outgrows
        `log_bytes`). One writer at a time."""
        rows = np.asarray(rows, np.int64)
        data = np.empty((rows.size, self.width), np.float32)
        data[:, :-1] = values
        words = data.view(np.uint32)
        words[:, -1] = row_checksums(words[:, :-1], rows)
        self._log.append(rows, data)
        with self._lock:
            self.written[rows] = True
            self.rows_written += rows.size
        if self._log.bytes > self.log_bytes:
            self._merge()

    def _merge(self) -> None:
        """Writes each logged row's newest record into the records file (after its committed record goes to the
        undo log), then starts a new, empty log. All rows in row order, so that each page of the records file is
        written once and in file order (read ahead when it holds data)."""
        log = self._log
        rows = log.logged_rows()
        self._records.advise_sequential(True)
        try:
            for lo in range(0, rows.size, _MERGE_ROWS):
                part = rows[lo:lo + _MERGE_ROWS]
                records = np.empty((part.size, self.width), np.float32)
                log.read(part, records)
                self._log_undo(part)
                self._allocate(part[~self._committed[part]])  # the rows new to the records file
                self._io(part, records, write=True)
        finally:
            self._records.advise_sequential(False)
        self._replace_log().close()

    def commit_step(self, step: int | None) -> None:
        """Commits every write so far as the store's state at `step` (durably; the rename of `tier.json` is
        the commit point, after the bitmap and `changes.<commit>.npy`), and starts a new undo log. Call with no
        write in flight."""
        step = step_number(step)
        new = _new_id()
        try:
            self._commit(step, new,
                         (self.history + [{"commit": self.commit + 1, "id": new, "step": step}])[-KEPT_COMMITS:])
        except OSError as e:
            raise self.disk_full(e) from e

    def disk_full(self, e: OSError) -> OSError:
        """`e`, or for a full disk (or quota) an OSError naming the table and what to do: a commit (or a flush's
        write) that fails leaves the store at its last commit, and can be tried again once there is room."""
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            return e
        return OSError(e.errno, f"Table {self.table.name!r}: the store at {self.path!r} cannot take the rows written "
                                f"since its last commit ({e.strerror}); it keeps its last commit"
                                f"{'' if self.step is None else f' (step {self.step})'}. Free space on its disk and "
                                "flush again, or restore the last checkpoint.")

    def _commit(self, step: int | None, commit_id: str, history: list[dict]) -> None:
        self._merge()
        self._records.sync()
        with self._lock:
            bits = np.packbits(self.written)
        path = self._written_path(self.commit + 1)
        with open(path, "wb") as f:
            f.write(bits.tobytes())
            f.flush()
            os.fsync(f.fileno())
        crc = _crc(bits)
        if history[-1]["commit"] == self.commit + 1:  # a new commit (not a rollback to a kept one): its entry too
            history = history[:-1] + [{**history[-1], "written_crc32": crc}]
        self._write_changes(self.commit + 1)
        _write_json(os.path.join(self.path, "tier.json"), {**_spec_json(self.table), "step": step,
                                                           "commit": self.commit + 1, "id": commit_id,
                                                           "history": history, "written_crc32": crc,
                                                           **self._init_json()})
        self._written_crc = crc
        if os.path.exists(os.path.join(self.path, ROLLED_BACK_NAME)):  # the commit's changes list them now
            os.remove(os.path.join(self.path, ROLLED_BACK_NAME))
        # committed: files no kept commit needs are obsolete (a crash before their removal: removed on opening)
        self._undo.close()
        self.commit, self.step, self.id, self.history = self.commit + 1, step, commit_id, history
        self._prune()
        with self._lock:
            self._committed = self.written.copy()
        self._logged[:] = False
        self._rolled_back = np.zeros(0, np.int64)
        self._undo = open(self._undo_path(self.commit + 1), "ab")

    def rollback_to(self, commit_id: str) -> None:
        """Makes the store exactly its kept commit `commit_id` again, as a new commit (the later ones are gone;
        a reader sees the rows it restores change). Crash-safe: the rows are rewritten through the undo log, so
        a store killed meanwhile opens as it was. A CorruptStoreError if it does not keep that commit."""
        ids = [h["id"] for h in self.history]
        if commit_id == self.id:
            return
        if commit_id not in ids:
            raise CorruptStoreError(
                f"Table {self.table.name!r}: the store at {self.path!r} does not keep commit {commit_id!r}: it "
                f"keeps {[(h['commit'], h['step']) for h in self.history]} (commit, step), the last "
                f"{KEPT_COMMITS} (or another run has since replaced the store).")
        at = ids.index(commit_id)
        paths = [self._undo_path(h["commit"]) for h in self.history[at + 1:]] + [self._undo_path(self.commit + 1)]
        logs = [_read_log(p, self.record_bytes) for p in paths]  # the last: writes since the last commit
        # each row's record from the oldest log that has it: its value at the commit gone back to
        rows, first = np.unique(np.concatenate([r for r, _ in logs]), return_index=True)
        records = np.concatenate([d for _, d in logs])[first]
        bad = _failing(records, rows)
        if bad.any():
            raise _corrupt_row(self.table.name, self.path, int(rows[int(np.argmax(bad))]))
        written = self._load_written(self.history[at]["commit"])
        keep = written[rows]
        log = self._replace_log()  # writes since the last commit, never merged: their rows hold its records
        dropped = log.logged_rows()
        log.close()
        self.write(rows[keep], records[keep][:, :-1])
        gone = np.flatnonzero(self.written & ~written)  # rows it no longer holds: a reader drops them too
        with self._lock:
            self.written = written
        # (and the rows the opening rolled back: a reader may have cached their newer records too)
        self._rolled_back = np.union1d(np.union1d(rows, gone), np.union1d(dropped, self._rolled_back))
        self._commit(self.history[at]["step"], commit_id, self.history[:at + 1])

    def _replace_log(self) -> WriteLog:
        """Starts a new, empty write log; the old one, still open (a read that took it before finds its rows)."""
        log = self._log
        with self._lock:
            self._log = WriteLog.create(log.path, self.width, self.table.vocabulary_size)
        return log

    def close(self) -> None:
        """Closes the files; the write log stays for a reader until the store opens again (and drops it)."""
        if not self._undo.closed:
            _OPEN[self._real] -= 1
        self._undo.close()
        self._log.close()
        self._records.close()
        if self._lock_file is not None:
            self._lock_file.close()  # (and its lock)


def _not_writable(name: str, path: str, e: OSError) -> OSError:
    """`e`, or for a store that cannot be written (a read-only file system, no permission) an OSError naming the
    table and what to do: opening a store for training writes (its lock, its logs, the rollback to its last
    commit), also to read it whole (`store_state`)."""
    if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
        return e
    return OSError(e.errno, f"Table {name!r}: the store at {path!r} cannot be opened for training ({e.strerror}: "
                            f"{e.filename!r}): Tiers, store_state and write_store open it to write (its lock file, "
                            "its logs, the rollback to its last commit). Give its Offload(...) a writable directory "
                            "(a copy of the store); StoreServer serves a read-only store.")


def _lock(name: str, path: str):
    """The store's lock file, locked for the caller's lifetime (closing it unlocks); StoreInUseError naming the
    table if another `RowStore`, of this process or another, has the store open. A POSIX lock (`lockf`): a process
    forked meanwhile (a data loader's workers) does not inherit it, so it never outlives the store's close. It does
    not tell the RowStores of one process apart: `_OPEN` does. A file system without locks: not locked."""
    f = None if is_open(path) else open(os.path.join(path, "lock"), "a")
    try:
        if f is not None:
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EAGAIN):  # no locks on this file system (ENOLCK, EOPNOTSUPP)
            return f
        f.close()
    raise StoreInUseError(f"Table {name!r}: the store at {path!r} is open for training elsewhere (a Tiers, "
                          "store_state or write_store, in this process or another). Opening it again would roll it "
                          "back under that one: close it first (tiers.close()), or read it while it trains with "
                          "StoreServer.")


def init_record(table: TableSpec, key_words: Any) -> dict[str, Any] | None:
    """What a static table's never-stored rows are generated from (`tier.json`'s "init"): the words of its key
    (`core.tables.table_key`) and its initializer; None for a raw-id table (its new rows start from their ids and
    its map's seed, saved with the map)."""
    if table.dynamic is not None:
        return None
    return {"key": [int(w) for w in np.asarray(key_words).ravel()], "initializer": repr(table.resolved_initializer)}


def _crc(bits: np.ndarray) -> str:
    return f"{zlib.crc32(bits.tobytes()):08x}"


def written_crc(meta: dict[str, Any], commit: int) -> str | None:
    """The CRC32 `tier.json` (`meta`) records for commit `commit`'s bitmap; None if none (a store from before
    bitmaps had one, or a commit it no longer lists)."""
    if commit == meta.get("commit"):
        return meta.get("written_crc32")
    return next((h.get("written_crc32") for h in meta.get("history") or () if h.get("commit") == commit), None)


def _check_bits(table: str, path: str, bits: np.ndarray, want: str | None) -> None:
    if want is not None and _crc(bits) != want:
        raise CorruptStoreError(f"Table {table!r}: {path}, which rows the store holds, fails its checksum "
                                f"(CRC32 {_crc(bits)}, tier.json says {want}): the store is damaged; restore it from "
                                "a checkpoint or a copy.")


def step_number(step: Any) -> int | None:
    """A commit's step as a Python int (from a Python, numpy or jax integer scalar; None: none); TypeError else,
    before anything is written."""
    if step is None:
        return None
    a = np.asarray(step)
    if a.shape != () or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"A commit's step must be an integer (int, or a numpy/jax integer scalar), got {step!r}.")
    if int(a) < 0:
        raise ValueError(f"A commit's step must be >= 0 (as a checkpoint's), got {int(a)}.")
    return int(a)


def is_open(path: str) -> bool:
    """Whether a `RowStore` of this process has the store at `path` open."""
    return _OPEN.get(os.path.realpath(path), 0) > 0


def _new_id() -> str:
    return os.urandom(8).hex()


def _read_log(path: str, record_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """`(rows int64 [n], records float32 [n, width])` of an undo log, each row's first (oldest) entry; a torn
    last entry is dropped (its row's write never followed it)."""
    entry = 8 + record_bytes
    raw = np.fromfile(path, np.uint8)
    n = raw.size // entry
    raw = raw[:n * entry].reshape(n, entry)
    rows = raw[:, :8].copy().view(np.int64)[:, 0]
    rows, first = np.unique(rows, return_index=True)
    return rows, raw[first, 8:].copy().view(np.float32)


class StoreReader:
    """An existing store, opened read-only (serving): it never rolls back, writes, truncates or creates a file.

    It needs no `TableSpec`: `tier.json` says what the table is. `read_records` returns each row's newest record,
    which may be a write-back newer than the last commit (in the training side's write log, which it follows, or
    merged into the records file); a record caught in the middle of a write fails its checksum, and the caller
    reads it again.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        if not os.path.exists(os.path.join(self.path, "tier.json")):
            shards = stored_shards(self.path)
            if shards:  # several processes' stores of one table: rows r % P in process<i>of<P>
                raise ValueError(f"The store at {self.path!r} was written by {shards} processes (each keeps its "
                                 "rows in process<i>of<P>/): serving reads a store of one process; rewrite it as one "
                                 "with sparse_embed.offload.store_state and write_store.")
            raise FileNotFoundError(f"No offloaded table's store at {self.path!r} (it has no tier.json).")
        try:
            meta = self.meta()
            if meta.get("format") != FORMAT:
                raise CorruptStoreError(f"The store at {self.path!r} has format {meta.get('format')!r}, not "
                                        f"{FORMAT!r}.")
            self.table, self.vocabulary_size = str(meta["table"]), int(meta["vocabulary_size"])
            self.raw_ids: bool | None = meta.get("raw_ids")  # keyed by raw ids (None: a store from before it was said)
            self.embedding_dim, self.slots = int(meta["embedding_dim"]), {k: int(w) for k, w in meta["slots"].items()}
            with open(os.path.join(self.path, "records", "zarr.json")) as f:
                shape = tuple(json.load(f)["shape"])
        except CorruptStoreError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # (json's errors are ValueErrors)
            raise CorruptStoreError(f"The store at {self.path!r}: its tier.json or records/zarr.json is damaged "
                                    f"({type(e).__name__}: {e}); restore the store from a copy.") from None
        self.width = self.embedding_dim + sum(self.slots.values()) + 1
        self.record_bytes = 4 * self.width
        if shape != (self.vocabulary_size, self.width):
            raise CorruptStoreError(f"Table {self.table!r}: the records at {self.path!r} have shape {shape}, but "
                                    f"tier.json says {(self.vocabulary_size, self.width)}.")
        records = os.path.join(self.path, "records", "c", "0", "0")
        if os.path.getsize(records) < 4 * self.vocabulary_size * self.width:
            raise CorruptStoreError(f"Table {self.table!r}: the records file {records!r} holds "
                                    f"{os.path.getsize(records)} bytes, less than its {self.vocabulary_size} rows of "
                                    f"{self.record_bytes}: it was cut short; restore the store from a copy.")
        self._records = open_mapped(records, shape, write=False)
        self._inode = os.stat(records).st_ino  # (`replaced`)
        self._log: WriteLog | None = None  # the training side's write log, as far as followed
        self._follow_lock = threading.Lock()

    def replaced(self) -> bool:
        """Whether the records file at the path is no longer the one mapped (another run's store made there)."""
        try:
            return os.stat(os.path.join(self.path, "records", "c", "0", "0")).st_ino != self._inode
        except FileNotFoundError:
            return True

    def meta(self) -> dict[str, Any]:
        """`tier.json` as it is now (replaced whole at each commit, so never read half-written)."""
        with open(os.path.join(self.path, "tier.json")) as f:
            return json.load(f)

    def written_bits(self, commit: int) -> np.ndarray:
        """The rows stored as of `commit`, a bit per row (`np.packbits` order: row r is bit `7 - r % 8` of byte
        `r // 8`). FileNotFoundError when a later commit has removed that commit's bitmap."""
        path = os.path.join(self.path, f"written.{commit}.bin")
        n = (self.vocabulary_size + 7) // 8
        if commit == 0 and not os.path.exists(path):
            return np.zeros(n, np.uint8)
        bits = np.fromfile(path, np.uint8)
        if bits.size != n:
            raise CorruptStoreError(f"Table {self.table!r}: {path} has {bits.size} bytes, expected {n}.")
        _check_bits(self.table, path, bits, written_crc(self.meta(), commit))
        return bits

    def changes(self, commit: int) -> np.ndarray | None:
        """int64 rows written between commits `commit - 1` and `commit`; None when the store no longer keeps them
        (only the last `KEPT_CHANGES` commits') or never wrote them."""
        try:
            rows = np.load(os.path.join(self.path, f"changes.{commit}.npy"))
        except (FileNotFoundError, ValueError, EOFError):  # removed by a later commit (or being removed)
            return None
        return rows.astype(np.int64, copy=False)

    def read_records(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`(records [n, width] float32 with the checksum last, bad [n] bool)`: rows `rows` as the file holds them
        now, and which fail their checksum (damaged, never written, or caught mid-write)."""
        rows = np.asarray(rows, np.int64)
        data = np.empty((rows.size, self.width), np.float32)
        _read_newest(self._follow(), self._records.move, rows, data)
        return data, _failing(data, rows)

    def _follow(self) -> WriteLog | None:
        """The training side's write log with the entries appended so far indexed (a new log, after a merge or a
        restart: followed from its start; none: the records file holds every row)."""
        path = os.path.join(self.path, LOG_NAME)
        with self._follow_lock:
            try:
                ino = os.stat(path).st_ino
            except FileNotFoundError:
                ino = None
            if self._log is not None and self._log.ino != ino:
                self._log.close()
                self._log = None
            if self._log is None and ino is not None:
                self._log = WriteLog.open(path, self.width, self.vocabulary_size)
            if self._log is not None:
                self._log.follow(_failing)
            return self._log

    def read(self, rows: np.ndarray) -> np.ndarray:
        """`[n, width - 1]` float32 records (row, then slots) of rows `rows`, checksums verified (as RowStore.read)."""
        data, bad = self.read_records(rows)
        if bad.any():
            raise _corrupt_row(self.table, self.path, int(np.asarray(rows)[int(np.argmax(bad))]))
        return data[:, :-1]

    def close(self) -> None:
        self._records.close()
        if self._log is not None:
            self._log.close()
