"""Multi-process training under jax.distributed: N local processes × 8/N CPU devices each.

The same run (tests/host/multiprocess/scenario.py) in N worker processes and in
this process (8 devices) must give the same tables, losses and Stats;
checkpoints cross between process counts; errors are raised on every process.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

import sparse_embed as se
import sparse_embed.serving as ss
from conftest import make_mesh

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess")
sys.path.insert(0, HERE)

import launch  # noqa: E402
import scenario  # noqa: E402
from sparse_embed.core.sparsecore import layout as sparsecore_layout  # noqa: E402


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run in this process on 8 devices, and a checkpoint of its final state."""
    plan = scenario.make_plan(make_mesh(8))
    tables, losses, stats, programs = scenario.train(plan)
    ckpt = str(tmp_path_factory.mktemp("ref_ckpt"))
    with se.CheckpointManager(ckpt) as m:
        m.save(scenario.STEPS, plan, tables)
    drop_plan = scenario.make_plan(make_mesh(8), capacity=8, on_overflow="drop")
    drop_batch, drop_stats = se.preprocess(drop_plan, scenario.global_ids(drop_plan, scenario.GROW_AT),
                                           device_put=False)
    placed = scenario.make_plan(make_mesh(8), placement=scenario.PLACEMENT)
    placed_tables, placed_losses, _, _ = scenario.train(placed)
    sparsecore_batches = {}
    if sparsecore_layout.available():
        with pytest.warns(UserWarning, match="Stack 'users' runs on the usual kernels"):  # max_norm
            sc_plan = scenario.make_plan(make_mesh(8), sparsecores=2)
        sparsecore_batches = {step: se.preprocess(sc_plan, scenario.global_ids(sc_plan, step), device_put=False)
                              for step in (0, scenario.GROW_AT)}
    return dict(tables=se.unstack_tables(plan, tables), losses=np.array(losses), stats=scenario.stats_array(stats),
                programs=programs, ckpt=ckpt, drop_batch=drop_batch, drop_stats=scenario.stats_array(drop_stats),
                placed=se.unstack_tables(placed, placed_tables), placed_losses=np.array(placed_losses),
                sparsecore=sparsecore_batches)


def test_reference_grows_capacity_once(reference):
    caps = reference["stats"][:, -2:]  # capacity of both stacks, per step
    assert (caps[scenario.GROW_AT] > caps[0]).any() and (caps[:scenario.GROW_AT] == caps[0]).all()
    assert (caps[scenario.GROW_AT:] == caps[scenario.GROW_AT]).all()
    assert reference["programs"] == 2  # one compile, one recompile for the growth


@pytest.mark.parametrize("num_processes", [2, 4])
def test_multiprocess_run_equals_single_process(reference, tmp_path, num_processes):
    launch.run_workers(os.path.join(HERE, "worker.py"), num_processes, [str(tmp_path), reference["ckpt"]],
                       devices_per_process=8 // num_processes, timeout=120)
    got = dict(np.load(tmp_path / "results.npz"))

    # training: same tables, losses, (global) Stats and number of compiled programs
    for name, want in reference["tables"].items():
        np.testing.assert_allclose(got[f"trained/{name}"], want, rtol=0, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(got["losses"], reference["losses"], rtol=1e-6, atol=1e-5)  # summed in another order
    np.testing.assert_array_equal(got["stats"], reference["stats"])
    assert int(got["programs"]) == reference["programs"]

    # checkpoint 1 process -> N processes, and N processes -> 1 process (on a 4-device sub-mesh)
    for name, want in reference["tables"].items():
        np.testing.assert_array_equal(got[f"restored/{name}"], want, err_msg=name)
        np.testing.assert_array_equal(got[f"placed_restored/{name}"], want, err_msg=name)  # into other placements

    # placements ("table", "replicated", "column"): the same training as in one process, and as row-wise
    for name, want in reference["placed"].items():
        np.testing.assert_allclose(got[f"placed/{name}"], want, rtol=0, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(want, reference["tables"][name], rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(got["placed_losses"], reference["placed_losses"], rtol=1e-6, atol=1e-5)
    plan4 = scenario.make_plan(make_mesh(4))
    restored = se.CheckpointManager(str(tmp_path / "ckpt")).restore(plan4)
    assert restored.step == scenario.STEPS
    for name, want in se.unstack_tables(plan4, restored.tables).items():
        np.testing.assert_array_equal(want, got[f"trained/{name}"], err_msg=name)

    # explicit capacity, on_overflow="drop": the assembled batch and the Stats equal one process's
    np.testing.assert_array_equal(got["drop/stats"], reference["drop_stats"])
    assert reference["drop_stats"][0, 4:6].sum() > 0  # ids were dropped
    for name, coo in reference["drop_batch"].items():
        for field, want in zip(coo._fields, coo):
            if want is not None:  # keys: raw-id tables only
                np.testing.assert_array_equal(got[f"drop/{name}/{field}"], want, err_msg=f"{name}/{field}")
        assert str(got[f"drop/{name}/layout"]) == coo.layout.digest  # each process marks it as one process does

    # SparseCore stacks: the CSR assembled from every process's devices, and its agreed limit, equal one process's
    for step, (batch, stats) in reference["sparsecore"].items():
        assert int(got[f"sparsecore/{step}/needed"]) == stats.sparsecore_ids_per_partition["items_tags"]
        for field, want in zip(batch["items_tags"].csr._fields, batch["items_tags"].csr):
            np.testing.assert_array_equal(got[f"sparsecore/{step}/{field}"].view(np.int32), want.view(np.int32),
                                          err_msg=f"{step}/{field}")

    # errors: raised on every process, with the reason on the process that caused it
    msgs = [json.loads((tmp_path / f"messages{i}.json").read_text()) for i in range(num_processes)]
    last = num_processes - 1
    for i, m in enumerate(msgs):
        assert "capacity is 8" in m["overflow"], m
        if i == last:
            assert f"got {scenario.B // num_processes - 1} samples" in m["batch"] and "own rows" in m["batch"], m
        else:
            assert f"failed on process(es) [{last}]" in m["batch"], m
        if i == last:  # the sample is this process's, and the message says so
            assert "id 1000 in sample 2 is out of range" in m["id"] and (
                f"On process {last} of {num_processes}: samples are numbered within the rows this process passed"
                in m["id"]), m
        else:
            assert f"failed on process(es) [{last}]" in m["id"], m
        if i == 0:
            assert f"got {scenario.B} samples" in m["global"] and f"must pass {scenario.B // num_processes}" in m["global"]
        else:
            assert "failed on process(es) [0]" in m["global"], m


def test_launcher_kills_all_workers_when_one_fails(tmp_path):
    script = tmp_path / "w.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['SE_PROCESS_ID'] == '1':\n"
                      "    print('bad input on worker 1'); sys.exit(3)\n"
                      "time.sleep(60)\n")
    with pytest.raises(launch.WorkersFailed, match=r"(?s)worker\(s\) \[1\] exited with \[3\].*bad input on worker 1"):
        launch.run_workers(str(script), 2, [], devices_per_process=4, timeout=30)
    script.write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(launch.WorkersFailed, match="timed out after 1 s"):
        launch.run_workers(str(script), 2, [], devices_per_process=4, timeout=1)


def test_raw_id_tables_map_alike_on_two_processes(tmp_path):
    """2 processes x 4 devices admit, expire, evict and train raw-id tables (one with 4-byte keys) as 1 x 8
    does; the checkpoint restores in this process with the same id -> vector mapping."""
    import raw_scenario

    plan = raw_scenario.make_plan(make_mesh(8))
    tables, maps, stats = raw_scenario.train(plan)
    assert maps["visits"].rows.sorted_keys.ndim == 1 and maps["users"].rows.sorted_keys.ndim == 2
    want = raw_scenario.contents(plan, tables, maps)
    assert stats[:, 0].sum() > 0 and stats[:, 1].sum() + stats[:, 2].sum() > 0  # admitted; evicted or expired
    launch.run_workers(os.path.join(HERE, "raw_worker.py"), 2, [str(tmp_path)], devices_per_process=4, timeout=120)
    got = dict(np.load(tmp_path / "results.npz"))
    np.testing.assert_array_equal(got.pop("stats"), stats)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=0, atol=1e-6, err_msg=k)
    r = se.CheckpointManager(tmp_path / "ckpt").restore(plan)
    for k, v in raw_scenario.contents(plan, r.tables, r.id_maps).items():
        np.testing.assert_allclose(v, want[k], rtol=0, atol=1e-6, err_msg=k)
    # the serving export both processes wrote (was: both wrote the one staging directory, and the save hung)
    served, _ = se.load_serving(tmp_path / "serving")
    np.testing.assert_allclose(np.asarray(served["items"]), want["items"], rtol=0, atol=1e-6)
    for name in raw_scenario.RAW:
        ids, table = served[name]
        live = want[f"{name}/ids"] != -1
        order = np.argsort(want[f"{name}/ids"][live])
        np.testing.assert_array_equal(ids, want[f"{name}/ids"][live][order], err_msg=name)
        np.testing.assert_allclose(np.asarray(table)[: ids.size], want[f"{name}/vectors"][live][order], rtol=0,
                                   atol=1e-6, err_msg=name)
    # a delta from trackers of each process's own ids (process 0 wrote it) == the full export after it, bit for bit
    # (was: only process 0's rows; and a process slower than process 0 found the file and failed)
    live = ss.LiveTables(tmp_path / "served8")
    assert live.catch_up(tmp_path / "deltas") == 1
    full, _ = se.load_serving(tmp_path / "full8")
    for name, a in full.items():
        got = live.snapshot.tables[name]
        if isinstance(a, tuple):
            np.testing.assert_array_equal(got[0], a[0], err_msg=name)
            got, a = got[1], a[1]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(a), err_msg=name)


def test_one_process_feeds_every_row_and_a_bad_feature_is_named():
    """`process_rows` / `process_slice` in the one process of an 8-device mesh: every row, every format (the
    worker processes above check their own slices against this process's run)."""
    t = se.TableSpec("t", 30, 4)
    plan = se.plan([se.FeatureSpec("d", t, 16), se.FeatureSpec("r", t, 16)], make_mesh(8))
    assert se.distributed.local_positions(plan) == list(range(8))
    assert se.distributed.process_rows(plan, "d") == slice(0, 16)
    dense, lengths = np.arange(32).reshape(16, 2) % 30, np.arange(16) % 3
    got = se.distributed.process_slice(plan, {"d": dense, "r": (np.arange(lengths.sum()) % 30, lengths)})
    np.testing.assert_array_equal(got["d"], dense)
    np.testing.assert_array_equal(got["r"][1], lengths)
    assert got["r"][0].size == lengths.sum()
    for bad in ({"d": dense}, "zz"):  # was: TypeError: unhashable type: 'dict' / KeyError
        with pytest.raises(ValueError, match=r"process_rows: feature must name one of the plan's features "
                                             r"\['d', 'r'\]"):
            se.distributed.process_rows(plan, bad)
