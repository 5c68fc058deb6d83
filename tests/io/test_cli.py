"""The sparse-embed console script: inspect, convert, and one-line errors."""

from __future__ import annotations

import logging
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


def test_a_failed_convert_prints_its_error_below_the_progress_bar(ckpt, tmp_path, capsys):
    """The bar is closed before the error is printed (it was printed after the half-drawn bar, on its line)."""
    served = tmp_path / "s"
    assert cli.main(["convert", str(ckpt[0]), str(served), "--serving", "--dtype", "int8"]) == 0
    capsys.readouterr()
    assert cli.main(["convert", str(served), str(tmp_path / "o"), "--serving", "--dtype", "int4"]) == 1
    lines = capsys.readouterr().err.split("\n")  # a terminal's lines: a bar redraws itself after each "\r"
    assert lines[-1] == "" and lines[-2].startswith("sparse-embed: error: Table 'items' is stored quantized (int8)")
    assert sum("error:" in line for line in lines) == 1



def test_a_convert_of_a_step_whose_user_pytree_is_missing_writes_nothing(ckpt, tmp_path, capsys):
    """The user pytree was checked after the tables were written: the convert failed (exit 1) and left `dst/4`,
    a step with its metadata and no user pytree, which a second convert called "already exists"."""
    src = tmp_path / "src"
    shutil.copytree(ckpt[0], src)
    shutil.rmtree(src / "4" / "user")
    for _ in range(2):
        assert cli.main(["convert", str(src), str(tmp_path / "out"), "--devices", "2"]) == 1
        assert "its 'user' item (the user pytree saved with it) is missing" in capsys.readouterr().err
        assert not (tmp_path / "out" / "4").exists()

def test_console_script_runs(ckpt):
    exe = os.path.join(os.path.dirname(sys.executable), "sparse-embed")
    if not os.path.exists(exe):
        pytest.skip("console script not installed (pip install -e .)")
    p = subprocess.run([exe, "inspect", str(ckpt[0]) + "_missing"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "does not exist" in p.stderr


def test_verify_and_convert_of_a_step_with_a_user_pytree_log_no_warning(ckpt, tmp_path, caplog):
    """Reading the user pytree logged "WARNING:absl:Metadata file does not exist: .../4/user/_CHECKPOINT_METADATA"
    under every `verify` and `convert` of a sound checkpoint, as if it were damaged."""
    with caplog.at_level(logging.WARNING):
        assert cli.main(["verify", str(ckpt[0])]) == 0
        assert cli.main(["convert", str(ckpt[0]), str(tmp_path / "out"), "--devices", "2"]) == 0
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_output_into_a_closed_pipe_is_no_error(ckpt):
    """`sparse-embed inspect CKPT | head`: the reader leaving printed "sparse-embed: error: [Errno 32] Broken pipe"."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.Popen([sys.executable, "-m", "sparse_embed.cli", "inspect", str(ckpt[0])], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    p.stdout.close()  # before the command writes a line
    _, err = p.communicate(timeout=120)
    assert p.returncode == 1 and err.decode() == ""


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


_MODEL = (
    "import sparse_embed as se\n"
    "def features():\n"
    "    small, big = se.TableSpec('small', 20, 8), se.TableSpec('big', 1000, 8)\n"
    "    return [se.FeatureSpec('s', small, 64), se.FeatureSpec('b', big, 64)]\n"
    "number = 3\n"
    "numbers = {'a': 1, 'b': 2}\n"
    "text = 'features'\n"
    "nothing = []\n"
    "def fails():\n"
    "    raise RuntimeError('no features today')\n")


def test_plan_console_script_simulates_the_devices_without_xla_flags(tmp_path):
    """The documented `sparse-embed plan my_model:features --devices 8`, in a shell without XLA_FLAGS: importing
    sparse_embed imports jax but starts no backend, so the command's flag still takes effect."""
    exe = os.path.join(os.path.dirname(sys.executable), "sparse-embed")
    if not os.path.exists(exe):
        pytest.skip("console script not installed (pip install -e .)")
    (tmp_path / "my_model.py").write_text(_MODEL)
    (tmp_path / "elsewhere").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(tmp_path)
    p = subprocess.run([exe, "plan", "my_model:features", "--devices", "8"], capture_output=True, text=True,
                       timeout=300, env=env, cwd=tmp_path / "elsewhere")
    assert p.returncode == 0, p.stderr
    assert "EmbeddingPlan on 8 device(s)" in p.stdout
    assert {x.split()[0] for x in p.stdout.splitlines()[2:]} == {"small", "big"}


def _write_model(tmp_path, monkeypatch) -> None:
    """`my_model` (`_MODEL`) in the working directory, not the one an earlier test imported."""
    (tmp_path / "my_model.py").write_text(_MODEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_model", raising=False)


def _run(argv: list[str]) -> int:
    """`cli.main`'s exit status, whether it returns it or argparse exits."""
    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sparse-embed: error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("name, match", [
    ("number", "got int 3"),
    ("numbers", "got a dict holding int 1"),
    ("text", "got str 'features'"),
    ("nothing", "got an empty list"),
    ("missing", "AttributeError: module 'my_model' has no attribute 'missing'"),
    ("fails", "RuntimeError: no features today"),
])
def test_plan_of_something_else_than_feature_specs_is_one_line(tmp_path, monkeypatch, capsys, name, match):
    _write_model(tmp_path, monkeypatch)
    assert _run(["plan", f"my_model:{name}", "--devices", "2"]) == 1
    err = _one_line_error(capsys)
    assert f"'my_model:{name}'" in err and match in err


@pytest.mark.parametrize("module, match", [
    ("no_such_module", "ModuleNotFoundError: No module named 'no_such_module'"),
    ("raises_on_import", "ValueError: configure me first"),
    ("bad_syntax", "SyntaxError"),
])
def test_plan_of_a_module_that_fails_to_import_is_one_line(tmp_path, monkeypatch, capsys, module, match):
    (tmp_path / "raises_on_import.py").write_text("raise ValueError('configure me first')\n")
    (tmp_path / "bad_syntax.py").write_text("def features(:\n")
    monkeypatch.chdir(tmp_path)
    assert _run(["plan", f"{module}:features"]) == 1
    err = _one_line_error(capsys)
    assert f"cannot load the features '{module}:features'" in err and match in err


@pytest.mark.parametrize("argv, argument", [
    (["plan", "m:f", "--devices", "0"], "--devices"),
    (["plan", "m:f", "--devices", "-2"], "--devices"),
    (["plan", "m:f", "--devices", "2.5"], "--devices"),
    (["plan", "m:f", "--devices", "eight"], "--devices"),
    (["plan", "m:f", "--devices", "100000"], "--devices: at most 4096 simulated devices"),
    (["plan", "m:f", "--memory-budget", "abc"], "--memory-budget"),
    (["plan", "m:f", "--memory-budget=-1GiB"], "--memory-budget"),
    (["plan", "m:f", "--memory-budget", "-1GiB"], "--memory-budget"),
    (["plan", "m:f", "--memory-budget", "0"], "--memory-budget"),
    (["plan", "m:f", "--memory-budget", "0.1B"], "--memory-budget"),
    (["plan", "m:f", "--memory-budget", "1e400"], "--memory-budget"),
    (["plan", "m:f", "--memory-budget", "2XB"], "--memory-budget"),
    (["plan", "m:f", "--placement", "rows"], "--placement"),
    (["plan", "m:f", "--ids-per-sample", "0"], "--ids-per-sample"),
    (["plan", "m:f", "--ids-per-sample", "-3"], "--ids-per-sample"),
    (["plan", "m:f", "--ids-per-sample", "nan"], "--ids-per-sample"),
    (["inspect", "ck", "--step", "-1"], "--step"),
    (["inspect", "ck", "--step", "x"], "--step"),
    (["verify", "ck", "--step", "-1"], "--step"),
    (["verify", "ck", "--step", "1.5"], "--step"),
    (["convert", "ck", "out", "--step", "-4"], "--step"),
    (["convert", "ck", "out", "--devices", "0"], "--devices"),
    (["convert", "ck", "out", "--devices", "-2"], "--devices"),
    (["convert", "ck", "out", "--serving", "--dtype", "int2"], "--dtype"),
    (["convert", "ck", "out", "--dtype", "bf16"], "--dtype"),  # only for --serving
    (["convert", "ck", "out", "--serving", "--devices", "4"], "--devices: applies to training checkpoints only"),
])
def test_bad_arguments_exit_2_with_one_line_naming_them(tmp_path, capsys, argv, argument):
    argv = [str(tmp_path / a) if a in ("ck", "out") else a for a in argv]
    assert _run(argv) == 2
    err = _one_line_error(capsys)
    assert f"argument {argument}" in err
    assert not (tmp_path / "out").exists()


def test_good_arguments_still_parse():
    args = cli.parser().parse_args(["plan", "m:f", "--devices", "1", "--memory-budget", "1.5 KiB",
                                    "--ids-per-sample", "2.5", "--placement", "row"])
    assert (args.devices, args.memory_budget, args.ids_per_sample, args.placement) == (1, 1536, 2.5, "row")
    assert cli.parser().parse_args(["plan", "m:f", "--memory-budget", "1e9"]).memory_budget == 10**9
    assert cli.parser().parse_args(["plan", "m:f", "--memory-budget", "2GiB"]).memory_budget == 2 * 2**30
    assert cli.parser().parse_args(["plan", "m:f", "--memory-budget", "2GB"]).memory_budget == 2 * 10**9
    assert cli.parser().parse_args(["plan", "m:f", "--devices", "4096"]).devices == 4096
    assert cli.parser().parse_args(["verify", "ck", "--step", "0"]).step == 0
    assert cli.parser().parse_args(["convert", "a", "b", "--devices", "3"]).devices == 3


def test_plan_leaves_xla_flags_as_they_were(tmp_path, monkeypatch, capsys):
    _write_model(tmp_path, monkeypatch)
    before = os.environ.get("XLA_FLAGS")
    assert cli.main(["plan", "my_model:features", "--devices", "2"]) == 0
    assert "EmbeddingPlan on 2 device(s)" in capsys.readouterr().out
    assert os.environ.get("XLA_FLAGS") == before


@pytest.mark.parametrize("devices", [0, -2])
def test_convert_checkpoint_rejects_a_device_count_below_one(tmp_path, devices):
    t = se.TableSpec("items", 40, 4)
    plan = se.plan({"i": se.FeatureSpec("i", t, 8)}, make_mesh(1))
    with se.CheckpointManager(tmp_path / "ck", async_save=False) as m:
        m.save(1, plan, se.init_tables(plan, jax.random.key(0)))
    with pytest.raises(ValueError, match=f"devices must be >= 1, got {devices}"):
        se.convert_checkpoint(tmp_path / "ck", tmp_path / "out", devices=devices)
    assert not (tmp_path / "out").exists()


def test_convert_checkpoint_refuses_devices_for_a_serving_export(ckpt, tmp_path):
    """A serving export records no mesh size: `devices=` was ignored (saved on 8 devices, not the 2 asked for)."""
    with pytest.raises(ValueError, match="devices= applies to training checkpoints only"):
        se.convert_checkpoint(ckpt[0], tmp_path / "out", serving=True, devices=2)
    assert not (tmp_path / "out").exists()


def test_step_choice_is_the_latest_complete_one_and_a_step_directory_is_its_own_step(ckpt, tmp_path, capsys):
    """Without --step: the latest step with its 'meta' item (a later one cut short is passed over, as restore
    does); --step on a step directory must name that step; --step naming an incomplete step says so."""
    path = tmp_path / "ck"
    shutil.copytree(ckpt[0], path)
    shutil.copytree(path / "4", path / "9")
    shutil.rmtree(path / "9" / "meta")  # step 9: cut short before its meta item
    with pytest.warns(UserWarning, match="step 9 is incomplete .*; using step 4, the latest complete one"):
        assert se.read_info(path).step == 4
    with pytest.warns(UserWarning, match="step 9 is incomplete"):
        assert cli.main(["inspect", str(path)]) == 0 and "step 4," in capsys.readouterr().out
    assert cli.main(["verify", str(path)]) == 1  # verify looks at the latest step as it is: damaged
    assert "CORRUPT:" in capsys.readouterr().out
    with pytest.raises(se.CorruptCheckpointError, match="Step 9 in .* is incomplete or damaged"):
        se.read_info(path, step=9)
    assert se.read_info(path / "4", step=4).step == 4
    with pytest.raises(se.CheckpointError, match="is the directory of step 4, not of step 9"):
        se.read_info(path / "4", step=9)
    for cmd in (["inspect"], ["verify"]):
        assert cli.main([*cmd, str(path / "4"), "--step", "9"]) == 1
        assert "is the directory of step 4, not of step 9" in capsys.readouterr().err


def test_a_step_directory_under_another_name_refuses_another_step(ckpt, tmp_path, capsys):
    """A serving export (or a step directory copied as "best") is one step: `--step` of another was ignored, and
    step 4 was shown, verified and converted as if it were the step asked for."""
    served, best = tmp_path / "served", tmp_path / "best"
    assert cli.main(["convert", str(ckpt[0]), str(served), "--serving"]) == 0
    shutil.copytree(ckpt[0] / "4", best)
    for path in (served, best):
        for command in (["inspect", str(path)], ["verify", str(path)],
                        ["convert", str(path), str(tmp_path / "o"), "--serving"]):
            capsys.readouterr()
            assert cli.main([*command, "--step", "7"]) == 1
            assert capsys.readouterr().err.splitlines()[-1] == \
                f"sparse-embed: error: {path} is one checkpoint step, step 4, not step 7: it holds no other."
            assert cli.main([*command, "--step", "4"]) == 0
            shutil.rmtree(tmp_path / "o", ignore_errors=True)


def test_convert_refuses_a_destination_inside_the_source_or_unwritable_before_reading(ckpt, tmp_path, capsys):
    path = tmp_path / "ck"
    shutil.copytree(ckpt[0], path)
    for dst, match in ((path / "sub", "is inside the checkpoint"), (path / "4" / "x", "is inside the checkpoint"),
                       ("/proc/nope/x", "Cannot write /proc/nope/x: No such file or directory (/proc/nope)")):
        assert cli.main(["convert", str(path), str(dst), "--serving"]) == 1
        err = capsys.readouterr().err
        assert match in err and "Traceback" not in err and "%" not in err  # (no progress bar drawn first)
    assert sorted(os.listdir(path)) == ["4"]
    shutil.rmtree(path / "4" / "user")
    assert cli.main(["verify", str(path)]) == 1
    assert "its 'user' item (the user pytree saved with it) is missing" in capsys.readouterr().out
