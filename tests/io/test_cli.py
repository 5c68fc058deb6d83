"""The sparse-embed console script: inspect, convert, and one-line errors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import sparse_embed as se
from sparse_embed import cli
from sparse_embed import optimizers as opt
from conftest import make_mesh


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    a = se.TableSpec("items", 300, 8, optimizer=opt.Adagrad(0.1), combiner="sum")
    u = se.TableSpec("users", 50, 8, optimizer=opt.Adagrad(0.1))
    feats = {"i": se.FeatureSpec("i", a, 8), "u": se.FeatureSpec("u", u, 8)}
    plan = se.plan(feats, make_mesh(8))
    state = se.init_tables(plan, jax.random.key(0))
    path = tmp_path_factory.mktemp("cli") / "ck"
    with se.CheckpointManager(path) as m:
        m.save(4, plan, state, user={"w": np.ones(3, np.float32)})
    return path, feats, se.unstack_state(plan, state)


def test_inspect(ckpt, capsys):
    assert cli.main(["inspect", str(ckpt[0])]) == 0
    out = capsys.readouterr().out
    assert "step 4, saved on 8 device(s)" in out and "stacking: [items]; [users]" in out
    assert "items" in out and "[300, 8]" in out and "accumulator[8]" in out
    assert "18.8 KiB" in out  # items: 300 * (8 + 8) * 4 bytes


@pytest.mark.parametrize("devices", [2, 4])
def test_convert_devices_restores_exactly(ckpt, tmp_path, devices):
    path, feats, want = ckpt
    assert cli.main(["convert", str(path), str(tmp_path / "out"), "--devices", str(devices)]) == 0
    info = se.read_info(tmp_path / "out")
    assert info.num_shards == devices and info.has_user
    plan = se.plan(feats, make_mesh(devices), stacking=None)
    with se.CheckpointManager(tmp_path / "out") as m:
        r = m.restore(plan, user={"w": np.zeros(3, np.float32)})
    np.testing.assert_array_equal(r.user["w"], np.ones(3))
    got = se.unstack_state(plan, r.tables)
    for t in want:
        for k in want[t]:
            np.testing.assert_array_equal(got[t][k], want[t][k])


def test_convert_serving_bf16(ckpt, tmp_path):
    path, _, want = ckpt
    assert cli.main(["convert", str(path), str(tmp_path / "s"), "--serving", "--dtype", "bf16"]) == 0
    tables, specs = se.load_serving(tmp_path / "s")
    assert specs["items"].combiner == "sum" and se.read_info(tmp_path / "s").kind == "serving"
    for t, a in tables.items():
        assert a.shape == want[t]["table"].shape and a.dtype == jax.numpy.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), want[t]["table"].astype(jax.numpy.bfloat16).astype(np.float32))


def _broken(ckpt, tmp_path, how):
    if how == "missing":
        return tmp_path / "nope", "does not exist"
    if how == "empty":
        (tmp_path / "e").mkdir()
        return tmp_path / "e", "No complete checkpoint"
    dst = tmp_path / "c"
    shutil.copytree(ckpt[0], dst)
    if how == "corrupt_meta":
        (dst / "4" / "meta" / "metadata").write_text("{")
        return dst, "cannot read its metadata"
    if how == "not_ours":
        (dst / "4" / "meta" / "metadata").write_text('{"format": "other"}')
        return dst, "not a sparse_embed checkpoint"
    shutil.rmtree(dst / "4" / "embeddings" / "items" / "table")  # one array's data
    return dst, "corrupt or incomplete"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax, see test_checkpoint
@pytest.mark.parametrize("how", ["missing", "empty", "corrupt_meta", "not_ours", "corrupt_arrays"])
def test_bad_checkpoints_exit_nonzero_with_one_line(ckpt, tmp_path, capsys, how):
    src, match = _broken(ckpt, tmp_path, how)
    command = ["inspect", str(src)] if how != "corrupt_arrays" else ["convert", str(src), str(tmp_path / "o"), "--serving"]
    assert cli.main(command) == 1
    err = capsys.readouterr().err.strip().splitlines()  # tqdm may draw a bar above the error line
    assert err[-1].startswith("sparse-embed: error:") and match in err[-1]
    assert not any("Traceback" in line for line in err)


def test_console_script_runs(ckpt):
    exe = os.path.join(os.path.dirname(sys.executable), "sparse-embed")
    if not os.path.exists(exe):
        pytest.skip("console script not installed (pip install -e .)")
    p = subprocess.run([exe, "inspect", str(ckpt[0]) + "_missing"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "does not exist" in p.stderr


def test_plan_prints_each_tables_placement(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_model.py").write_text(
        "import sparse_embed as se\n"
        "def features():\n"
        "    small = se.TableSpec('small', 20, 8)\n"
        "    big = [se.TableSpec(f'big{i}', 100000, 8) for i in range(2)]\n"
        "    return [se.FeatureSpec('s', small, 4096)] + [se.FeatureSpec(f'b{i}', t, 4096) for i, t in enumerate(big)]\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan", "my_model:features", "--devices", "8"]) == 0
    out = capsys.readouterr().out
    assert "EmbeddingPlan on 8 device(s)" in out
    assert next(x for x in out.splitlines() if x.startswith("small ")).split()[2] == "replicated"
    assert "column" in next(x for x in out.splitlines() if x.startswith("big0 "))  # wide enough to split
    assert cli.main(["plan", "my_model:features", "--placement", "row", "--memory-budget", "1MiB"]) == 0
    assert "row" in next(x for x in capsys.readouterr().out.splitlines() if x.startswith("big1 "))
    assert cli.main(["plan", "my_model:features", "--memory-budget", "1KiB"]) == 1
    assert "No placement fits memory_budget=1024 bytes" in capsys.readouterr().err
    assert cli.main(["plan", "my_model:nothing"]) == 1
    assert "cannot load the features 'my_model:nothing'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["plan", "my_model:features", "--memory-budget", "lots"])
