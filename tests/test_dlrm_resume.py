"""The demo on a generated Criteo-format file (`--data`, raw-id tables) killed with SIGKILL at random checkpoints
and started again ends with the same tables, id maps, dense state and per-step losses as a run never killed."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile

import jax
import numpy as np
import pytest

import sparse_embed as se
from conftest import make_mesh
from sparse_embed.examples import criteo_dlrm
from sparse_embed.examples.criteo_data import write_criteo

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "host", "multiprocess"))

import launch  # noqa: E402

STEPS, KILLS = 14, 10
FLAGS = ["--steps", str(STEPS), "--batch-size", "64", "--eval-batches", "2", "--table-rows", "64",
         "--embedding-dim", "4", "--checkpoint-every", "1", "--no-progress"]


def demo(data: str, ckpt: str, kill_at: int | None = None) -> bool:
    """Runs the demo (4 CPU devices); True if it ended, False if killed once it saved step `kill_at` or later."""
    # every run compiles the same step: from a shared cache after the first; fully optimized, as a user's run
    # compiles (the suite's other tests mostly do not, tests/conftest.py)
    env = launch.worker_env(4, JAX_COMPILATION_CACHE_DIR=os.path.join(os.path.dirname(ckpt), "jax_cache"),
                            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_DISABLE_MOST_OPTIMIZATIONS="0")
    with tempfile.TemporaryDirectory(prefix="demo_") as logs:
        p = launch.start("-m sparse_embed.examples.dlrm", ["--data", data, "--checkpoint-dir", ckpt, *FLAGS], env,
                         os.path.join(logs, "demo.log"))
        stop = None if kill_at is None else (
            lambda line: line.startswith("checkpoint of step ") and int(line.split()[3]) >= kill_at)
        return launch.run_until([p], stop, timeout=300)


def final(ckpt: str) -> dict[str, np.ndarray]:
    """The last step's tables' and id maps' contents, dense state and every step's loss, as flat arrays."""
    args = argparse.Namespace(embedding_lr=0.05, embedding_init_acc=1e-6, embedding_init_std=0.02, hashed=False,
                              table_rows=64, embedding_dim=4, batch_size=64)
    plan = criteo_dlrm.make_plan(args, make_mesh(4))  # the devices the runs had: the same shards, nothing dropped
    params = criteo_dlrm.init_params(jax.random.key(0), 4)
    import optax

    target = jax.device_put({"params": params, "opt": optax.adam(1e-3).init(params)},
                            jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec()))
    with se.CheckpointManager(ckpt) as m:
        r = m.restore(plan, user=target)
    assert r.step == STEPS
    out = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(r.user)}
    out["losses"] = np.array([float.fromhex(x) for x in r.data["losses"]], np.float32)
    for name, t in se.raw_ids.id_table_contents(plan, r.tables, r.id_maps).items():
        out.update({f"{name}/{k}": np.asarray(v) for k, v in t._asdict().items() if k != "slots"})
        out.update({f"{name}/slot/{k}": np.asarray(v) for k, v in t.slots.items()})
    return out


def test_demo_with_data_killed_and_resumed_is_bitwise_the_uninterrupted_run(tmp_path):
    data = write_criteo(str(tmp_path / "day_0.txt"), 64 * 24, vocabulary=200)
    assert demo(data, str(tmp_path / "whole"))
    kills = sorted(np.random.default_rng().choice(np.arange(1, STEPS - 1), KILLS, replace=False).tolist())
    for k in kills:
        assert not demo(data, str(tmp_path / "killed"), kill_at=k)
    assert demo(data, str(tmp_path / "killed"))
    want, got = final(str(tmp_path / "whole")), final(str(tmp_path / "killed"))
    assert sorted(got) == sorted(want)
    assert want["losses"].shape == (STEPS,) and np.all(want["losses"] > 0)  # every step's loss is there
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@contextlib.contextmanager
def compiled():
    """The programs compiled inside the block, by name (not those found in the compilation cache)."""
    names, hit = [], [False]

    def event(name, **kw):
        hit[0] = hit[0] or name == "/jax/compilation_cache/cache_hits"

    def duration(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            if not hit[0]:
                names.append(kw.get("fun_name"))
            hit[0] = False

    jax.monitoring.register_event_listener(event)
    jax.monitoring.register_event_duration_secs_listener(duration)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_listener(event)
        jax.monitoring.unregister_event_duration_listener(duration)


def test_demo_with_hashed_tables_goes_on_with_more_steps(tmp_path, capsys):
    """In this process, static hashed tables: 8 steps saved, then started again with --steps 16: it resumes at 8."""
    data = write_criteo(str(tmp_path / "day_0.txt"), 64 * 24, vocabulary=200)
    from sparse_embed.examples import dlrm

    flags = ["--data", data, "--batch-size", "64", "--eval-batches", "4", "--table-rows", "256", "--embedding-dim",
             "4", "--no-progress", "--hashed", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "4"]
    first = dlrm.main(["--steps", "8", *flags])
    with compiled() as programs:
        out = dlrm.main(["--steps", "16", *flags])
    assert "jit(train_step)" not in programs  # its program does not depend on --steps: from the cache
    losses = np.asarray(out["losses"])
    assert out["start"] == 8 and losses.shape == (16,) and np.isfinite(losses).all() and (losses > 0).all()
    np.testing.assert_array_equal(losses[:8], first["losses"])
    assert 0.5 < out["eval_auc"] <= 1.0
    shown = capsys.readouterr().out
    assert "hashed tables of 256 rows" in shown and "resumed from step 8" in shown
    with pytest.raises(SystemExit, match="is at step 16, past --steps 8: pass --steps 16 or more"):
        dlrm.main(["--steps", "8", *flags])
    with pytest.raises(SystemExit, match="was trained with --seed 0: resume with it"):
        dlrm.main(["--steps", "20", "--seed", "7", *flags])
    # a record is a batch: at 32 the loader's position would be other examples (and the eval's batches others)
    with pytest.raises(SystemExit, match="was trained with --batch-size 64: resume with it"):
        dlrm.main(["--steps", "20", *flags, "--batch-size", "32"])
    # grain's state under mp_prefetch is per worker: another count failed in the Loader, "KeyError: 'exhausted'"
    with pytest.raises(SystemExit, match="was trained with --workers 0: resume with it"):
        dlrm.main(["--steps", "20", *flags, "--workers", "2"])
    # the training batches' shuffle is over the batches not held out: other --eval-batches or files shuffle others
    # (and a batch trained on could be held out), so the resumed run silently trained on another order
    with pytest.raises(SystemExit, match=r"was trained on train batches 20, this run has 19: .* same --data and "
                                         r"--eval-batches"):
        dlrm.main(["--steps", "20", *flags, "--eval-batches", "5"])
    other = write_criteo(str(tmp_path / "day_1.txt"), 64 * 24, vocabulary=200)
    with pytest.raises(SystemExit, match=r"was trained on files \['day_0.txt'\], this run has \['day_1.txt'\]"):
        dlrm.main(["--steps", "20", *[other if f == data else f for f in flags]])


def test_demo_with_data_of_a_few_batches_holds_one_out(tmp_path, capsys):
    """A file of 2-3 batches: one held out for the eval (none left it empty and the eval failed after training).
    Hashed tables: the holding out is the same for raw-id ones (the test above), whose 26 maps compile longer."""
    from sparse_embed.examples import dlrm

    data = write_criteo(str(tmp_path / "day_0.txt"), 64 * 3, vocabulary=50)
    out = dlrm.main(["--data", data, "--steps", "2", "--batch-size", "64", "--table-rows", "64", "--embedding-dim",
                     "4", "--no-progress", "--hashed"])
    assert "1 batches held out" in capsys.readouterr().out and 0.0 <= out["eval_auc"] <= 1.0
    with pytest.raises(SystemExit, match="holds 1 batches of 64: too few"):
        dlrm.main(["--data", write_criteo(str(tmp_path / "one.txt"), 64, vocabulary=50), "--steps", "2",
                   "--batch-size", "64", "--no-progress"])
