"""An offloaded table's write log (`tiers.rows_file`): write-backs are appended, not written in place; reads return
each row's newest record (checked against a plain dict of the rows written); a commit, or a log past `log_bytes`,
merges it into the records file (read here with plain numpy); a serving reader follows it (across merges and
restarts) and never indexes a torn entry; a damaged entry is an error naming the table and the row."""

from __future__ import annotations

import os

import numpy as np
import pytest

import sparse_embed as se
from sparse_embed.tiers.rows_file import LOG_NAME, WriteLog
from sparse_embed.tiers.store import CorruptStoreError, RowStore, StoreReader, row_checksums

V, D = 500, 4
WIDTH = 2 * D + 1  # Adagrad: row, accumulator, checksum


def _spec(path: str) -> se.TableSpec:
    return se.TableSpec("items", V, D, optimizer=se.optimizers.Adagrad(0.1), storage=se.offload.Offload(path, 10))


def _records_file(path: str) -> np.ndarray:
    """`[V, WIDTH]` float32: the records file as it is on disk."""
    return np.fromfile(os.path.join(path, "records", "c", "0", "0"), np.float32).reshape(V, WIDTH)


def _writes(seed: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`count` writes `(distinct rows, values [n, 2D])`; rows repeat across writes."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        rows = rng.choice(V, int(rng.integers(1, 60)), replace=False)
        out.append((rows, rng.standard_normal((rows.size, 2 * D)).astype(np.float32)))
    return out


@pytest.mark.parametrize("log_bytes", [1 << 40, 3000])  # merged at commits only; also between them
def test_reads_return_the_newest_write_and_a_commit_merges_the_log(tmp_path, log_bytes):
    path = str(tmp_path)
    store = RowStore(_spec(path))
    store.log_bytes = log_bytes
    newest: dict[int, np.ndarray] = {}
    committed = _records_file(path).copy()
    for i, (rows, values) in enumerate(_writes(0, 30)):
        store.write(rows, values)
        newest.update(zip(rows.tolist(), values))
        seen = np.array(sorted(newest))
        np.testing.assert_array_equal(store.read(seen), np.stack([newest[r] for r in seen]))
        if log_bytes > 1 << 30:  # nothing is written in place between commits
            np.testing.assert_array_equal(_records_file(path), committed)
        assert os.path.getsize(os.path.join(path, LOG_NAME)) <= max(log_bytes, 0) + 60 * (8 + 4 * WIDTH)
        if i % 10 == 9:
            store.commit_step(i)
            assert os.path.getsize(os.path.join(path, LOG_NAME)) == 0
            committed = _records_file(path).copy()
            np.testing.assert_array_equal(committed[seen, :-1], np.stack([newest[r] for r in seen]))
            words = committed.view(np.uint32)
            np.testing.assert_array_equal(words[seen, -1], row_checksums(words[seen, :-1], seen))
    np.testing.assert_array_equal(np.flatnonzero(store.written), np.array(sorted(newest)))
    store.close()


def test_a_reopened_store_drops_the_log_and_lists_its_rows_as_changed(tmp_path):
    path = str(tmp_path)
    store = RowStore(_spec(path))
    (rows, values), (later, newer) = _writes(1, 2)
    store.write(rows, values)
    store.commit_step(1)
    store.write(later, newer)  # never committed
    store.close()
    again = RowStore(_spec(path))
    np.testing.assert_array_equal(again.read(rows), values)
    assert not again.written[np.setdiff1d(later, rows)].any()
    again.commit_step(2)
    np.testing.assert_array_equal(np.load(os.path.join(path, "changes.2.npy")), np.sort(later))
    again.close()


def test_a_reader_follows_the_log_across_merges_and_restarts(tmp_path):
    path = str(tmp_path)
    store = RowStore(_spec(path))
    writes = _writes(2, 4)
    store.write(*writes[0])
    store.commit_step(1)
    reader = StoreReader(path)
    for rows, values in writes[1:3]:
        store.write(rows, values)  # in the log only
        np.testing.assert_array_equal(reader.read(rows), values)
    store.log_bytes = 0
    store.write(*writes[3])  # merged at once: a new, empty log
    assert os.path.getsize(os.path.join(path, LOG_NAME)) == 0
    np.testing.assert_array_equal(reader.read(writes[3][0]), writes[3][1])
    store.log_bytes = 1 << 40
    store.write(writes[3][0], -writes[3][1])
    np.testing.assert_array_equal(reader.read(writes[3][0]), -writes[3][1])
    store.close()  # a restart: rolled back to commit 1
    again = RowStore(_spec(path))
    np.testing.assert_array_equal(reader.read(writes[0][0]), writes[0][1])
    np.testing.assert_array_equal(reader.read(writes[0][0]), again.read(writes[0][0]))
    reader.close()
    again.close()


def test_a_reader_never_indexes_a_torn_entry(tmp_path):
    path = str(tmp_path)
    store = RowStore(_spec(path))
    store.write(np.array([3]), np.ones((1, 2 * D), np.float32))
    store.commit_step(1)
    store.write(np.array([5]), np.full((1, 2 * D), 2.0, np.float32))  # entry 0 of the log
    entry = np.zeros(2 + WIDTH, np.uint32)
    entry[:2] = np.array([3], "<i8").view(np.uint32)
    record = np.full((1, WIDTH), 7.0, np.float32)
    record.view(np.uint32)[0, -1] = row_checksums(record.view(np.uint32)[:, :-1], np.array([3]))[0]
    entry[2:] = record.view(np.uint32)[0]
    with open(os.path.join(path, LOG_NAME), "ab") as f:  # half of entry 1 (row 3): caught mid-append
        f.write(entry.tobytes()[:-8])
        f.flush()
        reader = StoreReader(path)
        np.testing.assert_array_equal(reader.read(np.array([3, 5]))[:, 0], [1.0, 2.0])
        f.write(b"\0" * 8)  # the entry's last word zeroed: it fails its checksum, and stays unindexed
        f.flush()
        np.testing.assert_array_equal(reader.read(np.array([3, 5]))[:, 0], [1.0, 2.0])
    reader.close()
    store.close()
    log = WriteLog.open(os.path.join(path, LOG_NAME), WIDTH, V)
    assert log.count == 0 and [e.shape[0] for _, e in log.scan()] == [2]
    log.close()


def test_a_damaged_log_entry_is_a_corrupt_store_error_naming_the_table_and_row(tmp_path):
    path = str(tmp_path)
    store = RowStore(_spec(path))
    store.write(np.array([8, 9]), np.ones((2, 2 * D), np.float32))
    with open(os.path.join(path, LOG_NAME), "r+b") as f:
        f.seek((8 + 4 * WIDTH) + 8 + 4)  # entry 1 (row 9), its second value
        f.write(b"\x01")
    np.testing.assert_array_equal(store.read(np.array([8])), np.ones((1, 2 * D)))
    with pytest.raises(CorruptStoreError, match=r"Table 'items': row 9 of the store at .* fails its checksum"):
        store.read(np.array([8, 9]))
    store.close()


def test_an_append_a_full_disk_cuts_short_keeps_the_whole_entries_a_reader_may_have_seen(tmp_path, monkeypatch):
    """A full disk cut an append short: whole entries, a torn one, then ENOSPC. The torn one must go (an append
    after it would shift every later entry), but a serving reader may have indexed the whole ones meanwhile:
    cutting the file back before them left its index on other rows' entries (or past the end of the file: a
    SIGBUS through its mapping). They stay: the store and that reader read each row's newest record."""
    path = str(tmp_path)
    store = RowStore(_spec(path))
    writes = _writes(7, 3)
    store.write(*writes[0])
    store.commit_step(1)
    reader = StoreReader(path)
    write, log = os.write, {"fd": store._log.fd}

    def full(fd, data):  # a short write (3.5 entries), the reader follows the log, then the disk is full
        if fd != log.get("fd"):
            return write(fd, data)
        if "wrote" in log:
            del log["fd"]
            reader._follow()
            raise OSError(28, "No space left on device")
        log["wrote"] = write(fd, bytes(data)[:store._log.entry_bytes * 7 // 2])
        return log["wrote"]

    monkeypatch.setattr(os, "write", full)
    rows, values = writes[1]
    assert rows.size > 4
    with pytest.raises(OSError, match="No space left on device"):
        store.write(rows, values)
    store.write(*writes[2])  # (there is room again)
    want = {int(r): v for r, v in zip(*writes[0])}
    want.update({int(r): v for r, v in zip(rows[:3], values[:3])})  # the whole entries written
    want.update({int(r): v for r, v in zip(*writes[2])})
    at = np.array(sorted(want))
    expect = np.stack([want[r] for r in at.tolist()])
    np.testing.assert_array_equal(reader.read(at), expect)
    np.testing.assert_array_equal(store.read(at), expect)
    assert os.path.getsize(os.path.join(path, LOG_NAME)) == store._log.count * store._log.entry_bytes
    reader.close()
    store.close()
