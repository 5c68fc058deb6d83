"""Serving from an offloaded table's store (`StoreServer`, `load_parameter_server`): lookups equal the store's rows
(read here with plain numpy from the zarr chunk and the written bitmap), rows never written read the default, hits
and misses are counted exactly, a small cache evicts, refresh picks up a training run's next commit, a torn row is
read again and never served, a damaged one is an error naming the table, and the config's errors name the model
and table."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparse_embed as se
from sparse_embed.tiers import serving
from sparse_embed.tiers.store import KEPT_CHANGES, CorruptStoreError, RowStore, row_checksums
from tests.conftest import make_mesh

V, D, B, L, CACHE = 3000, 8, 32, 4, 120
WIDTH = 2 * D + 1  # Adagrad: row, accumulator, checksum


def _spec(path: str, vocab: int = V, name: str = "items") -> se.TableSpec:
    return se.TableSpec(name, vocab, D, optimizer=se.optimizers.Adagrad(0.1), combiner="sum",
                        storage=se.offload.Offload(path, cache_rows=CACHE))


class Trainer:
    """A small offloaded table trained in this process; `flush` commits its store."""

    def __init__(self, path: str) -> None:
        self.plan = plan = se.plan([se.FeatureSpec("f", _spec(path), B)], make_mesh(1))
        rng = jax.random.key(0)
        self.tables, self.tiers = se.init_tables(plan, rng), se.offload.Tiers(plan, rng)
        cot = jnp.cos(jnp.arange(B * D, dtype=jnp.float32).reshape(B, D))
        self.step_fn = jax.jit(jax.grad(lambda t, b, s: jnp.sum(se.lookup(plan, b, t, s)["f"] * cot)),
                               donate_argnums=0)
        self.data, self.step = np.random.default_rng(7), 0

    def train(self, steps: int) -> None:
        for _ in range(steps):
            ids = {"f": (self.data.zipf(1.3, (B, L)) * 7919 % V).astype(np.int64)}
            batch, _, swap = self.tiers.preprocess(ids)
            self.tables = self.step_fn(self.tiers.swap(self.tables, swap), batch, self.step)
            self.step += 1
        self.tables = self.tiers.flush(self.tables, step=self.step)


def reference(path: str, vocab: int = V) -> tuple[np.ndarray, np.ndarray]:
    """`(embeddings [vocab, D], written [vocab] bool)` of the store's last commit, read with numpy alone."""
    with open(os.path.join(path, "tier.json")) as f:
        commit = json.load(f)["commit"]
    records = np.fromfile(os.path.join(path, "records", "c", "0", "0"), np.float32).reshape(vocab, WIDTH)
    written = np.unpackbits(np.fromfile(os.path.join(path, f"written.{commit}.bin"), np.uint8), count=vocab)
    return records[:, :D].copy(), written.astype(bool)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("serving") / "store")
    trainer = Trainer(path)
    trainer.train(6)
    yield path, trainer
    trainer.tiers.close()


_OPEN: list[RowStore] = []


@pytest.fixture(autouse=True)
def _close_stores():
    yield
    while _OPEN:
        _OPEN.pop().close()


def _row_store(path: str, rows: np.ndarray, values: np.ndarray | None = None, vocab: int = 200,
               name: str = "items") -> RowStore:
    """A store of table `name` written directly: `rows` with `values [n, 2D]` (default: row + column / 100),
    committed; closed after the test."""
    store = RowStore(_spec(path, vocab, name))
    _OPEN.append(store)
    _write(store, rows, values)
    return store


def _write(store: RowStore, rows, values=None, step: int | None = None) -> None:
    rows = np.asarray(rows, np.int64)
    if values is None:
        values = rows[:, None] + np.arange(2 * D, dtype=np.float32) / 100
    store.write(rows, np.asarray(values, np.float32))
    store.commit_step(step)


def test_lookups_equal_the_stored_rows_and_rows_never_written_read_the_default(trained):
    path, _ = trained
    want, written = reference(path)
    assert 0 < written.sum() < V
    ids = np.random.default_rng(0).integers(-1, V, (50, 7))
    for default in (0.0, 2.5, np.arange(D) / 10):
        with se.offload.StoreServer(path, cache_bytes=1 << 20, default=default) as server:
            got = server.lookup(ids)
            assert got.shape == (50, 7, D) and got.dtype == np.float32
            expect = np.where(written[ids][..., None], want[ids], np.float32(np.broadcast_to(default, (D,))))
            expect[ids == -1] = 0.0
            np.testing.assert_array_equal(got, expect)
            np.testing.assert_array_equal(server.lookup(ids), expect)  # now from the cache
            s = server.stats()
            assert s.not_found == 2 * (~written[ids] & (ids >= 0)).sum() and s.padding == 2 * (ids == -1).sum()
            assert s.commit == 1 and s.step == 6 and s.cached_rows == np.unique(ids[(ids >= 0) & written[ids]]).size
            assert server.cache.capacity == V  # 1 MiB holds more rows than the table has: no memory for them


def test_hits_misses_and_reads_are_counted_exactly(tmp_path):
    store = _row_store(str(tmp_path), np.array([3, 4, 5, 9]))
    server = se.offload.StoreServer(str(tmp_path), refresh_seconds=None)
    server.lookup(np.array([3, 4, 3, 7, -1]))  # 7 never written
    s = server.stats()
    assert (s.lookups, s.hits, s.misses, s.not_found, s.padding, s.rows_read) == (4, 0, 3, 1, 1, 2)
    assert s.bytes_read == 2 * WIDTH * 4 and s.cached_rows == 2
    server.lookup(np.array([3, 4, 5, 5, 9, 7]))
    s = server.stats()
    assert (s.lookups, s.hits, s.misses, s.not_found, s.rows_read, s.cached_rows) == (10, 2, 6, 2, 4, 4)
    assert s.hit_rate == 2 / 8 and s.evictions == 0 and s.refreshes == 0
    np.testing.assert_array_equal(server.lookup(np.array([9]))[0], (9 + np.arange(D) / 100).astype(np.float32))
    server.close()
    store.close()


def test_a_cache_smaller_than_the_ids_evicts_by_clock_and_serves_the_right_rows(tmp_path):
    rows = np.arange(0, 200, 3)
    store = _row_store(str(tmp_path), rows)
    want, written = reference(str(tmp_path), 200)
    two_rows = 2 * (4 * D + 9)
    server = se.offload.StoreServer(str(tmp_path), cache_bytes=two_rows, refresh_seconds=None)
    for ids in ([0], [3], [0], [6], [0], [3], [0]):  # 0 is used between misses: its second chance keeps it
        server.lookup(np.array(ids))
    s = server.stats()
    assert (s.hits, s.misses, s.evictions, s.cached_rows) == (3, 4, 2, 2)
    ids = np.random.default_rng(1).integers(0, 200, (30, 64))
    for batch in ids:  # every batch reads more distinct rows than the cache holds
        np.testing.assert_array_equal(server.lookup(batch), np.where(written[batch, None], want[batch], 0.0))
    s = server.stats()
    assert s.cached_rows == 2 and s.evictions > 30 and s.hits + s.misses + s.not_found == s.lookups
    none = se.offload.StoreServer(str(tmp_path), cache_bytes=0)  # no cache at all
    np.testing.assert_array_equal(none.lookup(ids[0]), np.where(written[ids[0], None], want[ids[0]], 0.0))
    assert none.stats().cached_rows == 0
    store.close()


def test_refresh_picks_up_the_next_commit_and_never_serves_a_stale_cached_row(tmp_path):
    path = str(tmp_path / "store")
    trainer = Trainer(path)
    trainer.train(4)
    before, written_before = reference(path)
    ids = np.arange(V)
    manual = se.offload.StoreServer(path, refresh_seconds=None)
    auto = se.offload.StoreServer(path, refresh_seconds=0)  # checks at every lookup
    for server in (manual, auto):
        np.testing.assert_array_equal(server.lookup(ids), np.where(written_before[:, None], before, 0.0))
    trainer.train(4)
    after, written_after = reference(path)
    changed = np.flatnonzero((after != before).any(1) | (written_after != written_before))
    assert changed.size and (written_after & ~written_before).any()  # rows changed, and rows newly written
    np.testing.assert_array_equal(manual.lookup(ids), np.where(written_before[:, None], before, 0.0))  # cached
    assert manual.refresh() and not manual.refresh()
    written_since = np.load(os.path.join(path, "changes.2.npy"))
    assert np.isin(changed, written_since).all()
    for server in (manual, auto):
        np.testing.assert_array_equal(server.lookup(ids), np.where(written_after[:, None], after, 0.0))
        s = server.stats()
        assert s.refreshes == 1 and s.commit == 2 and s.step == 8
        assert s.invalidated == written_before[written_since].sum() < written_before.sum()  # only those rows
    trainer.tiers.close()


def test_many_misses_are_read_on_several_threads_with_their_checksums_checked(tmp_path):
    path = str(tmp_path)
    _row_store(path, np.arange(0, 4000, 2), vocab=4000)
    want, written = reference(path, 4000)
    ids = np.random.default_rng(2).permutation(4000)
    with se.offload.StoreServer(path, read_threads=4, refresh_seconds=None) as server:
        np.testing.assert_array_equal(server.lookup(ids), np.where(written[ids, None], want[ids], 0.0))
        assert server.stats().rows_read == 2000 and server.stats().read_seconds > 0
    with open(os.path.join(path, "records", "c", "0", "0"), "r+b") as f:
        f.seek(3002 * WIDTH * 4)
        f.write(b"\x01")
    with se.offload.StoreServer(path, read_threads=4, retries=1, retry_seconds=0) as server:
        with pytest.raises(CorruptStoreError, match="row 3002 "):
            server.lookup(ids)


def test_a_server_that_missed_more_commits_than_kept_drops_its_whole_cache(tmp_path):
    path = str(tmp_path)
    store = _row_store(path, np.arange(10))
    server = se.offload.StoreServer(path, refresh_seconds=None)
    server.lookup(np.arange(10))
    _write(store, [2, 50], np.full((2, 2 * D), -1.0))  # commit 2 changes cached row 2
    assert server.refresh() and server.stats().invalidated == 1  # only row 2 dropped
    np.testing.assert_array_equal(np.load(os.path.join(path, "changes.2.npy")), [2, 50])
    np.testing.assert_array_equal(server.lookup(np.array([2, 3, 50]))[:, 0], [-1.0, 3.0, -1.0])
    _write(store, [4], np.full((1, 2 * D), -2.0))  # then more commits than the store keeps
    for i in range(KEPT_CHANGES + 1):
        _write(store, [100 + i])
    kept = sorted(int(n.split(".")[1]) for n in os.listdir(path) if n.startswith("changes."))
    assert kept == list(range(store.commit - KEPT_CHANGES + 1, store.commit + 1))
    assert server.refresh() and server.stats().invalidated == 1 + 11  # every cached row dropped
    np.testing.assert_array_equal(server.lookup(np.array([4, 5, 108]))[:, 0], [-2.0, 5.0, 108.0])
    store.close()


def test_rows_a_restarted_trainer_rolls_back_are_dropped_at_its_next_commit(tmp_path):
    path = str(tmp_path)
    store = _row_store(path, np.arange(10))
    store.write(np.array([1, 2]), np.full((2, 2 * D), -5.0, np.float32))  # written back, never committed
    server = se.offload.StoreServer(path, refresh_seconds=None)
    np.testing.assert_array_equal(server.lookup(np.array([1, 2, 3]))[:, 0], [-5.0, -5.0, 3.0])  # the newest
    store.close()  # the trainer dies; its next run rolls rows 1 and 2 back, then commits
    again = _row_store(path, np.array([50]))
    np.testing.assert_array_equal(np.load(os.path.join(path, "changes.2.npy")), [1, 2, 50])
    assert server.refresh() and server.stats().invalidated == 2
    np.testing.assert_array_equal(server.lookup(np.array([1, 2, 3, 50]))[:, 0], [1.0, 2.0, 3.0, 50.0])
    assert again.commit == 2


def test_lookups_go_on_while_a_writer_writes_and_commits_and_never_see_a_mixed_row(tmp_path):
    path, rows = str(tmp_path), np.arange(64)
    store = _row_store(path, rows, np.zeros((64, 2 * D)) + rows[:, None] / 1000)  # version 0
    server = se.offload.StoreServer(path, cache_bytes=20 * (4 * D + 9), refresh_seconds=0, retry_seconds=0.0005)
    stop, seen, errors = threading.Event(), [], []

    def read():
        try:
            while not stop.is_set():
                ids = np.random.default_rng(len(seen)).integers(0, 64, 40)
                seen.append((ids, server.lookup(ids)))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    for version in range(1, 41):
        store.write(rows, np.full((64, 2 * D), version, np.float32) + rows[:, None] / 1000)
        if version % 4 == 0:
            store.commit_step(version)
        time.sleep(0.002)
    stop.set()
    reader.join()
    assert not errors, errors
    ids, got = np.concatenate([i for i, _ in seen]), np.concatenate([g for _, g in seen])
    assert len(seen) > 10 and (got == got[:, :1]).all()  # every row whole: one version in every column
    versions = got[:, 0] - ids / 1000
    np.testing.assert_allclose(versions, np.round(versions), atol=1e-4)
    assert 0 <= np.round(versions).min() and np.round(versions).max() <= 40 and server.stats().refreshes >= 5
    server.refresh()
    np.testing.assert_allclose(server.lookup(rows)[:, 0], 40 + rows / 1000, rtol=1e-6)
    store.close()


def _record(row: int, values: np.ndarray) -> tuple[bytes, int]:
    """A whole record of `values` for `row` (checksum included), and the file offset of the row."""
    record = np.zeros((1, WIDTH), np.float32)
    record[0, :-1] = values
    words = record.view(np.uint32)
    words[:, -1] = row_checksums(words[:, :-1], np.array([row]))
    return record.tobytes(), row * WIDTH * 4


def test_a_row_caught_mid_write_is_read_again_and_never_served_torn(tmp_path):
    path = str(tmp_path)
    store = _row_store(path, np.arange(20))
    server = se.offload.StoreServer(path, refresh_seconds=None, retry_seconds=0.002, retries=8)
    new = np.full(2 * D, 7.5, np.float32)
    record, at = _record(11, new)
    fd = os.open(os.path.join(path, "records", "c", "0", "0"), os.O_WRONLY)
    os.pwrite(fd, record[:len(record) // 2], at)  # the writer is half way through row 11

    def finish():
        time.sleep(0.03)
        os.pwrite(fd, record, at)

    writer = threading.Thread(target=finish)
    writer.start()
    got = server.lookup(np.array([10, 11, 12]))
    writer.join()
    os.close(fd)
    np.testing.assert_array_equal(got[1], new[:D])  # the whole new record, never half of it
    np.testing.assert_array_equal(got[[0, 2], 0], [10.0, 12.0])
    assert server.stats().retries >= 1
    store.close()


def test_a_damaged_row_is_a_corrupt_store_error_naming_the_table_and_row(tmp_path):
    path = str(tmp_path)
    store = _row_store(path, np.arange(20), name="t")
    with open(os.path.join(path, "records", "c", "0", "0"), "r+b") as f:
        f.seek(17 * WIDTH * 4 + 8)
        f.write(b"\xff\xff\xff\xff")
    server = se.offload.StoreServer(path, refresh_seconds=None, retry_seconds=0.0001, retries=3)
    np.testing.assert_array_equal(server.lookup(np.array([16]))[0, 0], 16.0)
    with pytest.raises(CorruptStoreError, match=r"Table 't': row 17 of the store .* after 3 re-reads"):
        server.lookup(np.array([16, 17]))
    config = {"models": {"m": {"t": {"store": path}}}}
    with pytest.raises(CorruptStoreError, match=r"Model 'm', table 't': row 17"):
        se.offload.load_parameter_server(config).lookup("m", "t", np.array([17]))
    store.close()


def test_a_damaged_or_cut_store_is_a_corrupt_store_error_naming_it(tmp_path):
    """A records file cut short, or a tier.json that is not JSON or lacks a field: CorruptStoreError naming the
    store (not mmap's, json's or a KeyError)."""
    for case in ("cut", "not_json", "no_table"):
        path = str(tmp_path / case)
        _row_store(path, np.arange(5)).close()
        if case == "cut":
            os.truncate(os.path.join(path, "records", "c", "0", "0"), 100)
            match = r"Table 'items': the records file .* holds 100 bytes, less than its 200 rows .* cut short"
        else:
            meta = os.path.join(path, "tier.json")
            with open(meta) as f:
                text = "{" if case == "not_json" else json.dumps({k: v for k, v in json.load(f).items()
                                                                 if k != "table"})
            with open(meta, "w") as f:
                f.write(text)
            match = r"The store at .*: its tier.json or records/zarr.json is damaged \((JSONDecodeError|KeyError)"
        with pytest.raises(CorruptStoreError, match=match):
            se.offload.StoreServer(path)


def test_a_raw_id_tables_store_is_refused_even_without_its_id_map(tmp_path):
    """Its rows belong to its id map's ids: read as rows by id, they would serve other ids' vectors. tier.json
    says the table is keyed by raw ids, so a store whose idmap files were lost is refused too; and an empty list
    of ids is an empty lookup."""
    path = str(tmp_path / "raw")
    store = RowStore(dataclasses.replace(_spec(path), dynamic=se.Dynamic()))
    _write(store, np.arange(3))
    store.close()
    assert not any(n.startswith("idmap.") for n in os.listdir(path))
    with pytest.raises(ValueError, match=r"Table 'items' \(store .*\) is keyed by raw ids") as e:
        se.offload.StoreServer(path)
    assert "is not done yet" in str(e.value)  # (it advised an in-memory table's export, which cannot be made)
    with se.offload.StoreServer(_row_store(str(tmp_path / "rows"), np.arange(3)).path) as server:
        assert server.lookup([]).shape == (0, D)


def test_serving_opens_the_store_read_only_and_never_rolls_it_back(tmp_path):
    path = str(tmp_path)
    store = _row_store(path, np.arange(10))
    store.write(np.array([3]), np.full((1, 2 * D), 9.0, np.float32))  # not committed: in the write log

    def snapshot():
        return {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    before = snapshot()
    with se.offload.StoreServer(path) as server:
        assert server.lookup(np.array([3]))[0, 0] == 9.0  # the newest record in the file
        server.refresh()
    assert snapshot() == before
    store.close()


def test_a_config_file_names_models_tables_and_stores_and_models_share_a_store(tmp_path):
    a, b = str(tmp_path / "stores" / "a"), str(tmp_path / "stores" / "b")
    sa, sb = _row_store(a, np.arange(5)), _row_store(b, np.arange(5, 10), name="users")
    config = tmp_path / "serving.json"
    config.write_text(json.dumps({"models": {
        "ranker": {"items": {"store": "stores/a", "cache_bytes": 4096, "default": 1.0},
                   "users": {"store": "stores/b", "default": list(range(D))}},
        "retrieval": {"items": {"store": os.path.abspath(a), "cache_bytes": 1 << 20, "refresh_seconds": None}},
    }}))
    with se.offload.load_parameter_server(str(config)) as ps:
        assert ps.models == {"ranker": ["items", "users"], "retrieval": ["items"]}
        assert ps.server("ranker", "items") is ps.server("retrieval", "items")
        assert ps.server("ranker", "items").cache_bytes == 1 << 20  # the largest asked for
        np.testing.assert_array_equal(ps.lookup("ranker", "items", np.array([2, 7]))[:, 0], [2.0, 1.0])
        np.testing.assert_array_equal(ps.lookup("retrieval", "items", np.array([2, 7, -1]))[:, 0], [2.0, 0.0, 0.0])
        np.testing.assert_array_equal(ps.lookup("ranker", "users", np.array([1]))[0], np.arange(D))
        stats = ps.stats()
        r, q = stats["ranker", "items"], stats["retrieval", "items"]
        assert (r.lookups, r.misses, r.not_found, r.hits) == (2, 1, 1, 0)
        assert (q.lookups, q.misses, q.not_found, q.hits, q.padding) == (2, 0, 1, 1, 1)  # row 2: cached by ranker
        assert stats["ranker", "users"].not_found == 1 and r.cached_rows == q.cached_rows == 1
        with pytest.raises(ValueError, match="Unknown model 'nope'.*'ranker', 'retrieval'"):
            ps.lookup("nope", "items", [1])
        with pytest.raises(ValueError, match="Model 'retrieval' has no table 'users'"):
            ps.lookup("retrieval", "users", [1])
        with pytest.raises(ValueError, match=r"Model 'ranker', table 'items': id 200 .* outside \[0, 200\)"):
            ps.lookup("ranker", "items", np.array([1, 200]))
        with pytest.raises(ValueError, match="Model 'ranker', table 'items': ids must be integers"):
            ps.lookup("ranker", "items", np.array([1.0]))
        with pytest.raises(ValueError, match=r"Model 'ranker', table 'items': ids must be an integer array \(a list "
                                             r"of lists of one length\), got a ragged list"):
            ps.lookup("ranker", "items", [[1, 2], [3]])  # (numpy's 'inhomogeneous shape' named no table)
    with pytest.raises(ValueError, match=r"Table 'items': id -2 \(at 1\) is outside"):
        se.offload.StoreServer(a).lookup(np.array([0, -2]))
    for big in (2**64 - 1, 2**63, 200):  # unsigned ids past the table, not wrapped to padding or a row
        with pytest.raises(ValueError, match=rf"Table 'items': id {big} \(at 1\) is outside \[0, 200\)"):
            se.offload.StoreServer(a).lookup(np.array([0, big], np.uint64))
    sa.close()
    sb.close()


@pytest.mark.parametrize("table, match", [
    ({"store": "missing"}, FileNotFoundError),
    ({"stor": "a"}, r"model 'm', table 't': unknown fields \['stor'\]"),
    ({"store": 3}, r"model 'm', table 't': \"store\" must be the path"),
    ({"store": "a", "cache_bytes": "1GiB"}, r"model 'm', table 't': \"cache_bytes\" must be an int"),
    ({"store": "a", "cache_bytes": -1}, r"\"cache_bytes\" must be an int >= 0"),
    ({"store": "a", "default": [1.0, 2.0]}, r"model 'm', table 't': the default vector has shape \(2,\)"),
    ({"store": "a", "default": "zero"}, r"model 'm', table 't': default must be a finite number"),
    ({"store": "a", "default": "0.5"}, r"model 'm', table 't': default must be a finite number"),
    ({"store": "a", "default": float("nan")}, r"model 'm', table 't': default must be a finite number"),
    ({"store": "a", "default": ["0.5"] * D}, r"model 'm', table 't': default must be a finite number"),
    ({"store": "items"}, r"model 'm', table 't': the store at .*items' holds table 'items', not 't'"),
    ({"store": "a", "refresh_seconds": -1}, r"\"refresh_seconds\" must be a number >= 0"),
])
def test_config_errors_name_the_model_and_table(tmp_path, table, match):
    _row_store(str(tmp_path / "a"), np.arange(3), name="t").close()
    _row_store(str(tmp_path / "items"), np.arange(3)).close()
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"models": {"m": {"t": table}}}))
    if match is FileNotFoundError:
        with pytest.raises(FileNotFoundError, match=r"model 'm', table 't': no offloaded table's store at .*missing"):
            se.offload.load_parameter_server(config)
    else:
        with pytest.raises(ValueError, match=match):
            se.offload.load_parameter_server(config)


def test_config_file_errors(tmp_path):
    config = tmp_path / "c.json"
    for text, match in [("{", "is not valid JSON"), ('{"model": {}}', "expected {\"models\""),
                        ('{"models": {}}', "names no model"), ('{"models": {"m": []}}', "model 'm' must map")]:
        config.write_text(text)
        with pytest.raises(ValueError, match=match):
            se.offload.load_parameter_server(config)
    with pytest.raises(FileNotFoundError, match="No serving config"):
        se.offload.load_parameter_server(tmp_path / "none.json")
    with pytest.raises(FileNotFoundError, match="No offloaded table's store"):
        se.offload.StoreServer(tmp_path)


def test_the_offload_namespace_exports_the_serving_names():
    for name in ("ParameterServer", "ServingStats", "StoreServer", "load_parameter_server"):
        assert getattr(se.offload, name) is getattr(serving, name) and name in se.offload.__all__


def test_the_serving_benchmark_runs(tmp_path, capsys):
    """benchmarks/offload_serving.py --quick (without serving_lookup's compile), so that it cannot rot."""
    from benchmarks import offload_serving

    out = offload_serving.main(["--quick", "--no-jax", "--warmup", "2", "--batches", "2", "--dir", str(tmp_path)])
    assert out["store server"]["median"] > 0 and out["numpy take"]["median"] > 0
    assert out["store server, seen ids"]["hit_rate"] == 1.0 and out["refresh"]["invalidated"] > 0
    assert "store server, seen ids" in capsys.readouterr().out


def test_a_store_replaced_by_another_runs_is_served_from_scratch(tmp_path):
    """Another run's store made at the served path (its records a new file, its commit numbers the same): a
    refresh serves it, nothing cached from the old one; one of another table is an error naming the table."""
    path = str(tmp_path / "store")
    first = Trainer(path)
    first.train(3)
    first.tiers.close()
    server = se.offload.StoreServer(path, refresh_seconds=None)
    rows = np.arange(V)
    np.testing.assert_array_equal(server.lookup(rows), np.where(reference(path)[1][:, None], reference(path)[0], 0))
    os.rename(path, str(tmp_path / "old"))
    second = Trainer(path)
    second.data = np.random.default_rng(8)  # other batches: other rows, other values
    second.train(3)
    second.tiers.close()
    assert server.refresh() and server.commit == 1 and not server.refresh()
    want, written = reference(path)
    np.testing.assert_array_equal(server.lookup(rows), np.where(written[:, None], want, 0))
    os.rename(path, str(tmp_path / "second"))
    RowStore(_spec(path, vocab=V + 1)).close()
    with pytest.raises(CorruptStoreError, match=r"Table 'items': the store at .* was replaced by one of another "
                                                r"table"):
        server.refresh()
    server.close()


def test_a_lookup_under_way_when_the_store_is_replaced_reads_the_store_its_bitmap_came_from(tmp_path, monkeypatch):
    """A refresh that reopens a replaced store while a lookup runs: the lookup reads its rows from the store whose
    bitmap it took (the old one), not the new one, where those rows were never written and fail their checksum
    (a CorruptStoreError, and rows of two stores in one lookup)."""
    path = str(tmp_path / "store")
    _row_store(path, np.arange(10)).close()
    server = se.offload.StoreServer(path, refresh_seconds=None, retries=1, retry_seconds=0)
    os.rename(path, str(tmp_path / "old"))
    _row_store(path, np.arange(100, 110), np.full((10, 2 * D), -3.0)).close()  # another run's store
    is_set, refreshed = serving._is_set, []

    def refresh_meanwhile(bits, rows):  # the lookup has taken its bitmap: the refresh runs now
        if not refreshed:
            refreshed.append(server.refresh())
        return is_set(bits, rows)

    monkeypatch.setattr(serving, "_is_set", refresh_meanwhile)
    got = server.lookup(np.array([3, 4, 105]))
    assert refreshed == [True]
    np.testing.assert_array_equal(got[:, 0], [3.0, 4.0, 0.0])  # the old store's rows, its bitmap's default
    np.testing.assert_array_equal(server.lookup(np.array([3, 105]))[:, 0], [0.0, -3.0])  # then the new store's
    server.close()


def test_a_lookup_after_close_is_an_error_naming_the_table(tmp_path):
    """Not the OS's bare 'Bad file descriptor' (a store with a write log) or an unnamed 'the store is closed'."""
    store = _row_store(str(tmp_path), np.arange(10))
    store.write(np.array([3]), np.full((1, 2 * D), 9.0, np.float32))  # in the write log, which the server follows
    server = se.offload.StoreServer(str(tmp_path), refresh_seconds=None)
    server.lookup(np.array([3]))
    server.close()
    with pytest.raises(ValueError, match=r"Table 'items': the server of the store at .* is closed"):
        server.lookup(np.array([3, 4]))
    with se.offload.load_parameter_server({"models": {"m": {"items": {"store": str(tmp_path)}}}}) as ps:
        ps.lookup("m", "items", [4])
    with pytest.raises(ValueError, match=r"Model 'm', table 'items': the server of the store at .* is closed"):
        ps.lookup("m", "items", [4, 5])
    store.close()


def test_a_list_of_ints_past_int64_is_an_id_outside_the_table_not_a_dtype_error(tmp_path):
    """numpy reads a list with an int past int64 as float64 or object: the error names the id, as for an array;
    numpy's uint64 beside int64 (read as float64) serve as the integers they are."""
    _row_store(str(tmp_path), np.arange(10)).close()
    with se.offload.StoreServer(str(tmp_path), refresh_seconds=None) as server:
        for ids, bad, at in (([1, 2**63], 2**63, 1), ([[1], [2**64]], 2**64, 1), ([-2**63 - 1, 1], -2**63 - 1, 0)):
            with pytest.raises(ValueError, match=rf"Table 'items': id {bad} \(at {at}\) is outside \[0, 200\)"):
                server.lookup(ids)
        np.testing.assert_array_equal(server.lookup([np.uint64(5), np.int64(-1)])[:, 0], [5.0, 0.0])
        with pytest.raises(ValueError, match="Table 'items': ids must be integers, got dtype float64"):
            server.lookup([1.0, 2**63])


def test_a_config_naming_a_store_of_several_processes_says_so(tmp_path):
    """Not "no offloaded table's store there": it holds one, in process<i>of<P>/ (as StoreServer says)."""
    for i in range(2):
        _row_store(str(tmp_path / "items" / f"process{i}of2"), np.arange(i, 10, 2)).close()
    with pytest.raises(ValueError, match=r"serving config: model 'm', table 'items': the store at .* was written by "
                                         r"2 processes .* rewrite it as one"):
        se.offload.load_parameter_server({"models": {"m": {"items": {"store": str(tmp_path / "items")}}}})
    with pytest.raises(ValueError, match="was written by 2 processes"):
        se.offload.StoreServer(tmp_path / "items")


def test_rows_a_killed_trainer_wrote_are_dropped_when_its_restore_goes_back_to_an_older_commit(tmp_path):
    """Killed with rows written back after its last commit (a server read them), then restored to an older commit
    (a checkpoint's): the opening rolls those rows back, and the restore's commit lists them with the rows it
    restores, so the server drops them (they were served, as rows the store never committed, until evicted)."""
    path = str(tmp_path)
    store = _row_store(path, np.arange(10))
    first = store.id
    _write(store, [5], np.full((1, 2 * D), 7.0))  # commit 2 changes row 5
    store.write(np.array([1, 2]), np.full((2, 2 * D), -5.0, np.float32))  # written back, never committed
    server = se.offload.StoreServer(path, refresh_seconds=None)
    np.testing.assert_array_equal(server.lookup(np.array([1, 2, 5]))[:, 0], [-5.0, -5.0, 7.0])
    store.close()  # killed
    again = RowStore(_spec(path, 200))
    _OPEN.append(again)
    again.rollback_to(first)  # the restore of the checkpoint at commit 1
    np.testing.assert_array_equal(np.load(os.path.join(path, f"changes.{again.commit}.npy")), [1, 2, 5])
    assert server.refresh() and server.stats().invalidated == 3
    want, _ = reference(path, 200)
    np.testing.assert_array_equal(server.lookup(np.array([1, 2, 5])), want[[1, 2, 5]])
    np.testing.assert_array_equal(want[[1, 2, 5], 0], [1.0, 2.0, 5.0])


def test_rows_rolled_back_by_a_trainer_killed_twice_before_a_commit_are_dropped_at_its_next_commit(tmp_path):
    """The first restart rolls the rows a server read back and deletes the logs that listed them; killed again
    (or the store opened by store_state) before committing, the next run's commit still lists them (they were
    served, as rows the store never committed, until evicted)."""
    path = str(tmp_path)
    store = _row_store(path, np.arange(10))
    store.write(np.array([1, 2]), np.full((2, 2 * D), -5.0, np.float32))  # written back, never committed
    server = se.offload.StoreServer(path, refresh_seconds=None)
    np.testing.assert_array_equal(server.lookup(np.array([1, 2, 3]))[:, 0], [-5.0, -5.0, 3.0])
    store.close()  # killed
    RowStore(_spec(path, 200)).close()  # restarted, killed again before its first commit
    RowStore(_spec(path, 200)).close()
    again = _row_store(path, np.array([50]))
    np.testing.assert_array_equal(np.load(os.path.join(path, "changes.2.npy")), [1, 2, 50])
    assert server.refresh() and server.stats().invalidated == 2
    np.testing.assert_array_equal(server.lookup(np.array([1, 2, 3, 50]))[:, 0], [1.0, 2.0, 3.0, 50.0])
    assert not os.path.exists(os.path.join(path, "rolled_back.npy"))  # listed by the commit: gone
    _write(again, [60])
    np.testing.assert_array_equal(np.load(os.path.join(path, "changes.3.npy")), [60])


def test_a_row_changed_by_several_commits_is_invalidated_and_uncounted_once(tmp_path):
    """A refresh over two commits that both changed a cached row: it is dropped once; `invalidated` and
    `cached_rows` count rows (they counted it twice: 4 invalidated, 6 cached, with 8 rows in the cache)."""
    path = str(tmp_path)
    store = _row_store(path, np.arange(10))
    server = se.offload.StoreServer(path, refresh_seconds=None)
    server.lookup(np.arange(10))
    _write(store, [2, 3])
    _write(store, [2, 3], np.full((2, 2 * D), -1.0))
    assert server.refresh()
    s = server.stats()
    assert (s.invalidated, s.cached_rows) == (2, 8) == (2, int((server.cache.row_of >= 0).sum()))
    np.testing.assert_array_equal(server.lookup(np.arange(5))[:, 0], [0.0, 1.0, -1.0, -1.0, 4.0])
    assert server.stats().cached_rows == 10


def test_a_store_the_config_names_that_cannot_be_served_is_an_error_naming_the_model_and_table(tmp_path):
    """A raw-id table's store, or a damaged one: the StoreServer's error, prefixed with the config's entries that
    name the store (it named the store's table only, not the model)."""
    store = RowStore(dataclasses.replace(_spec(str(tmp_path / "raw"), 200, "t"), dynamic=se.Dynamic()))
    _write(store, np.arange(3))
    store.close()
    _row_store(str(tmp_path / "cut"), np.arange(3), name="u").close()
    os.truncate(str(tmp_path / "cut" / "records" / "c" / "0" / "0"), 100)
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"models": {"a": {"t": {"store": "raw"}}, "b": {"t": {"store": "raw"}}}}))
    with pytest.raises(ValueError, match=r"serving config .*c.json': model 'a', table 't'; model 'b', table 't': "
                                         r"Table 't' \(store .*\) is keyed by raw ids"):
        se.offload.load_parameter_server(config)
    with pytest.raises(CorruptStoreError, match=r"serving config: model 'm', table 'u': Table 'u': the records file "
                                                r".* cut short"):
        se.offload.load_parameter_server({"models": {"m": {"u": {"store": str(tmp_path / "cut")}}}})


def test_a_refresh_period_that_is_not_a_number_or_is_negative_is_refused_naming_the_table(tmp_path):
    """As the config file's: "5" failed with time's 'unsupported operand type(s) for +', -1 and NaN were taken
    (NaN: a JSON config may hold it)."""
    _row_store(str(tmp_path / "items"), np.arange(3)).close()
    for bad in ("5", -1, float("nan"), True):
        with pytest.raises(ValueError, match=r"Table 'items' \(store .*\): refresh_seconds must be a number >= 0 or "
                                             rf"None, got {re.escape(repr(bad))}"):
            se.offload.StoreServer(tmp_path / "items", refresh_seconds=bad)
    config = tmp_path / "c.json"
    config.write_text('{"models": {"m": {"items": {"store": "items", "refresh_seconds": NaN}}}}')
    with pytest.raises(ValueError, match=r"model 'm', table 'items': \"refresh_seconds\" must be a number >= 0"):
        se.offload.load_parameter_server(config)
    with se.offload.StoreServer(tmp_path / "items", refresh_seconds=np.float32(0.5)) as server:
        assert server.lookup([1])[0, 0] == 1.0


def test_lookups_go_on_while_the_store_is_gone_from_its_path_and_a_refresh_says_so(tmp_path):
    """Another run about to make a store at the path (the old one removed, the new one without tier.json yet):
    an automatic refresh failed every lookup with a bare FileNotFoundError of tier.json; lookups serve the commit
    they have, `refresh()` names the table, and the new store is served once it is there."""
    path = str(tmp_path / "store")
    _row_store(path, np.arange(10)).close()
    server = se.offload.StoreServer(path, refresh_seconds=0)
    np.testing.assert_array_equal(server.lookup([1, 2])[:, 0], [1.0, 2.0])
    os.rename(path, str(tmp_path / "old"))
    os.makedirs(os.path.join(path, "records", "c", "0"))  # the new run has begun
    np.testing.assert_array_equal(server.lookup([1, 2])[:, 0], [1.0, 2.0])
    with pytest.raises(FileNotFoundError, match=r"Table 'items': the store at .* is gone from its path .*tier.json"
                                                r".* lookups serve its commit 1 meanwhile"):
        server.refresh()
    os.rmdir(os.path.join(path, "records", "c", "0"))
    _row_store(path, np.arange(5), np.full((5, 2 * D), -3.0)).close()
    np.testing.assert_array_equal(server.lookup([1, 2, 7])[:, 0], [-3.0, -3.0, 0.0])
    server.close()


def test_retries_and_retry_seconds_are_checked_when_the_server_is_made(tmp_path):
    """A negative retry_seconds was taken, then failed with time.sleep's bare 'sleep length must be non-negative'
    in the first lookup that met a row caught mid-write; -1 retries said 'after -1 re-reads'."""
    _row_store(str(tmp_path), np.arange(3)).close()
    for kw in (dict(retry_seconds=-0.001), dict(retries=-1), dict(retries=2.5), dict(retry_seconds="0.1")):
        with pytest.raises(ValueError, match=r"Table 'items' \(store .*\): retries must be an int >= 0 and "
                                             r"retry_seconds a number >= 0"):
            se.offload.StoreServer(tmp_path, **kw)
    with se.offload.StoreServer(tmp_path, retries=0, retry_seconds=0) as server:
        assert server.lookup([2])[0, 0] == 2.0


@pytest.mark.parametrize("capacity, dtype", [(4, np.int32), (2**31 - 2, np.int32), (2**31 - 1, np.int64),
                                             (2**33, np.int64)])
def test_a_cache_of_2_31_rows_or_more_numbers_its_rows_in_int64(capacity, dtype):
    """A cache row + 1 past int32 would wrap in an int32 row -> slot map, serving another row's values."""
    from sparse_embed.tiers.serving import _RowCache, slot_dtype

    assert slot_dtype(capacity) == dtype and np.iinfo(dtype).max >= capacity  # (cache row + 1 <= capacity)
    assert _RowCache(10, 1, 4).slot_of.dtype == np.int32
