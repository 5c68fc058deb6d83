"""The demo trains end to end on the simulated 8-device mesh and learns."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import sparse_embed as se
from sparse_embed import cli
from sparse_embed.core.kernels import native_cpu
from sparse_embed.examples import dlrm as demo

TINY = ["--batch-size", "128", "--eval-batches", "4", "--log-every", "10",
        "--users", "2000", "--user-rows", "1000", "--items", "1000", "--tags", "200", "--no-progress"]


def test_demo_learns_on_8_devices(capsys):
    assert len(jax.devices()) == 8  # conftest simulates 8 CPU devices
    out = demo.main(["--steps", "150", *TINY])
    losses = np.asarray(out["losses"])
    assert losses.shape == (150,) and np.isfinite(losses).all()
    assert losses[-20:].mean() < losses[:20].mean() - 0.02
    assert 0.5 < out["eval_auc"] <= 1.0
    assert out["teacher_auc"] > 0.7  # the data carries signal
    shown = capsys.readouterr().out
    assert "eval" in shown
    if native_cpu.available():  # the demo says what it runs on
        assert "lookup kernel: native; preprocessing: C extension\n" in shown


def test_demo_says_when_it_does_not_run_native(monkeypatch):
    """As when run from a source tree without the compiled extensions (`pip install .` then the demo from the
    tree): the line names the generic kernel, numpy, and why."""
    plan = demo.build(demo.parse_args(["--steps", "1", *TINY]))[1]
    monkeypatch.setattr(native_cpu, "available", lambda: False)
    monkeypatch.setenv("SPARSE_EMBED_NATIVE", "0")
    line = demo.describe_kernels(plan)
    assert line.startswith("lookup kernel: generic; preprocessing: numpy (not native: its C++ extension is not built")


def test_auc_matches_pairwise_definition():
    rng = np.random.default_rng(0)
    labels = rng.random(200) < 0.3
    scores = rng.integers(0, 10, 200).astype(float)  # many ties
    pos, neg = scores[labels][:, None], scores[~labels][None, :]
    want = ((pos > neg).sum() + 0.5 * (pos == neg).sum()) / (pos.size * neg.size)
    assert np.isclose(demo.auc(labels, scores), want)
    assert np.isnan(demo.auc(np.ones(3), np.arange(3.0)))  # one class only: undefined


def test_demo_checkpoint_works_with_the_cli(tmp_path, capsys):
    """README: `--checkpoint-dir`, then `sparse-embed inspect` and `sparse-embed convert` on it."""
    ckpt, serving = tmp_path / "dlrm", tmp_path / "serving"
    demo.main(["--steps", "3", "--checkpoint-dir", str(ckpt), *TINY])
    assert cli.main(["inspect", str(ckpt)]) == 0
    shown = capsys.readouterr().out
    assert all(name in shown for name in ("user", "item", "tag", "accumulator", "raw ids: "))
    assert cli.main(["convert", str(ckpt), str(serving), "--serving", "--dtype", "bf16"]) == 0
    arrays, specs = se.load_serving(serving)
    user_ids, users = arrays.pop("user")  # keyed by raw ids: (the ids, the table in id order)
    assert users.shape == (1000, 16) and 0 < user_ids.size <= 1000 and str(users.dtype) == "bfloat16"
    assert {k: v.shape for k, v in arrays.items()} == {"item": (1000, 16), "tag": (200, 16)}
    assert all(str(v.dtype) == "bfloat16" for v in arrays.values())
    # a second run into the same directory stops before training instead of saying it saved what it left alone
    with pytest.raises(SystemExit, match="already holds a checkpoint of step 3"):
        demo.main(["--steps", "3", "--checkpoint-dir", str(ckpt), *TINY])


@pytest.mark.parametrize("flags, message", [
    (["--users", "0"], "argument --users: must be an integer > 0, got '0'"),
    (["--batch-size", "-64"], "argument --batch-size: must be an integer > 0, got '-64'"),
    (["--workers", "-1"], "argument --workers: must be an integer >= 0, got '-1'"),
    (["--table-rows", "0"], "argument --table-rows: must be an integer > 0, got '0'"),
    (["--embedding-lr", "nan"], "argument --embedding-lr: must be a finite number > 0, got 'nan'"),
    (["--steps", "x"], "argument --steps: must be an integer > 0, got 'x'"),
    (["--checkpoint-every", "4"], "--checkpoint-every saves a --data run into --checkpoint-dir: give both"),
])
def test_bad_flags_are_refused_naming_them(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        demo.parse_args(flags)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
