"""Exact resume: a training run (tests/host/multiprocess/resume_run.py) killed with SIGKILL at random steps and
resumed each time from its last checkpoint ends with the same tables, slots, id maps, dense state and losses as a
run that was never interrupted: bit for bit on one process and on two (jax.distributed), to float32 tolerance when
it resumes on another device count. Also: a step's `data` item on its own."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile

import jax
import numpy as np
import pytest

import sparse_embed as se
from conftest import make_mesh
from sparse_embed.examples.criteo_data import write_criteo

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "host", "multiprocess")
sys.path.insert(0, HERE)

import launch  # noqa: E402
import resume_run  # noqa: E402

STEPS, KILLS = 14, 10


def run(args: list[str], *, devices: int, cache: str, processes: int = 1, kill_at: int | None = None,
        timeout: float = 240) -> bool:
    """Runs resume_run.py (`processes` processes of `devices` devices each) to its end (True), or until process 0
    prints `step k` with k >= kill_at, then SIGKILLs every process (False)."""
    port, logs = launch.free_port(), tempfile.TemporaryDirectory(prefix="resume_")
    # recompiling the same step after each kill would be most of the test's time: one cache for the module's runs
    cache_env = dict(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    distributed = [dict(SE_COORDINATOR=f"127.0.0.1:{port}", SE_NUM_PROCESSES=str(processes), SE_PROCESS_ID=str(i))
                   if processes > 1 else {} for i in range(processes)]
    procs = [launch.start(os.path.join(HERE, "resume_run.py"), args,
                          launch.worker_env(devices, **cache_env, **distributed[i]),
                          os.path.join(logs.name, f"process{i}.log")) for i in range(processes)]
    try:
        return launch.run_until(procs, None if kill_at is None else
                                lambda line: line.startswith("step ") and int(line.split()[1]) >= kill_at, timeout)
    finally:
        logs.cleanup()


def losses(path: str) -> dict[int, list[str]]:
    """Every loss each step logged (a step re-run after a kill logs again)."""
    out: dict[int, list[str]] = {}
    with open(path) as f:
        for line in f:
            step, value = line.split()
            out.setdefault(int(step), []).append(value)
    return out


def final_state(ckpt: str) -> dict[str, np.ndarray]:
    """The last step's tables (natural order, with slots), id maps' contents and dense state, as flat arrays."""
    plan = resume_run.make_plan(make_mesh(4))
    with se.CheckpointManager(ckpt) as m:
        r = m.restore(plan, user=resume_run.init_dense(plan.mesh))
    assert r.step == STEPS
    out = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(r.user)}
    for name, t in se.raw_ids.id_table_contents(plan, r.tables, r.id_maps).items():
        out.update({f"{name}/{k}": np.asarray(v) for k, v in t._asdict().items() if k != "slots"})
        out.update({f"{name}/slot/{k}": np.asarray(v) for k, v in t.slots.items()})
    static = dataclasses.replace(plan, stacks=tuple(s for s in plan.stacks if s.dynamic is None))
    for name, arrays in se.unstack_state(static, {s.name: r.tables[s.name] for s in static.stacks}).items():
        out.update({f"{name}/{k}": v for k, v in arrays.items()})
    return out


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """A Criteo-format file, and a compilation cache that every run of the module shares (each run recompiles
    the same step: from the cache, it takes a fraction of the time)."""
    d = tmp_path_factory.mktemp("criteo")
    return write_criteo(str(d / "day_0.txt"), 800, vocabulary=300), str(d / "jax_cache")


def train(tmp, data, *, devices: int, processes: int = 1, kills=(), resume_devices=None):
    """One run to STEPS, killed at each step of `kills` (and resumed, on `resume_devices` if given)."""
    (path, cache), ckpt, log = data, os.path.join(tmp, "ckpt"), os.path.join(tmp, "losses.txt")
    args = [path, ckpt, log, str(STEPS)]
    for i, k in enumerate(kills):
        assert not run(args, devices=devices if i == 0 or resume_devices is None else resume_devices, cache=cache,
                       processes=processes, kill_at=k), "the run ended before it was killed"
    run(args, devices=devices if not kills or resume_devices is None else resume_devices, cache=cache,
        processes=processes)
    return losses(log), final_state(ckpt)


def assert_same(got, want, exact: bool) -> None:
    (got_losses, got_state), (want_losses, want_state) = got, want
    assert sorted(got_losses) == list(range(STEPS))
    for step, values in got_losses.items():
        if exact:
            assert set(values) == set(want_losses[step]), f"step {step}: losses {values} vs {want_losses[step]}"
        else:
            np.testing.assert_allclose([float.fromhex(v) for v in values], float.fromhex(want_losses[step][0]),
                                       rtol=1e-5, err_msg=f"step {step}")
    assert sorted(got_state) == sorted(want_state)
    for k in want_state:
        if exact:
            np.testing.assert_array_equal(got_state[k], want_state[k], err_msg=k)
        else:
            np.testing.assert_allclose(got_state[k], want_state[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.fixture(scope="module")
def reference(data_file, tmp_path_factory):
    return train(str(tmp_path_factory.mktemp("reference")), data_file, devices=4)


def test_killed_ten_times_resumes_bitwise(data_file, reference, tmp_path):
    kills = sorted(np.random.default_rng().choice(np.arange(1, STEPS - 1), KILLS, replace=False).tolist())
    got = train(str(tmp_path), data_file, devices=4, kills=kills)
    assert_same(got, reference, exact=True)
    assert sum(len(v) for v in got[0].values()) >= STEPS  # steps after a kill's checkpoint ran twice


def test_killed_on_another_device_count_resumes_to_float32_tolerance(data_file, reference, tmp_path):
    got = train(str(tmp_path), data_file, devices=4, kills=[5], resume_devices=2)
    assert_same(got, reference, exact=False)


def test_two_processes_killed_ten_times_resume_bitwise(data_file, tmp_path):
    """2 processes x 2 devices against their own uninterrupted run (the 4-device reference sums in another order)."""
    want = train(str(tmp_path / "reference"), data_file, devices=2, processes=2)
    kills = sorted(np.random.default_rng().choice(np.arange(1, STEPS - 1), KILLS, replace=False).tolist())
    got = train(str(tmp_path / "killed"), data_file, devices=2, processes=2, kills=kills)
    assert_same(got, want, exact=True)


def test_data_item_round_trip(tmp_path):
    plan = resume_run.make_plan(make_mesh(8))
    key = jax.random.key(0)
    tables, maps = se.init_tables(plan, key), se.init_id_maps(plan, key)
    state = {"input": {"next_index": 7, "name": "x"}, "plan": {"marks": {"s": 16}}}
    with se.CheckpointManager(tmp_path) as m:
        m.save(1, plan, tables, id_maps=maps, data=state)
        m.save(2, plan, tables, id_maps=maps)
        m.wait()
        assert m.restore(plan, step=1).data == state
        assert m.restore(plan, step=2).data is None


def test_data_that_is_not_json_is_refused_before_anything_is_written(tmp_path):
    """A numpy float in the user's data (a loss kept as `np.float32`) failed in orbax's background thread with
    json's bare "Object of type float32 is not JSON serializable", and left a half-made step directory."""
    plan = resume_run.make_plan(make_mesh(8))
    key = jax.random.key(0)
    tables, maps = se.init_tables(plan, key), se.init_id_maps(plan, key)
    with se.CheckpointManager(tmp_path) as m:
        with pytest.raises(TypeError, match=r"CheckpointManager.save: data must be JSON-serialisable .*Object of "
                                            r"type float32 is not JSON serializable"):
            m.save(1, plan, tables, id_maps=maps, data={"losses": [np.float32(0.5)]})
        m.wait()
        assert os.listdir(tmp_path) == [] and m.latest_step() is None
        assert m.save(1, plan, tables, id_maps=maps, data={"losses": [0.5]})
        m.wait()
        assert m.restore(plan).data == {"losses": [0.5]}


def test_data_item_saved_by_other_process_counts(tmp_path):
    """Restored with another number of processes: the state if every process saved the same one, else an error."""
    from sparse_embed.io.data_item import read_data

    d = tmp_path / "data"
    d.mkdir()
    for i in range(2):
        (d / f"process_{i}-of-2.json").write_text('{"next_index": 4}')
    assert read_data(str(tmp_path)) == {"next_index": 4}
    (d / "process_1-of-2.json").write_text('{"next_index": 5}')
    with pytest.raises(se.CheckpointError, match="saved by 2 processes, each at its own position"):
        read_data(str(tmp_path))
    assert read_data(str(tmp_path / "nothing")) is None


def test_a_step_whose_processes_saved_their_own_positions_restores_elsewhere_without_them(tmp_path):
    """Two processes' own input positions cannot be split over one process: the restore says so and names
    `data=False`, which restores the tables and id maps (the only way to bring raw-id maps onto another count)."""
    from sparse_embed.io import data_item

    plan = resume_run.make_plan(make_mesh(8))
    key = jax.random.key(0)
    tables, maps = se.init_tables(plan, key), se.init_id_maps(plan, key)
    with se.CheckpointManager(tmp_path) as m:
        m.save(1, plan, tables, id_maps=maps, data={"next_index": 4})
        m.wait()
    d = tmp_path / "1" / data_item.DATA
    (d / data_item._name(0, 1)).unlink()  # as two processes write it: a file each, each at its own position
    for i in range(2):
        state = {"next_index": 4 + i}
        (d / data_item._name(i, 2)).write_text(
            json.dumps({data_item._ENVELOPE: 1, "state": state, "crc32": data_item._crc(state)}))
    with se.CheckpointManager(tmp_path) as m:
        with pytest.raises(se.CheckpointError, match=r"each at its own position; .*restore\(\.\.\., data=False\)"):
            m.restore(plan)
        r = m.restore(plan, data=False)
    assert r.step == 1 and r.data is None
    assert sorted(r.tables) == sorted(tables) and sorted(r.id_maps) == sorted(maps)
    for name in set(tables) - set(maps):  # the static tables (a raw-id one's rows are its map's)
        np.testing.assert_array_equal(np.asarray(r.tables[name].table), np.asarray(tables[name].table))
