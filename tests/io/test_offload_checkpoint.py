"""CheckpointManager with offloaded tables: each store's commit recorded beside the in-memory tables, and made
that commit again on restore (sparse_embed/io/offload_checkpoint.py, docs/offload.md).

The run: two offloaded tables (Adagrad; Adam, whose bias correction counts the global step) and one in memory,
caches much smaller than the tables. Saved at step 3 and 6, interrupted, restored at 3 (its stores gone past it
by two commits), trained on to the end: the stores and the in-memory table equal plain in-memory training
bitwise. A save killed by SIGKILL after its flush leaves the step before restorable, its stores brought back.
A store that is not the checkpoint's, or no longer keeps its commit, is refused before anything changes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import sparse_embed as se
from sparse_embed.tiers import store as tier_store
from tests.conftest import make_mesh
from tests.tiers.test_offload_training import (
    CACHE, Feat, assert_store_equals, make_batches, make_specs, touched_rows, train_in_memory, train_tiered,
)

TABLES = {"adagrad": (se.optimizers.Adagrad(0.1), "mean"), "adam": (se.optimizers.Adam(0.01), "mean"),
          "plain": (se.optimizers.RowwiseAdagrad(0.1), "sum")}
FEATS = [Feat("f", "adagrad"), Feat("w", "adagrad", weighted=True), Feat("a", "adam"), Feat("p", "plain")]
STEPS = 9


def _setup(tmp_path, feats=FEATS):
    batches = make_batches(feats, STEPS, seed=3)
    mem_f, tier_f = make_specs(TABLES, feats, str(tmp_path / "stores"), {None: CACHE, "adagrad": 2 * CACHE},
                               tiered=("adagrad", "adam"))
    return batches, mem_f, se.plan(tier_f, make_mesh(2)), str(tmp_path / "ckpt")


@pytest.fixture
def setup(tmp_path):
    return _setup(tmp_path)


def _commit_of(spec: se.TableSpec) -> tuple:
    """`(commit, id, step)` of a table's store (opened and closed again)."""
    s = tier_store.RowStore(spec)
    s.close()
    return s.commit, s.id, s.step


def _train_and_save(plan, batches, ckpt, rng, saves=(3, 6), until=None):
    """Trains `batches[:until]` (default: up to the last save) through a Tiers, flushing and saving at `saves`;
    closes the Tiers (as a killed run would leave it: the stores at their last commit)."""
    tiers = se.offload.Tiers(plan, rng)
    tables, done = se.init_tables(plan, rng), 0
    with se.CheckpointManager(ckpt, max_to_keep=5) as m:
        for s in saves:
            _, tables = train_tiered(tiers, plan, tables, batches[done:s], start=done)
            tables = tiers.flush(tables, s)
            assert m.save(s, plan, tables, tiers=tiers)
            done = s
        if until is not None:
            _, tables = train_tiered(tiers, plan, tables, batches[done:until], start=done)
            tiers.flush(tables, until)
    tiers.close()


@pytest.mark.parametrize("in_memory", [True, False], ids=["with_a_table_in_memory", "only_offloaded"])
def test_restore_an_older_step_and_train_on_equals_an_uninterrupted_run(tmp_path, in_memory):
    feats = FEATS if in_memory else [f for f in FEATS if f.table != "plain"]
    batches, mem_f, plan, ckpt = _setup(tmp_path, feats)
    assert plan.tiered and (len(plan.stacks) > len(plan.tiered)) == in_memory
    rng = jax.random.key(7)
    _, want = train_in_memory(mem_f, make_mesh(2), batches, rng)
    _train_and_save(plan, batches, ckpt, rng, until=7)  # saved at 3 and 6; the stores committed at 7
    assert [_commit_of(t)[2] for t in plan.tiered] == [7, 7]

    with se.CheckpointManager(ckpt) as m:
        r = m.restore(plan, step=3)  # the stores go back three commits
    assert r.step == 3 and sorted(r.tables) == sorted(plan.stack_names)
    tiers = se.offload.Tiers(plan, rng)
    try:
        assert all(t.store.step == 3 for t in tiers.tables.values())
        _, tables = train_tiered(tiers, plan, r.tables, batches[3:], start=3, buffer_size=2)
        tables = tiers.flush(tables, STEPS)
        assert all(s.rows_read > 0 for s in tiers.stats().values())
        assert_store_equals(tiers, want, touched_rows(feats, batches))
        for k, v in se.unstack_state(plan, tables).get("plain", {}).items():
            np.testing.assert_array_equal(v, want["plain"][k], err_msg=f"plain/{k}")
    finally:
        tiers.close()
    # going back dropped the commits after step 3: step 6's checkpoint no longer matches the stores
    with se.CheckpointManager(ckpt) as m, pytest.raises(se.CheckpointError, match=r"Table 'adagrad'.*needs commit "
                                                                                 r"\d+ \(step 6.*keeps .*\(\d+, 3\)"):
        m.restore(plan, step=6)


def test_convert_keeps_the_offload_records_and_the_data_item(setup, tmp_path):
    """A converted checkpoint lost its offloaded tables' commit records (its restore refused the plan) and its
    input position; a serving copy left the offloaded tables out without a word (now refused)."""
    batches, _, plan, ckpt = setup
    rng = jax.random.key(7)
    tiers = se.offload.Tiers(plan, rng)
    try:
        _, tables = train_tiered(tiers, plan, se.init_tables(plan, rng), batches[:3], start=0)
        tables = tiers.flush(tables, 3)
        with se.CheckpointManager(ckpt) as m:
            assert m.save(3, plan, tables, tiers=tiers, data={"pos": 3})
    finally:
        tiers.close()
    out = se.convert_checkpoint(ckpt, tmp_path / "converted", devices=1)
    assert se.read_info(out).has_data
    with se.CheckpointManager(ckpt) as m:
        want = m.restore(plan)
    with se.CheckpointManager(tmp_path / "converted") as m:
        got = m.restore(plan)
    assert (got.step, got.data) == (3, {"pos": 3}) and sorted(got.tables) == sorted(want.tables)
    for a, b in zip(jax.tree.leaves(want.tables), jax.tree.leaves(got.tables)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(se.CheckpointError, match=r"has offloaded tables .*a serving copy would leave them out"):
        se.convert_checkpoint(ckpt, tmp_path / "serving", serving=True)


def test_a_store_that_is_not_the_checkpoints_is_refused(setup, monkeypatch):
    batches, _, plan, ckpt = setup
    rng = jax.random.key(7)
    _train_and_save(plan, batches, ckpt, rng)
    adam = plan.tiered_tables["adam"]
    before = _commit_of(plan.tiered_tables["adagrad"])

    shutil.rmtree(adam.storage.path)  # another run's store at the same path
    tier_store.RowStore(adam).close()
    se.offload.write_store(adam, se.offload.store_state(adam, jax.random.key(1)), step=6)
    with se.CheckpointManager(ckpt) as m, pytest.raises(se.CheckpointError,
                                                        match=r"Table 'adam': the checkpoint .* needs commit \d+ "
                                                              r"\(step 6.*does not keep"):
        m.restore(plan)
    assert _commit_of(plan.tiered_tables["adagrad"]) == before  # every store checked before any changes

    # a store keeps its last KEPT_COMMITS commits: older checkpoints are refused, naming what it keeps
    monkeypatch.setattr(tier_store, "KEPT_COMMITS", 2)
    shutil.rmtree(os.path.dirname(adam.storage.path))
    shutil.rmtree(ckpt)
    _train_and_save(plan, batches, ckpt, rng, saves=(1, 2, 3))
    with se.CheckpointManager(ckpt) as m:
        with pytest.raises(se.CheckpointError, match=r"Table 'adagrad'.*step 1.*keeps \[\(2, 2\), \(3, 3\)\]"):
            m.restore(plan, step=1)
        m.restore(plan, step=2)


def test_save_and_restore_errors(setup):
    batches, mem_f, plan, ckpt = setup
    rng = jax.random.key(7)
    tiers = se.offload.Tiers(plan, rng)
    try:
        _, tables = train_tiered(tiers, plan, se.init_tables(plan, rng), batches[:2])
        with se.CheckpointManager(ckpt) as m:
            with pytest.raises(ValueError, match=r"Tables \['adagrad', 'adam'\] are offloaded: flush them and pass"):
                m.save(2, plan, tables)
            with pytest.raises(ValueError, match=r"Table 'adagrad' \(offloaded\): its store's last commit is step "
                                                 r"None.*tiers.flush\(tables, 2\)"):
                m.save(2, plan, tables, tiers=tiers)
            tables = tiers.flush(tables, 2)
            _, tables = train_tiered(tiers, plan, tables, batches[2:3], start=2)
            with pytest.raises(ValueError, match="batches have trained its cache since"):
                m.save(2, plan, tables, tiers=tiers)
            tables = tiers.flush(tables, 3)
            assert m.save(3, plan, tables, tiers=tiers)
            m.wait()
            with pytest.raises(se.CheckpointError, match=r"Table 'adagrad': its store .* is open"):
                m.restore(plan)
    finally:
        tiers.close()
    with se.CheckpointManager(ckpt) as m, pytest.raises(se.CheckpointError, match="Table 'adagrad' is in memory in "
                                                                                 "the plan but offloaded in the"):
        m.restore(se.plan(mem_f, make_mesh(2)))
    record = os.path.join(ckpt, "3", "embeddings", "offload.json")
    with open(record) as f:
        saved = json.load(f)
    assert sorted(saved["stores"]) == ["adagrad", "adam"] and saved["stores"]["adam"]["step"] == 3
    saved["stores"]["adam"]["commit"] += 1
    with open(record, "w") as f:
        json.dump(saved, f)
    with se.CheckpointManager(ckpt) as m, pytest.raises(se.CorruptCheckpointError, match="offload.json fails its "
                                                                                         "checksum"):
        m.restore(plan, step=3)


def _three_commits(path):
    """A small store with three commits: `(store, spec, [(written, stored rows, their records)], [ids])`."""
    spec = se.TableSpec("t", 50, 4, optimizer=se.optimizers.Adagrad(0.1), storage=se.offload.Offload(path, 8))
    s = tier_store.RowStore(spec)
    g = np.random.default_rng(0)
    states, ids = [], []
    for rows in ([1, 2, 3], [2, 3, 4, 9], [1, 40]):
        s.write(np.asarray(rows), g.standard_normal((len(rows), 8)).astype(np.float32))
        s.commit_step(len(states))
        stored = np.flatnonzero(s.written)
        states.append((s.written.copy(), stored, s.read(stored).copy()))
        ids.append(s.id)
    return s, spec, states, ids


def assert_holds(s, state):
    written, stored, values = state
    np.testing.assert_array_equal(s.written, written)
    np.testing.assert_array_equal(s.read(stored), values)


def test_rollback_to_a_kept_commit(tmp_path):
    """`RowStore.rollback_to` against a plain record of each commit: rows, the stored bitmap, uncommitted writes
    undone too; a reopened store is the rolled-back commit; the rows it restores are in its changes."""
    s, spec, states, ids = _three_commits(str(tmp_path / "t"))
    s.write(np.asarray([3, 7]), np.ones((2, 8), np.float32))  # not committed
    s.rollback_to(ids[0])
    assert_holds(s, states[0])
    assert s.id == ids[0] and s.step == 0 and s.commit == 4
    np.testing.assert_array_equal(np.load(tmp_path / "t" / "changes.4.npy"), [1, 2, 3, 4, 7, 9, 40])
    with pytest.raises(tier_store.CorruptStoreError, match=r"Table 't': the store .* does not keep commit 'nope'"):
        s.rollback_to("nope")
    s.close()
    s = tier_store.RowStore(spec)
    assert s.id == ids[0] and [h["id"] for h in s.history][1:] == ids[:1]
    assert_holds(s, states[0])
    s.close()


def test_a_rollback_cut_short_reopens_as_the_last_commit(tmp_path, monkeypatch):
    """Killed halfway through rewriting the rows (the process's store object is simply abandoned), the store
    reopens as its last commit, and the rollback done again gives the kept commit."""
    s, spec, states, ids = _three_commits(str(tmp_path / "t"))
    io = tier_store.RowStore._io

    def dies_in_a_write(self, rows, data, write):
        if write:
            io(self, rows[:len(rows) // 2], data[:len(rows) // 2], write)
            raise OSError("killed")
        io(self, rows, data, write)

    monkeypatch.setattr(tier_store.RowStore, "_io", dies_in_a_write)
    with pytest.raises(OSError, match="killed"):
        s.rollback_to(ids[0])
    s.close()  # what a killed process leaves: the files as they are (closing commits nothing)
    monkeypatch.undo()
    again = tier_store.RowStore(spec)
    assert again.id == ids[2]
    assert_holds(again, states[2])
    again.rollback_to(ids[0])
    assert_holds(again, states[0])
    again.close()


def test_a_server_picks_up_a_rollback(tmp_path):
    """A `StoreServer` of the store sees a rollback as a new commit: the rows it restores and the rows it no
    longer holds (served as the default) change in its cache."""
    s, _, states, ids = _three_commits(str(tmp_path / "t"))
    server = se.offload.StoreServer(str(tmp_path / "t"), cache_bytes=1 << 20, refresh_seconds=None)
    rows = np.arange(50)

    def served(state):
        _, stored, values = state
        want = np.zeros((50, 4), np.float32)
        want[stored] = values[:, :4]
        return want

    np.testing.assert_array_equal(server.lookup(rows), served(states[2]))
    s.rollback_to(ids[0])
    assert server.refresh()
    np.testing.assert_array_equal(server.lookup(rows), served(states[0]))
    server.close()
    s.close()


# The child: saves step 3, trains on, flushes step 6 (its stores commit) and is killed by SIGKILL while saving
# step 6, before the checkpoint is complete.
CHILD = textwrap.dedent("""
    import os, signal, sys
    from tests.io import test_offload_checkpoint as t
    from sparse_embed.io import offload_checkpoint
    write = offload_checkpoint.write_commits

    def dying(directory, commits):
        if commits is not None and commits.stores["adam"]["step"] == 6:
            os.kill(os.getpid(), signal.SIGKILL)
        write(directory, commits)

    offload_checkpoint.write_commits = dying
    t.killed_run(sys.argv[1])
    sys.exit(3)  # not killed
""")


def _killed_setup(root: str):
    batches = make_batches(FEATS, STEPS, seed=3)
    mem_f, tier_f = make_specs(TABLES, FEATS, os.path.join(root, "stores"), {None: CACHE, "adagrad": 2 * CACHE},
                               tiered=("adagrad", "adam"))
    return batches, mem_f, se.plan(tier_f, make_mesh(2)), os.path.join(root, "ckpt")


def killed_run(root: str) -> None:
    """What the child runs (see CHILD)."""
    batches, _, plan, ckpt = _killed_setup(root)
    rng = jax.random.key(7)
    tiers = se.offload.Tiers(plan, rng)
    tables = se.init_tables(plan, rng)
    with se.CheckpointManager(ckpt) as m:
        for lo, hi in ((0, 3), (3, 6)):
            _, tables = train_tiered(tiers, plan, tables, batches[lo:hi], start=lo)
            tables = tiers.flush(tables, hi)
            m.save(hi, plan, tables, tiers=tiers)
            m.wait()


def test_a_save_killed_after_its_flush_restores_the_step_before(tmp_path):
    """SIGKILL in the middle of saving step 6 (the stores already committed at 6): the manager's latest complete
    step is 3, and restoring it brings the stores back to step 3: equal to in-memory training of 3 steps."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: `reference`, as pytest has it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(here), here]), "JAX_PLATFORMS": "cpu"}
    child = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=env, capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    batches, mem_f, plan, ckpt = _killed_setup(str(tmp_path))
    assert [_commit_of(t)[2] for t in plan.tiered] == [6, 6]
    rng = jax.random.key(7)
    _, _, states = train_in_memory(mem_f, make_mesh(2), batches[:3], rng, snapshots=(3,))
    with se.CheckpointManager(ckpt) as m:
        assert m.latest_step() == 3
        r = m.restore(plan)
    for spec in plan.tiered:
        for k, v in se.offload.store_state(spec, rng).items():
            np.testing.assert_array_equal(v, states[3][spec.name][k], err_msg=f"{spec.name}/{k}")
    for k, v in se.unstack_state(plan, r.tables)["plain"].items():
        np.testing.assert_array_equal(v, states[3]["plain"][k], err_msg=f"plain/{k}")
