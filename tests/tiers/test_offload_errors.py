"""Offloaded tables' errors: each names the table (or the feature) and says what to do; a damaged or foreign
store is a `CorruptStoreError`, never a silently wrong row; a rejected batch leaves `Tiers` as it was."""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparse_embed as se
from conftest import make_mesh
from test_offload_training import (Feat, assert_equal, assert_store_equals, inputs, make_batches, make_specs,
                                   reset_stores, touched_rows, train_in_memory, train_step, train_tiered)

V, D, B = 500, 8, 16


def _spec(path, name="t", cache_rows=64, **kw) -> se.TableSpec:
    kw.setdefault("optimizer", se.optimizers.SGD(0.1))
    return se.TableSpec(name, V, D, storage=se.offload.Offload(str(path), cache_rows), **kw)


def _plan(*tables: se.TableSpec, batch: int = B) -> se.EmbeddingPlan:
    return se.plan([se.FeatureSpec(f"f_{t.name}", t, batch) for t in tables], make_mesh(1))


def _ids(*rows, batch: int = B) -> np.ndarray:
    """`[batch, 1]` ids: `rows`, then copies of the first."""
    out = np.full((batch, 1), rows[0], np.int64)
    out[:len(rows), 0] = rows
    return out


# ------------------------------------------------------------------------------ bad batches
def test_cache_smaller_than_one_batch(tmp_path):
    plan = _plan(_spec(tmp_path / "t", cache_rows=8))
    tiers = se.offload.Tiers(plan, jax.random.key(0))
    try:
        with pytest.raises(ValueError, match=r"Table 't': a batch reads 16 distinct rows, more than its cache of 8 "
                                             r"rows \(Offload\(cache_rows=\.\.\.\)\)"):
            tiers.preprocess({"f_t": _ids(*range(16))})
        tiers.preprocess({"f_t": _ids(*range(8))})  # a batch that fits still goes through
    finally:
        tiers.close()


@pytest.mark.parametrize("bad", [V, 10**12, -2])
def test_ids_out_of_range_of_the_table(tmp_path, bad):
    """Ids are checked against the whole table (`vocabulary_size`), not its cache, and name the feature."""
    plan = _plan(_spec(tmp_path / "t"))
    tiers = se.offload.Tiers(plan, jax.random.key(0))
    try:
        tiers.preprocess({"f_t": _ids(V - 1, 0)})  # the last row of the table: far past the cache, fine
        with pytest.raises(ValueError, match=rf"Feature 'f_t' \(table 't'\): id {bad} in sample 3"):
            tiers.preprocess({"f_t": _ids(1, 2, 3, bad)})
    finally:
        tiers.close()


def test_plain_preprocess_refuses_an_offloaded_table(tmp_path):
    plain = se.TableSpec("plain", V, D)
    plan = _plan(_spec(tmp_path / "t"), plain)
    ids = {"f_t": _ids(1), "f_plain": _ids(1)}
    with pytest.raises(ValueError, match=r"Tables 't' are offloaded \(storage=Offload\(\.\.\.\)\): preprocess their "
                                         r"batches with sparse_embed\.offload\.Tiers"):
        se.preprocess(plan, ids)
    with pytest.raises(ValueError, match=r"Tables 't' are offloaded"):
        next(iter(se.prefetch(plan, [ids])))


def test_swaps_out_of_order(tmp_path):
    plan = _plan(_spec(tmp_path / "t"))
    rng = jax.random.key(0)
    tiers = se.offload.Tiers(plan, rng)
    try:
        tables = se.init_tables(plan, rng)
        _, _, first = tiers.preprocess({"f_t": _ids(1)})
        _, _, second = tiers.preprocess({"f_t": _ids(2)})
        tables = tiers.swap(tables, first)
        with pytest.raises(ValueError, match=r"Tiers\.swap: .*swap 0.*(expected|next is) 1"):
            tiers.swap(tables, first)  # twice
        tables = tiers.swap(tables, second)
        other = se.offload.Tiers(_plan(_spec(tmp_path / "u", name="t")), rng)
        try:
            _, _, foreign = other.preprocess({"f_t": _ids(3)})
            with pytest.raises(ValueError, match=r"Tiers\.swap: "):
                tiers.swap(tables, foreign)  # another Tiers' swap (its index 0 already ran here)
        finally:
            other.close()
    finally:
        tiers.close()


def test_swap_ahead_of_its_turn(tmp_path):
    """A swap handed in before an earlier one (whose batch a closed prefetcher dropped) runs the earlier one
    first; the earlier one then does not run again."""
    plan = _plan(_spec(tmp_path / "t"))
    rng = jax.random.key(0)
    tiers = se.offload.Tiers(plan, rng)
    try:
        tables = se.init_tables(plan, rng)
        _, _, first = tiers.preprocess({"f_t": _ids(1)})
        _, _, second = tiers.preprocess({"f_t": _ids(2)})
        tables = tiers.swap(tables, second)
        with pytest.raises(ValueError, match=r"Tiers\.swap: swap 0 already ran .*the next is 2"):
            tiers.swap(tables, first)
    finally:
        tiers.close()


def test_under_several_processes_a_prefetch_left_early_plans_its_whole_buffer_first(tmp_path, monkeypatch):
    """As `se.prefetch`'s (tests/host/test_prefetch.py): under jax.distributed a `Tiers.prefetch` closed early
    stopped its worker at its current batch, so a process with slower input had planned fewer batches than the
    others, whose next exchanges then waited for it in vain. Its worker now plans `buffer_size` batches past the
    last one taken first. (One process here, told it spans several: only the prefetcher reads that.)"""
    from sparse_embed.tiers import tiered

    monkeypatch.setattr(tiered.distributed, "spans_processes", lambda plan: True)
    plan = _plan(_spec(tmp_path / "t"))
    rng = jax.random.key(0)
    asked = []

    def batches():
        for i in itertools.count():
            time.sleep(0.05)  # slower input than the loop
            asked.append(i)
            yield {"f_t": _ids(i % V)}

    with se.offload.Tiers(plan, rng) as tiers:
        tables = se.init_tables(plan, rng)
        with tiers.prefetch(batches(), buffer_size=3) as items:
            for _, item in zip(range(2), items):
                tables = tiers.swap(tables, item.swap)
        assert asked == [0, 1, 2, 3, 4]  # 2 taken + buffer_size, whatever the input's speed
        tables = tiers.flush(tables, 2)  # the batches planned and never taken change no value


@pytest.mark.parametrize("then", ["next", "flush"])
def test_a_batch_taken_from_prefetch_without_its_swap_is_refused_at_the_next(tmp_path, then):
    """A loop that forgot `tiers.swap` for one batch trained it on the cache rows of other ids, and the next
    swap ran the missed one late: the loop went on, silently. Now the next batch (or the flush) refuses."""
    plan = _plan(_spec(tmp_path / "t"))
    rng = jax.random.key(0)
    tiers = se.offload.Tiers(plan, rng)
    try:
        tables = se.init_tables(plan, rng)
        with tiers.prefetch([{"f_t": _ids(i)} for i in range(4)]) as items:
            tables = tiers.swap(tables, next(items).swap)
            next(items)  # batch 1: no swap
            with pytest.raises(RuntimeError, match=r"Tiers \(prefetch\): batch 1 was taken from prefetch but its "
                                                   r"swap never ran, so its step read the cache rows of other ids"):
                next(items)
            if then == "flush":
                with pytest.raises(RuntimeError, match=r"Tiers \(flush\): batch 1 was taken"):
                    tiers.flush(tables, 2)
    finally:
        tiers.close()


# ------------------------------------------------------------------------------ a damaged or foreign store
def _train_and_flush(path, steps: int = 4, **kw):
    """Trains table "t" (feature "f") a few steps into the store at `path`, flushes; returns `(plan, batches)`."""
    feats = [Feat("f", "t")]
    batches = make_batches(feats, steps, seed=11)
    _, tier_f = make_specs({"t": (se.optimizers.SGD(0.1), "sum")}, feats, str(path), **kw)
    plan = se.plan(tier_f, make_mesh(1))
    rng = jax.random.key(0)
    tiers = se.offload.Tiers(plan, rng)
    _, tables = train_tiered(tiers, plan, se.init_tables(plan, rng), batches)
    tiers.flush(tables, steps)
    tiers.close()
    return plan, batches


def test_a_flipped_byte_is_a_corrupt_store(tmp_path):
    """A byte of a stored row flipped on disk: the batch that reads the row raises a `CorruptStoreError` naming
    the table and the row, through `preprocess` and again through `prefetch` (the refused batch did not leave
    the row in the cache, where the next batch would have found it without reading the store)."""
    plan, batches = _train_and_flush(tmp_path)
    rng = jax.random.key(0)
    tiers = se.offload.Tiers(plan, rng)
    store = tiers.tables["t"].store
    row = int(np.flatnonzero(store.written)[17])
    offset = row * store.record_bytes + 4 * 3 + 1  # a byte of the row's fourth value
    tiers.close()
    path = os.path.join(plan.features["f"].table.storage.path, "records", "c", "0", "0")
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))

    tiers = se.offload.Tiers(plan, rng)  # opens: the damage shows when the row is read
    try:
        tables = se.init_tables(plan, rng)
        ids = batches[0]["ids"]["f"].copy()
        ids[0, 0] = row
        with pytest.raises(se.offload.CorruptStoreError, match=rf"Table 't': row {row} of the store at .* fails its "
                                                               r"checksum"):
            tiers.preprocess({"f": ids})
        with pytest.raises(se.offload.CorruptStoreError, match=rf"Table 't': row {row} "):
            for item in tiers.prefetch([{"f": ids}]):
                tiers.swap(tables, item.swap)
    finally:
        tiers.close()


@pytest.mark.parametrize("bit", ["cleared", "set"])
def test_a_flipped_bit_of_the_written_rows_is_a_corrupt_store(tmp_path, bit):
    """The bitmap of the rows a commit holds is checked against tier.json's CRC32: a stored row marked unwritten
    would read as its initial value, an unwritten one marked written as whatever the records file holds."""
    plan, _ = _train_and_flush(tmp_path)
    spec = plan.tiered_tables["t"]
    path = spec.storage.path
    with open(os.path.join(path, "tier.json")) as f:
        commit = json.load(f)["commit"]
    bitmap = os.path.join(path, f"written.{commit}.bin")
    bits = np.unpackbits(np.fromfile(bitmap, np.uint8), count=spec.vocabulary_size).astype(bool)
    row = int(np.flatnonzero(bits if bit == "cleared" else ~bits)[3])
    bits[row] = not bits[row]
    np.packbits(bits).tofile(bitmap)
    match = rf"Table 't': {bitmap}, which rows the store holds, fails its checksum"
    for read in (lambda: se.offload.Tiers(plan, jax.random.key(0)),
                 lambda: se.offload.store_state(spec, jax.random.key(0)),
                 lambda: se.offload.StoreServer(path).lookup(np.array([row]))):
        with pytest.raises(se.offload.CorruptStoreError, match=match):
            read()


@pytest.mark.parametrize("change", [
    dict(dim=16), dict(optimizer=se.optimizers.Adagrad(0.1)), dict(optimizer=se.optimizers.RowwiseAdagrad(0.1)),
    dict(vocab=V + 1)], ids=["dim", "adagrad", "rowwise", "vocab"])
def test_a_store_of_another_table(tmp_path, change):
    """A store never opens under another table's spec: another dim, optimizer (slots) or vocabulary size."""
    tiers = se.offload.Tiers(_plan(_spec(tmp_path)), jax.random.key(0))
    tiers.close()
    spec = se.TableSpec("t", change.get("vocab", V), change.get("dim", D),
                        optimizer=change.get("optimizer", se.optimizers.SGD(0.1)),
                        storage=se.offload.Offload(str(tmp_path), 64))
    with pytest.raises(se.offload.CorruptStoreError, match=r"Table 't': the store at .* holds another table"):
        se.offload.Tiers(_plan(spec), jax.random.key(0))
    tiers = se.offload.Tiers(_plan(_spec(tmp_path, cache_rows=100)), jax.random.key(0))  # the same table: opens
    tiers.close()


# ------------------------------------------------------------------------------ specs
@pytest.mark.parametrize("kw, match", [
    (dict(dynamic=se.Dynamic(), dtype=jnp.bfloat16), r"Table 't': an offloaded table stores float32 rows"),
    (dict(dtype=jnp.bfloat16), r"Table 't': an offloaded table stores float32 rows, got dtype"),
    (dict(dtype=jnp.float16), r"Table 't': an offloaded table stores float32 rows"),
    (dict(initializer=jax.nn.initializers.zeros), r"Table 't': an offloaded table's rows are generated when first "
                                                  r"read, so its initializer must be positional"),
    (dict(initializer=jax.nn.initializers.truncated_normal(0.1)), r"Table 't': .* initializer must be positional"),
], ids=["raw-ids-bfloat16", "bfloat16", "float16", "zeros", "jax-truncated-normal"])
def test_table_spec_validation(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        se.TableSpec("t", V, D, storage=se.offload.Offload(str(tmp_path), 64), **kw)


def test_positional_initializer_is_accepted(tmp_path):
    spec = se.TableSpec("t", V, D, initializer=se.initializers.truncated_normal(0.05),
                        storage=se.offload.Offload(str(tmp_path), 64))
    assert spec.cache_rows == 64
    assert se.TableSpec("t", V, D, storage=se.offload.Offload(str(tmp_path), 10 * V)).cache_rows == V
    # a raw-id table's new rows start from their ids' values (tests/tiers/test_offload_raw_ids.py): any initializer
    raw = se.TableSpec("t", V, D, initializer=jax.nn.initializers.zeros, dynamic=se.Dynamic(),
                       storage=se.offload.Offload(str(tmp_path), 64))
    assert raw.cache_rows == 64 and raw.dynamic == se.Dynamic()


@pytest.mark.parametrize("cache_rows", [0, -1, 1.5, "64", True])
def test_cache_rows_must_be_positive(tmp_path, cache_rows):
    with pytest.raises((ValueError, TypeError), match=r"Offload: cache_rows"):
        se.offload.Offload(str(tmp_path), cache_rows)


def test_each_offloaded_table_needs_a_store_of_its_own(tmp_path, monkeypatch):
    """Two tables on one directory (however it is spelled) are refused by plan(), naming both (Tiers failed on
    the second with 'open for training elsewhere'); '~' is the home directory, not a directory named '~'."""
    a = _spec(tmp_path / "same", "a")
    for spelling in (tmp_path / "same", tmp_path / "." / "same", tmp_path / "x" / ".." / "same"):
        with pytest.raises(ValueError, match=r"Tables 'a' and 'b' are offloaded to the same store directory .*: "
                                             r"give each table's Offload\(...\) a directory of its own"):
            _plan(a, _spec(spelling, "b"))
    assert sorted(_plan(a, _spec(tmp_path / "other", "b")).tables) == ["a", "b"]
    monkeypatch.setenv("HOME", str(tmp_path))
    assert se.offload.Offload("~/stores/t", 8).path == str(tmp_path / "stores" / "t")


def test_storage_must_be_an_offload(tmp_path):
    with pytest.raises(TypeError, match=r"Table 't': storage must be a sparse_embed\.offload\.Offload"):
        se.TableSpec("t", V, D, storage=str(tmp_path))


@pytest.mark.parametrize("placement", ["column", "table", "replicated"])
def test_offloaded_table_placement(tmp_path, placement):
    """An offloaded table's cache is placed by rows; another placement names the table."""
    feats = [se.FeatureSpec("f", _spec(tmp_path), B)]
    assert se.plan(feats, make_mesh(2), placement={"t": "row"}).tiered
    with pytest.raises(ValueError, match=r"Table 't' is offloaded \(storage=\.\.\.\): its cache is placed by rows"):
        se.plan(feats, make_mesh(2), placement={"t": placement})


def test_tiers_needs_an_offloaded_table():
    plan = se.plan([se.FeatureSpec("f", se.TableSpec("t", V, D), B)], make_mesh(1))
    with pytest.raises(ValueError, match=r"Tiers: the plan has no offloaded table"):
        se.offload.Tiers(plan, jax.random.key(0))


# ------------------------------------------------------------------------------ a rejected batch changes nothing
REJECTS = {
    # a bad id of the ordinary feature: found by the plan's preprocess, after the offloaded tables' admission
    "ordinary-id": (lambda b: {**b, "ids": {**b["ids"], "p": np.where(b["ids"]["p"] == b["ids"]["p"][0, 0], 10**6,
                                                                     b["ids"]["p"])}},
                    r"Feature 'p' \(table 'p'\): id 1000000 in sample 0 is out of range"),
    # the second offloaded table's cache overflows, after the first one admitted its rows
    "second-cache": (lambda b: {**b, "ids": {**b["ids"], "z": np.arange(b["ids"]["z"].size).reshape(
        b["ids"]["z"].shape) * 3}}, r"Table 'z': a batch reads 128 distinct rows, more than its cache of 120"),
    # a missing ordinary feature
    "missing": (lambda b: {**b, "ids": {k: v for k, v in b["ids"].items() if k != "p"}},
                r"missing features \['p'\]"),
    # a NaN weight of an offloaded feature (found before any admission)
    "nan-weight": (lambda b: {**b, "weights": {"a": np.full(b["ids"]["a"].shape, np.nan, np.float32)}},
                   r"Feature 'a' \(table 'a'\): .*weight"),
}


def test_a_rejected_batch_leaves_tiers_as_it_was(tmp_path):
    """A batch `preprocess` refuses (a ValueError naming what is wrong) neither admits rows nor takes a swap
    index, wherever it is found: before each good batch, one of each kind is refused, and training equals
    in-memory training without them."""
    tables = {"a": (se.optimizers.Adagrad(0.1), "sum"), "z": (se.optimizers.SGD(0.1), "mean"),
              "p": (se.optimizers.SGD(0.1), "sum")}
    feats = [Feat("a", "a"), Feat("z", "z"), Feat("p", "p")]
    mesh, rng = make_mesh(1), jax.random.key(6)
    batches = make_batches(feats, 5, seed=12)
    mem_f, tier_f = make_specs(tables, feats, str(tmp_path), cache_rows=120, tiered=["a", "z"])
    mem_losses, state = train_in_memory(mem_f, mesh, batches, rng)
    plan = se.plan(tier_f, mesh)
    tiers = se.offload.Tiers(plan, rng)
    step_fn = train_step(plan)
    try:
        out, losses = se.init_tables(plan, rng), []
        for i, b in enumerate(batches):
            for reject, match in REJECTS.values():
                with pytest.raises(ValueError, match=match):
                    tiers.preprocess(*inputs(reject(b)))
            batch, _, swap = tiers.preprocess(*inputs(b))
            out = tiers.swap(out, swap)
            loss, out = step_fn(out, batch, i)
            losses.append(np.asarray(loss))
        out = tiers.flush(out, len(batches))
        assert_equal(losses, mem_losses, what="losses")
        assert_store_equals(tiers, state, touched_rows([f for f in feats if f.table != "p"], batches))
        counted = tiers.stats()
    finally:
        tiers.close()
    reset_stores(tier_f)  # the same batches without the refused ones count the same
    tiers = se.offload.Tiers(plan, rng)
    try:
        train_tiered(tiers, plan, se.init_tables(plan, rng), batches)
        for name, s in tiers.stats().items():
            c = counted[name]
            assert (c.lookups, c.hits, c.misses, c.fresh) == (s.lookups, s.hits, s.misses, s.fresh), (name, c, s)
    finally:
        tiers.close()


# ------------------------------------------------------------------------------ opening a store
def test_a_store_open_for_training_is_not_opened_again(tmp_path):
    """A second opener would roll the store back to its last commit under the first (whose merged write-backs
    would be lost): refused, in this process and in another, until the first closes; then it opens as usual."""
    spec = _spec(tmp_path / "t")
    plan, rng = _plan(spec), jax.random.key(0)
    tiers = se.offload.Tiers(plan, rng)
    other = ["import sys, jax, sparse_embed as se",
             f"spec = se.TableSpec('t', {V}, {D}, optimizer=se.optimizers.SGD(0.1), "
             f"storage=se.offload.Offload({str(tmp_path / 't')!r}, 64))",
             "try:", "    se.offload.store_state(spec, jax.random.key(0))",
             "except se.offload.StoreInUseError as e:", "    print('IN USE', e); sys.exit(3)"]
    run = lambda: subprocess.run([sys.executable, "-c", "\n".join(other)], capture_output=True, text=True,
                                 env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    try:
        tables = tiers.swap(se.init_tables(plan, rng), tiers.preprocess({"f_t": _ids(1, 2)})[2])
        tables = tiers.flush(tables, 1)
        match = rf"Table 't': the store at '{tmp_path / 't'}' is open for training elsewhere"
        for open_again in (lambda: se.offload.Tiers(plan, rng), lambda: se.offload.store_state(spec, rng),
                           lambda: se.offload.write_store(spec, {"table": np.zeros((V, D), np.float32)}, 1)):
            with pytest.raises(se.offload.StoreInUseError, match=match):
                open_again()
        got = run()
        assert got.returncode == 3 and "IN USE Table 't'" in got.stdout, got.stdout + got.stderr
        assert tiers.tables["t"].store.step == 1  # the first is untouched, and goes on
        tiers.flush(tables, 2)
    finally:
        tiers.close()
    assert run().returncode == 0
    assert se.offload.store_state(spec, rng)["table"].shape == (V, D)
    tiers = se.offload.Tiers(plan, rng)
    assert tiers.tables["t"].store.step == 2
    tiers.close()


def test_a_closed_tiers_refuses_every_use_naming_its_tables(tmp_path):
    """After close (its stores closed), each call says so and how to go on (preprocess raised 'the store is
    closed', naming nothing, once it reached a store read)."""
    plan, rng = _plan(_spec(tmp_path / "t")), jax.random.key(0)
    tiers = se.offload.Tiers(plan, rng)
    batch, _, swap = tiers.preprocess({"f_t": _ids(1, 2)})
    tables = tiers.flush(tiers.swap(se.init_tables(plan, rng), swap), 1)
    tiers.close()
    match = r"This Tiers \(tables \['t'\]\) is closed, and its stores with it: make a new Tiers\(plan, rng\)"
    for use in (lambda: tiers.preprocess({"f_t": _ids(3, 4)}), lambda: tiers.prefetch([{"f_t": _ids(3)}]),
                lambda: tiers.swap(tables, swap), lambda: tiers.flush(tables, 2)):
        with pytest.raises(ValueError, match=match):
            use()
    tiers.close()  # a second close is fine
    tiers = se.offload.Tiers(plan, rng)  # and the store opens again at its commit
    assert tiers.tables["t"].store.step == 1
    tiers.close()


def test_a_store_path_that_is_a_file_is_named(tmp_path):
    (tmp_path / "t").write_text("not a store")
    with pytest.raises(NotADirectoryError, match=rf"Table 't': its store path '{tmp_path / 't'}' is a file; "
                                                 r"Offload\(...\) takes a directory"):
        se.offload.Tiers(_plan(_spec(tmp_path / "t")), jax.random.key(0))
    assert (tmp_path / "t").read_text() == "not a store"


@pytest.mark.parametrize("where", ["lock", "records"])
def test_a_store_that_cannot_be_written_is_named(tmp_path, monkeypatch, where):
    """A store on a read-only file system (a copy to evaluate, say): Tiers and store_state raised a bare
    "[Errno 30] Read-only file system: '.../lock'", naming no table; now the table, the store, and what to do.
    (Simulated: the tests may run as root, whom permissions do not stop.)"""
    from sparse_embed.tiers import rows_file, store
    spec = _spec(tmp_path / "t")
    plan, rng = _plan(spec), jax.random.key(0)
    with se.offload.Tiers(plan, rng) as tiers:
        tiers.flush(tiers.swap(se.init_tables(plan, rng), tiers.preprocess({"f_t": _ids(1, 2)})[2]), 1)

    def read_only(path, *args, **kw):
        raise OSError(errno.EROFS, "Read-only file system", os.path.join(path, "lock") if where == "lock" else path)

    monkeypatch.setattr(store, "_lock", (lambda name, path: read_only(path)) if where == "lock" else store._lock)
    monkeypatch.setattr(store, "open_mapped", read_only if where == "records" else rows_file.open_mapped)
    match = (rf"Table 't': the store at '{tmp_path / 't'}' cannot be opened for training \(Read-only file system: "
             r"'.*'\): Tiers, store_state and write_store open it to write .* Give its Offload\(\.\.\.\) a writable "
             r"directory \(a copy of the store\); StoreServer serves a read-only store\.")
    for use in (lambda: se.offload.Tiers(plan, rng), lambda: se.offload.store_state(spec, rng)):
        with pytest.raises(OSError, match=match) as e:
            use()
        assert e.value.errno == errno.EROFS
    monkeypatch.undo()
    with se.offload.Tiers(plan, rng) as tiers:  # nothing was left open or locked
        assert tiers.tables["t"].store.step == 1


def test_reading_or_restoring_a_store_that_is_not_there_creates_nothing(tmp_path):
    spec = _spec(tmp_path / "typo")
    with pytest.raises(FileNotFoundError, match=rf"Table 't': there is no store at '{tmp_path / 'typo'}' \(no "
                                                r"tier.json\): check the path of its Offload"):
        se.offload.store_state(spec, jax.random.key(0))
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize("step", [np.int64(4), jnp.int32(4), 4])
def test_flush_takes_the_step_as_any_integer_scalar(tmp_path, step):
    plan = _plan(_spec(tmp_path / "t"))
    rng = jax.random.key(0)
    tiers = se.offload.Tiers(plan, rng)
    try:
        tables = tiers.swap(se.init_tables(plan, rng), tiers.preprocess({"f_t": _ids(1, 2)})[2])
        with pytest.raises(TypeError, match=r"A commit's step must be an integer .*got 4.0"):
            tiers.flush(tables, 4.0)
        assert tiers.tables["t"].store.commit == 0 and not (tmp_path / "t" / "tier.json.tmp").exists()
        tables = tiers.flush(tables, step)
        assert tiers.tables["t"].store.step == 4 and type(tiers.tables["t"].store.step) is int
    finally:
        tiers.close()
    with open(tmp_path / "t" / "tier.json") as f:
        assert json.load(f)["step"] == 4


def test_a_store_reopened_with_another_key_or_initializer_is_refused(tmp_path):
    """Its rows never stored are generated from the table's key and initializer: another rng (or stddev) would
    make them other values than its training saw, silently; tier.json records both."""
    plan, _ = _train_and_flush(tmp_path)
    spec = plan.tiered_tables["t"]
    other = se.TableSpec("t", spec.vocabulary_size, spec.embedding_dim, optimizer=spec.optimizer,
                         combiner=spec.combiner, storage=spec.storage, initializer=se.initializers.truncated_normal(3.0))
    match = rf"Table 't': the store at '{spec.storage.path}' was trained with another key or initializer"
    for open_other in (lambda: se.offload.Tiers(plan, jax.random.key(1)),
                       lambda: se.offload.store_state(spec, jax.random.key(1)),
                       lambda: se.offload.store_state(other, jax.random.key(0))):
        with pytest.raises(ValueError, match=match):
            open_other()
    assert se.offload.store_state(spec, jax.random.key(0))["table"].shape == (spec.vocabulary_size, D)
    se.offload.Tiers(plan, jax.random.key(0)).close()


def test_a_failed_write_back_is_raised_by_flush_not_waited_for_forever(tmp_path):
    """A write-back that fails (a full disk) while later swaps' write-backs are queued: `flush` raises the
    failure (it waited forever on the queued ones), and so does the next swap, naming the table, its store and
    how to go on (the error named none of them)."""
    plan = _plan(_spec(tmp_path / "t", cache_rows=16))
    rng = jax.random.key(0)
    tiers = se.offload.Tiers(plan, rng)
    store, write, calls, release = tiers.tables["t"].store, tiers.tables["t"].store.write, [], threading.Event()

    def failing(rows, values):  # the first write-back fails once the loop has queued the later ones
        calls.append(rows.size)
        if len(calls) == 1:
            release.wait(60)
            raise OSError(28, "No space left on device")
        return write(rows, values)

    store.write = failing
    try:
        tables, step = se.init_tables(plan, rng), train_step(plan)
        batches = [tiers.preprocess({"f_t": _ids(*range(16 * i, 16 * i + 16))})[::2] for i in range(4)]
        for i, (batch, swap) in enumerate(batches[:3]):  # each evicts the last one's rows: a write-back each
            _, tables = step(tiers.swap(tables, swap), batch, i)
        release.set()
        result = {}

        def flush():
            try:
                tiers.flush(tables, 3)
            except RuntimeError as e:
                result["error"] = e

        waiter = threading.Thread(target=flush, daemon=True)
        waiter.start()
        waiter.join(60)
        assert not waiter.is_alive(), "flush waited forever on the write-backs queued after the failed one"
        # the table, its store, the cause, and how to go on
        assert re.fullmatch(r"Table 't': writing evicted rows back to its store at '.*' failed \(OSError: \[Errno 28\] "
                            r"No space left on device\)\. This Tiers cannot go on: each store holds the state of "
                            r"its last flush \(commit\)\. Close it \(tiers\.close\(\)\) and go on from the last "
                            r"checkpoint: a new Tiers opens each store at its last commit\.", str(result["error"]))
        assert isinstance(result["error"].__cause__, OSError) and calls
        with pytest.raises(RuntimeError, match="Table 't': writing evicted rows back to its store at .* failed"):
            tiers.swap(tables, batches[3][1])
    finally:
        tiers.close()


def _one_table(tmp_path, steps: int):
    """One offloaded Adagrad table (a cache of 120 rows), its batches, and in-memory training's losses and state:
    `(feats, batches, losses, state, plan, rng)`."""
    feats, rng = [Feat("a", "a")], jax.random.key(6)
    batches = make_batches(feats, steps, seed=12)
    mem_f, tier_f = make_specs({"a": (se.optimizers.Adagrad(0.1), "sum")}, feats, str(tmp_path), cache_rows=120)
    mem_losses, state = train_in_memory(mem_f, make_mesh(1), batches, rng)
    return feats, batches, mem_losses, state, se.plan(tier_f, make_mesh(1)), rng


def _full_once(monkeypatch) -> list:
    """The disk full for the first block allocation (`os.posix_fallocate`), then room; the calls' offsets."""
    allocate, calls = os.posix_fallocate, []

    def full(fd, offset, length):
        calls.append(offset)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return allocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", full)
    return calls


def test_a_flush_that_failed_is_tried_again_with_the_same_tables(tmp_path, monkeypatch):
    """A flush reads the changed cache rows out, then commits. Its readout went through the swap's donating jit,
    so a commit that failed (a full disk) had consumed the caller's tables: the flush tried again returned them
    deleted, and the next step failed ('Buffer has been deleted or donated'). The readout only reads now: the
    flush tried again once there is room commits, and training goes on as in memory."""
    feats, batches, mem_losses, state, plan, rng = _one_table(tmp_path, 6)
    _full_once(monkeypatch)
    with se.offload.Tiers(plan, rng) as tiers:
        losses, out = train_tiered(tiers, plan, se.init_tables(plan, rng), batches[:3])
        with pytest.raises(OSError, match="No space left on device"):
            tiers.flush(out, 3)
        out = tiers.flush(out, 3)
        more, out = train_tiered(tiers, plan, out, batches[3:], start=3)
        tiers.flush(out, len(batches))
        assert_equal(losses + more, mem_losses, what="losses")
        assert_store_equals(tiers, state, touched_rows(feats, batches))


def test_a_flush_whose_write_log_append_was_torn_is_tried_again(tmp_path, monkeypatch):
    """A flush appends the changed cache rows to the store's write log. A full disk tore the append (a bare
    "[Errno 28] No space left on device"), and the flush tried again appended after the torn entry: every later
    entry read shifted, and the commit merged garbage into the store. The torn entry is cut off, the error names
    the table: the flush tried again commits, and training goes on as in memory."""
    feats, batches, mem_losses, state, plan, rng = _one_table(tmp_path, 6)
    write, log = os.write, {}

    def full(fd, data):  # the write log's next append: a short write (whole entries and a torn one), then full
        if fd != log.get("fd"):
            return write(fd, data)
        if "wrote" in log:
            del log["fd"]  # (room again after this)
            raise OSError(28, "No space left on device")
        log["wrote"] = write(fd, bytes(data)[:len(data) // 2 + 3])
        return log["wrote"]

    monkeypatch.setattr(os, "write", full)
    with se.offload.Tiers(plan, rng) as tiers:
        losses, out = train_tiered(tiers, plan, se.init_tables(plan, rng), batches[:3])
        tiers.wait()
        log["fd"], entry = tiers.tables["a"].store._log.fd, tiers.tables["a"].store._log.entry_bytes
        with pytest.raises(OSError, match=r"Table 'a': the store at .* cannot take the rows written since its last "
                                          r"commit \(No space left on device\)"):
            tiers.flush(out, 3)
        assert log["wrote"] > entry and log["wrote"] % entry  # whole entries, and a torn one
        out = tiers.flush(out, 3)
        more, out = train_tiered(tiers, plan, out, batches[3:], start=3)
        tiers.flush(out, len(batches))
        assert_equal(losses + more, mem_losses, what="losses")
        assert_store_equals(tiers, state, touched_rows(feats, batches))


def test_a_full_disk_at_a_commit_is_an_error_naming_the_table_and_a_later_flush_commits(tmp_path, monkeypatch):
    """A commit writes the rows new to the store into holes of its mapped, sparse records file: on a full disk
    the first page the file could not get was a SIGBUS that killed the process ('Fatal Python error: Bus
    error', nothing else). The blocks are allocated first: the flush raises an OSError naming the table, and
    once there is room again a flush commits, the store equal to in-memory training."""
    feats, batches, mem_losses, state, plan, rng = _one_table(tmp_path, 4)
    calls = _full_once(monkeypatch)
    with se.offload.Tiers(plan, rng) as tiers:
        losses, out = train_tiered(tiers, plan, se.init_tables(plan, rng), batches)
        with pytest.raises(OSError, match=r"Table 'a': the store at .* cannot take the rows written since its last "
                                          r"commit \(No space left on device\); it keeps its last commit\. Free "
                                          r"space on its disk and flush again"):
            tiers.flush(out, len(batches))
        assert tiers.tables["a"].store.step is None
        out = tiers.flush(out, len(batches))
        assert tiers.tables["a"].store.step == len(batches) and len(calls) > 1
        assert_equal(losses, mem_losses, what="losses")
        assert_store_equals(tiers, state, touched_rows(feats, batches))


def test_a_flush_retried_after_a_full_disk_keeps_the_way_back_to_the_commit_before(tmp_path):
    """A commit first saves the committed records it overwrites in an undo log (the way back to the commit
    before). A full disk tore an entry there; the flush retried once there was room appended after it, so every
    later entry read shifted: the commit before no longer restored (a CorruptStoreError for row
    -5022533103482085139, on a real full disk). The log is cut back to its whole entries: the retried flush
    commits, and the store goes back to the commit before as in-memory training had it then."""
    tables = {"a": (se.optimizers.Adagrad(0.1), "sum")}
    feats = [Feat("a", "a")]
    mesh, rng = make_mesh(1), jax.random.key(6)
    batches = make_batches(feats, 4, seed=12)
    mem_f, tier_f = make_specs(tables, feats, str(tmp_path), cache_rows=120)
    _, state, states = train_in_memory(mem_f, mesh, batches, rng, snapshots=(2,))
    plan = se.plan(tier_f, mesh)

    class Torn:  # the undo log's file: its next append writes part of an entry, the disk full; then room again
        def __init__(self, f):
            self.f, self.name, self.full = f, f.name, True

        def write(self, data):
            if not self.full:
                return self.f.write(data)
            self.full = False
            self.f.write(data[:len(data) // 2 + 3])
            self.f.flush()
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    with se.offload.Tiers(plan, rng) as tiers:
        store = tiers.tables["a"].store
        _, out = train_tiered(tiers, plan, se.init_tables(plan, rng), batches[:2])
        out = tiers.flush(out, 2)
        before = store.id
        _, out = train_tiered(tiers, plan, out, batches[2:], start=2)
        store._undo = Torn(store._undo)
        with pytest.raises(OSError, match=r"Table 'a': the store at .* cannot take the rows written since its last "
                                          r"commit \(No space left on device\); it keeps its last commit \(step 2\)"):
            tiers.flush(out, 4)
        out = tiers.flush(out, 4)  # there is room again
        assert_store_equals(tiers, state, touched_rows(feats, batches))
    with se.offload.Tiers(plan, rng) as tiers:
        tiers.tables["a"].store.rollback_to(before)
        assert tiers.tables["a"].store.step == 2
        assert_store_equals(tiers, states[2], touched_rows(feats, batches[:2]))


def test_exporting_an_offloaded_table_for_serving_is_refused(tmp_path):
    """Its array holds the cache's rows (a slot's row, not row i): `export_serving` wrote them as a 64-row table
    ids 0-63 read, silently; `export_delta` too. Both refuse, pointing to the store."""
    plan = _plan(_spec(tmp_path / "t"))
    tables = se.init_tables(plan, jax.random.key(0))
    match = r"tables \['t'\] are offloaded: .*StoreServer"
    with pytest.raises(ValueError, match="export_serving: " + match):
        se.export_serving(tmp_path / "served", plan, tables, dtype="int8")
    assert not (tmp_path / "served").exists()
    in_memory = se.plan([se.FeatureSpec("f_t", se.TableSpec("t", V, D, optimizer=se.optimizers.SGD(0.1)), B)],
                        make_mesh(1))
    se.export_serving(tmp_path / "base", in_memory, se.init_tables(in_memory, jax.random.key(0)))
    with pytest.raises(ValueError, match="export_delta: " + match):
        se.serving.export_delta(tmp_path / "deltas", plan, tables, se.serving.Changes.since(tmp_path / "base"))


@pytest.mark.parametrize("damage", ["lost", "empty", "garbage", "a list"])
def test_a_lost_or_damaged_tier_json_is_a_corrupt_store_naming_the_table(tmp_path, damage):
    """A store without its tier.json (its commit record) was silently started over, its trained rows dropped
    (and its logs removed); a damaged one raised a bare JSONDecodeError. Both are a CorruptStoreError naming the
    table, and the store's files are left as they were."""
    plan, _ = _train_and_flush(tmp_path)
    meta = tmp_path / "t" / "tier.json"
    if damage == "lost":
        meta.unlink()
    else:
        meta.write_text({"empty": "", "garbage": "{not json", "a list": "[1, 2]"}[damage])
    files = sorted(p.relative_to(tmp_path) for p in (tmp_path / "t").rglob("*"))
    match = r"Table 't': the store" + (r" at .* has no tier.json .* holds a store's files" if damage == "lost"
                                       else r"'s tier.json at .* is damaged")
    with pytest.raises(se.offload.CorruptStoreError, match=match):
        se.offload.Tiers(plan, jax.random.key(0))
    with pytest.raises(se.offload.CorruptStoreError if damage != "lost" else FileNotFoundError,
                       match=match if damage != "lost" else r"Table 't': there is no store at .* \(no tier.json\)"):
        se.offload.store_state(plan.tiered_tables["t"], jax.random.key(0))
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "t").rglob("*")) == files


def test_a_store_directory_made_beforehand_is_a_new_store(tmp_path):
    (tmp_path / "t").mkdir()  # empty: a new store, as a path that is not there
    se.offload.Tiers(_plan(_spec(tmp_path / "t")), jax.random.key(0)).close()
    assert (tmp_path / "t" / "tier.json").exists()


@pytest.mark.parametrize("ragged", [False, True])
def test_ids_past_a_sequences_length_take_no_cache_row(tmp_path, ragged):
    """A sequence feature given more ids than its `max_sequence_length`: the lookup truncates them, and the cache
    admitted them anyway (a cache of the rows read was "too small", they counted as lookups and were written back
    dirty). Now: a cache of exactly the rows read suffices, only those count and are stored, and training equals
    the in-memory table's."""
    g, L, n = np.random.default_rng(0), 2, 3
    head = [g.choice(50, (B, L), replace=True) for _ in range(n)]  # rows < 50 read; rows >= 400 only past L
    full = [np.concatenate([h, g.integers(400, V, (B, 3))], 1) for h in head]
    batches = [{"ids": {"s": [r[: 1 + i % 5] for i, r in enumerate(x)] if ragged else x}, "weights": {}}
               for x in full]
    read = [np.concatenate([r[:L] for r in b["ids"]["s"]]) if ragged else b["ids"]["s"][:, :L] for b in batches]
    cache = max(np.unique(r).size for r in read)
    feats = lambda storage: [se.FeatureSpec("s", se.TableSpec("t", V, D, optimizer=se.optimizers.SGD(0.1),
                                                              storage=storage), B, max_sequence_length=L)]
    _, state = train_in_memory(feats(None), make_mesh(1), batches, jax.random.key(0))
    plan = se.plan(feats(se.offload.Offload(str(tmp_path / "t"), cache)), make_mesh(1))
    tiers = se.offload.Tiers(plan, jax.random.key(0))
    try:
        _, tables = train_tiered(tiers, plan, se.init_tables(plan, jax.random.key(0)), batches, ahead=1)
        tiers.flush(tables, n)
        s = tiers.stats()["t"]
        assert s.lookups == sum(r.size for r in read)
        assert not tiers.tables["t"].store.written[50:].any()  # no truncated row was stored
        touched = {"t": np.isin(np.arange(V), np.concatenate([r.ravel() for r in read]))}
        assert_store_equals(tiers, state, touched)
    finally:
        tiers.close()


def test_a_batch_preprocessed_beside_a_running_prefetch_is_refused(tmp_path):
    """An evaluation batch preprocessed by hand while a training prefetch runs took a place in its swap order
    (its swap ran the prefetch's planned swaps early, and the loop failed later, or not, by timing). Refused while
    the prefetch runs; fine once it ended or was closed. `Tiers` is a context manager; a commit's step is >= 0."""
    plan = _plan(_spec(tmp_path / "t"))
    rng = jax.random.key(0)
    with se.offload.Tiers(plan, rng) as tiers:
        tables, step = se.init_tables(plan, rng), train_step(plan)
        batches = [{"f_t": _ids(*range(4 * i, 4 * i + 4))} for i in range(6)]
        prefetcher = tiers.prefetch(batches, buffer_size=2)
        item = next(prefetcher)
        _, tables = step(tiers.swap(tables, item.swap), item.batch, 0)
        with pytest.raises(RuntimeError, match=r"Tiers.preprocess \(tables \['t'\]\): a prefetch of this Tiers is "
                                               r"still running"):
            tiers.preprocess({"f_t": _ids(7)}, train=False)
        for i, item in enumerate(prefetcher, 1):  # the loop goes on as if nothing happened
            _, tables = step(tiers.swap(tables, item.swap), item.batch, i)
        batch, _, swap = tiers.preprocess({"f_t": _ids(7)}, train=False)  # it ended: evaluation batches are fine
        tables = tiers.swap(tables, swap)
        for _ in range(3):  # a loop left early, its prefetcher dropped (closed when collected): fine at once
            for item in tiers.prefetch(batches, buffer_size=2):
                tables = tiers.swap(tables, item.swap)
                break
            tables = tiers.swap(tables, tiers.preprocess({"f_t": _ids(7)}, train=False)[2])
        with pytest.raises(ValueError, match=r"A commit.s step must be >= 0 \(as a checkpoint.s\), got -1"):
            tiers.flush(tables, -1)
        assert tiers.tables["t"].store.commit == 0
    with pytest.raises(ValueError, match="is closed"):
        tiers.preprocess({"f_t": _ids(7)})


@pytest.mark.parametrize("on_overflow", ["drop", "error"])
def test_an_explicit_capacity_overflows_as_in_memory_on_several_devices(tmp_path, on_overflow):
    """An explicit capacity bounds each (device, shard) partition's ids: a cache row's shard must be its row's
    in-memory shard, else other ids overflow. Ids all on even rows (shard 0 of 2 in memory): the in-memory table
    dropped 16 a batch and the offloaded one 0-4 (and trained otherwise), silently; "error" raised at other
    batches. Now both drop the same ids and train alike, or raise alike."""
    g = np.random.default_rng(0)
    batches = [{"f_t": 2 * g.integers(0, 100, (B, 4))} for _ in range(4)]
    results = {}
    for where in ("memory", "offloaded"):
        spec = _spec(tmp_path / "t", cache_rows=200) if where == "offloaded" else \
            se.TableSpec("t", V, D, optimizer=se.optimizers.SGD(0.1))
        plan = se.plan([se.FeatureSpec("f_t", spec, B)], make_mesh(2), capacity=3, on_overflow=on_overflow)
        rng = jax.random.key(0)
        tables, step, out = se.init_tables(plan, rng), train_step(plan), []
        tiers = se.offload.Tiers(plan, rng) if where == "offloaded" else None
        try:
            for i, b in enumerate(batches):
                if tiers is None:
                    batch, stats = se.preprocess(plan, b)
                else:
                    batch, stats, swap = tiers.preprocess(b)
                    tables = tiers.swap(tables, swap)
                loss, tables = step(tables, batch, i)
                out.append((float(loss), int(sum(np.sum(v) for v in stats.dropped_ids.values()))))
        except ValueError as e:
            out.append(str(e))
        finally:
            if tiers is not None:
                tiers.close()
        results[where] = out
    assert results["offloaded"] == results["memory"]
    if on_overflow == "drop":
        assert len(results["memory"]) == 4 and all(d > 0 for _, d in results["memory"])  # ids were dropped
    else:
        assert re.search(r"partition \(device \d, shard 0\) has \d+ ids but the capacity is", results["memory"][0])
