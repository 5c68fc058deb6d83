"""Offloaded tables under jax.distributed: two processes (4 CPU devices each) train as the same tables in memory.

The workers (tests/tiers/multiprocess/offload_worker.py) train the run of `offload_scenario` twice on the
8-device mesh of both processes: in memory, and with four tables offloaded, one keyed by raw ids (its map run
by `Tiers` as in memory, its rows cached and stored like the others') (by hand two batches ahead, a
flush and a checkpoint, a batch refused on one process, then `prefetch`, a flush, a batch that reads rows
damaged in one process's store; then the checkpoint restored, its stores a commit back, and the last steps
trained again through a new Tiers). Each process keeps its rows (r % 2) in its own
store; read back whole (`store_state`), the stores equal the in-memory tables bitwise, and both equal one
process's in-memory run to float32 rounding (gloo sums across processes in another order).
"""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
import pytest

import sparse_embed as se
from conftest import make_mesh
from sparse_embed.tiers import store as tier_store

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "multiprocess"), os.path.join(HERE, "..", "host", "multiprocess")]

import launch  # noqa: E402
import offload_scenario as sc  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out, root = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("stores")
    launch.run_workers(os.path.join(HERE, "multiprocess", "offload_worker.py"), 2, [str(out), str(root)],
                       devices_per_process=4, timeout=180)
    workers = [json.loads((out / f"worker{i}.json").read_text()) for i in range(2)]
    return dict(np.load(out / "results.npz")), workers, str(root), str(out / "ckpt")


def test_two_processes_train_offloaded_tables_as_in_memory(run):
    got, workers, root, _ = run
    rng = jax.random.key(0)
    one = sc.train_in_memory(se.plan(sc.features(None), make_mesh(8)))
    for spec in se.plan(sc.features(root), make_mesh(8)).tiered:
        assert sorted(os.listdir(spec.storage.path)) == ["process0of2", "process1of2"]
        if spec.dynamic:
            _check_raw_stores(spec, got, one)
            continue
        state = se.offload.store_state(spec, rng)
        for k, v in state.items():
            np.testing.assert_array_equal(v, got[f"memory/{spec.name}/{k}"], err_msg=f"{spec.name}/{k}")
            np.testing.assert_allclose(v, one[spec.name][k], rtol=1e-5, atol=1e-6, err_msg=f"{spec.name}/{k}")
    for k, v in one["plain"].items():
        np.testing.assert_array_equal(got[f"tiered/plain/{k}"], got[f"memory/plain/{k}"], err_msg=f"plain/{k}")
        np.testing.assert_array_equal(got[f"resumed/plain/{k}"], got[f"memory/plain/{k}"], err_msg=f"plain/{k}")
    for name in sc.TIERED:
        s0, s1 = (w["stats"][name] for w in workers)
        for k in ("lookups", "hits", "misses"):  # the cache's decisions and counts: the same on both
            assert s0[k] == s1[k], (name, k, s0, s1)
        assert 0 < s0["hits"] < s0["lookups"], s0
        # each process reads, generates and writes back only its own rows
        assert s0["misses"] == sum(s[k] for s in (s0, s1) for k in ("fresh", "rows_read", "from_evicted")), (s0, s1)
        assert s0["rows_written"] > 0 and s1["rows_written"] > 0 and s0["rows_read"] + s1["rows_read"] > 0


def _check_raw_stores(spec, got, one):
    """The raw-id table's stores: each process's holds rows r % 2 == its index, the rows its map gave ids, each
    equal to the in-memory row bitwise (two processes) and to float32 rounding (one)."""
    cols = ["table", *spec.resolved_optimizer.slots(spec.embedding_dim)]
    want = np.concatenate([got[f"memory/{spec.name}/{k}"] for k in cols], 1)
    single = np.concatenate([one[spec.name][k] for k in cols], 1)
    for i in range(2):
        store = tier_store.RowStore(spec, path=tier_store.shard_path(spec.storage.path, i, 2))
        try:
            rows = np.flatnonzero(store.written)
            assert rows.size > sc.RAW_V // 4 and (rows % 2 == i).all(), rows
            np.testing.assert_array_equal(store.read(rows), want[rows], err_msg=f"{spec.name}: process {i}'s rows")
            np.testing.assert_allclose(store.read(rows), single[rows], rtol=1e-5, atol=1e-6)
        finally:
            store.close()


def test_bad_input_on_one_process_raises_on_every_process(run):
    _, workers, _, _ = run
    assert "Feature 'f'" in workers[1]["messages"]["bad_id"] and str(sc.V + 5) in workers[1]["messages"]["bad_id"]
    assert "failed on process(es) [1]" in workers[0]["messages"]["bad_id"]


def test_a_damaged_row_read_by_one_process_raises_on_every_process(run):
    _, workers, _, _ = run
    assert "CorruptStoreError: Table 'adagrad': row" in workers[1]["messages"]["damaged"], workers[1]
    assert "failed on process(es) [1]" in workers[0]["messages"]["damaged"], workers[0]


def test_a_store_or_checkpoint_of_two_processes_is_refused_by_one(run):
    _, _, root, ckpt = run
    plan = se.plan(sc.features(root), make_mesh(8))
    with pytest.raises(ValueError, match=r"Table 'adagrad': the store at .* was written by 2 process\(es\).*this "
                                         r"run has 1"):
        se.offload.Tiers(plan, jax.random.key(0))
    with pytest.raises(ValueError, match="written by 2 process"):
        se.offload.write_store(plan.tiered_tables["adagrad"], {})
    with pytest.raises(ValueError, match=r"written by 2 processes .*: serving reads a store of one process"):
        se.offload.StoreServer(os.path.join(root, "adagrad"))
    assert sorted(n for n in os.listdir(os.path.join(ckpt, str(sc.FLUSH_AT), "embeddings")) if "offload" in n) == [
        "offload.process0of2.json", "offload.process1of2.json"]
    with se.CheckpointManager(ckpt) as m, pytest.raises(se.CheckpointError, match="saved by another number of "
                                                                                 "processes than this run's 1"):
        m.restore(plan)
