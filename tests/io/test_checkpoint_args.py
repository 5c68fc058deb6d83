"""CheckpointManager's arguments: its options, the steps saved and restored, and the id maps saved with tables."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparse_embed as se
from sparse_embed import optimizers as opt
from conftest import make_mesh

B = 8


def _specs(users: int = 64, admit_after: int = 1) -> dict[str, se.FeatureSpec]:
    """A raw-id table `users` and a static table `items`, small."""
    u = se.TableSpec("users", users, 4, optimizer=opt.Adagrad(0.1), dynamic=se.Dynamic(admit_after=admit_after))
    i = se.TableSpec("items", 32, 4, optimizer=opt.Adagrad(0.1))
    return {"u": se.FeatureSpec("u", u, B), "i": se.FeatureSpec("i", i, B)}


@pytest.fixture(scope="module")
def raw8():
    """An 8-device plan with a raw-id table, its tables and its (empty) id maps."""
    plan = se.plan(_specs(), make_mesh(8))
    return plan, se.init_tables(plan, jax.random.key(0)), se.init_id_maps(plan, jax.random.key(1))


@pytest.fixture(scope="module")
def static8():
    """An 8-device plan of static tables only, and its tables."""
    plan = se.plan({"i": _specs()["i"]}, make_mesh(8))
    return plan, se.init_tables(plan, jax.random.key(0))


def _save_or_export(how: str, path, plan, tables, id_maps) -> None:
    if how == "save":
        with se.CheckpointManager(path, async_save=False) as m:
            m.save(1, plan, tables, id_maps=id_maps)
    else:
        se.export_serving(path, plan, tables, id_maps=id_maps)


@pytest.mark.parametrize("how", ["save", "export_serving"])
@pytest.mark.parametrize("other, match", [
    (lambda: se.plan(_specs(), make_mesh(4)), r"seed has shape \(4, 2\), expected \(8, 2\); rows.size has shape "
                                              r"\(4,\), expected \(8,\)"),
    (lambda: se.plan(_specs(users=128), make_mesh(8)), r"rows.order has shape \(128,\), expected \(64,\)"),
    (lambda: se.plan(_specs(admit_after=2), make_mesh(8)), r"waiting ids present \(the plan's table has "
                                                           r"admit_after=1\)"),
], ids=["4_devices", "another_vocab", "another_admit_after"])
def test_id_maps_of_another_plan_are_refused(raw8, tmp_path, how, other, match):
    plan, tables, _ = raw8
    maps = se.init_id_maps(other(), jax.random.key(1))
    with pytest.raises(ValueError, match=r"Table 'users': its id map is not one of this plan \(8 shards of 8 rows\)"
                                         r": " + match):
        _save_or_export(how, tmp_path / "out", plan, tables, maps)
    if how == "save":  # nothing written
        assert [p.name for p in (tmp_path / "out").iterdir()] == []


@pytest.mark.parametrize("how", ["save", "export_serving"])
@pytest.mark.parametrize("id_maps, error, match", [
    ({}, ValueError, r"Table 'users' is keyed by raw ids, but id_maps has no entry 'users' for it \(it has \[\]\)"),
    ({"items": None}, ValueError, r"no entry 'users' for it \(it has \['items'\]\)"),
    ([1], TypeError, r"id_maps must be a mapping \{stack name: IdMap\}.* got list"),
    ({"users": 1}, TypeError, r"Table 'users': id_maps\['users'\] must be an IdMap, got int"),
], ids=["empty", "other_key", "list", "not_an_id_map"])
def test_missing_or_wrong_id_maps_name_the_table(raw8, tmp_path, how, id_maps, error, match):
    plan, tables, _ = raw8
    with pytest.raises(error, match=match):
        _save_or_export(how, tmp_path / "out", plan, tables, id_maps)


def test_the_plans_own_id_maps_are_saved(raw8, tmp_path):
    plan, tables, maps = raw8
    _save_or_export("save", tmp_path / "ck", plan, tables, maps)
    assert se.read_info(tmp_path / "ck").step == 1


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_to_keep=0), ValueError, r"max_to_keep must be >= 1 .*None keeps every step.*got 0"),
    (dict(max_to_keep=-1), ValueError, r"max_to_keep must be >= 1 .*got -1"),
    (dict(max_to_keep=True), TypeError, r"max_to_keep must be an integer >= 1 .*got True \(bool\)"),
    (dict(max_to_keep=2.0), TypeError, r"max_to_keep must be an integer >= 1 .*got 2.0 \(float\)"),
    (dict(save_interval_steps=0), ValueError, r"save_interval_steps must be >= 1 .*got 0"),
    (dict(save_interval_steps=False), TypeError, r"save_interval_steps must be an integer >= 1 .*got False"),
    (dict(save_interval_steps=None), TypeError, r"save_interval_steps must be an integer >= 1 .*got None"),
    (dict(save_interval_steps="2"), TypeError, r"save_interval_steps must be an integer >= 1 .*got '2' \(str\)"),
], ids=["keep0", "keep-1", "keep_bool", "keep_float", "interval0", "interval_bool", "interval_none", "interval_str"])
def test_bad_manager_options_are_refused(tmp_path, kwargs, error, match):
    with pytest.raises(error, match="CheckpointManager: " + match):
        se.CheckpointManager(tmp_path / "ck", **kwargs)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("kwargs", [dict(max_to_keep=None), dict(max_to_keep=np.int64(1), save_interval_steps=2)])
def test_good_manager_options_are_taken(static8, tmp_path, kwargs):
    plan, tables = static8
    with se.CheckpointManager(tmp_path, async_save=False, **kwargs) as m:
        assert [m.save(s, plan, tables) for s in (2, 4)] == [True, True]
        assert m.all_steps() == ([2, 4] if kwargs["max_to_keep"] is None else [4])


def test_save_steps(static8, tmp_path):
    """Integers only; without force a step not after the latest is skipped (False), with force it is refused."""
    plan, tables = static8
    with se.CheckpointManager(tmp_path, async_save=False) as m:
        assert m.save(5, plan, tables)
        assert not m.save(5, plan, tables) and not m.save(3, plan, tables)  # documented: skipped, nothing written
        for bad in (8.7, 6.0, "6", True, np.float32(6), jnp.array([6])):
            with pytest.raises(TypeError, match=r"CheckpointManager.save: step must be an integer, got"):
                m.save(bad, plan, tables)
        with pytest.raises(ValueError, match=r"save\(force=True\): step 5 is already saved in .* \(latest: step 5\)"):
            m.save(5, plan, tables, force=True)
        with pytest.raises(ValueError, match=r"step 4 is before the latest saved step in .* \(latest: step 5\)"):
            m.save(4, plan, tables, force=True)
        assert m.save(np.int64(6), plan, tables) and m.save(jnp.int32(7), plan, tables, force=True)
        assert m.all_steps() == [5, 6, 7]
    with se.CheckpointManager(tmp_path / "fresh", async_save=False) as m:  # was skipped: False, as a saved step
        for force in (False, True):
            with pytest.raises(ValueError, match=r"CheckpointManager.save: step must be >= 0, got -1"):
                m.save(-1, plan, tables, force=force)
        assert m.all_steps() == []


def test_saving_after_close_is_an_error_and_restoring_still_works(static8, tmp_path):
    """Saving through a closed manager (after its `with` block) waited forever on orbax's background thread."""
    plan, tables = static8
    with se.CheckpointManager(tmp_path) as m:
        assert m.save(1, plan, tables)
    with pytest.raises(RuntimeError, match=r"CheckpointManager.save: the manager of .* is closed"):
        m.save(2, plan, tables)
    assert m.latest_step() == 1 and m.restore(plan).step == 1



def test_a_manager_opened_and_closed_exits_without_an_error_from_orbax(tmp_path):
    """close() did not wait for orbax's removal of leftover temporary directories (started when a manager opens;
    only a save waited for it): a program that opened a new checkpoint directory, closed it and exited printed
    "ERROR:absl ... cannot schedule new futures after interpreter shutdown" with a traceback."""
    code = ("import sys, sparse_embed as se\n"
            "with se.CheckpointManager(sys.argv[1]):\n"
            "    pass\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    for name in ("a", "b"):
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path / name)], capture_output=True, text=True,
                              env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "cannot schedule new futures" not in done.stderr and "Traceback" not in done.stderr, done.stderr



def test_close_does_not_raise_what_the_removal_of_leftover_temporary_directories_met(tmp_path, monkeypatch):
    """close() waits for that removal (above); where it failed (a directory another manager of the same checkpoint
    was writing: orbax logs it), close raised its OSError ("Directory not empty") and left the manager open."""
    m = se.CheckpointManager(tmp_path)

    def failed():
        raise OSError(39, "Directory not empty", "user.orbax-checkpoint-tmp")
    monkeypatch.setattr(m._manager, "_maybe_await_cleanup_tmp_directory", failed)
    m.close()
    assert m._closed

def test_saving_tables_without_slots_is_refused_before_anything_is_written(static8, tmp_path):
    """Tables made with `with_slots=False` (an eval state) were saved as a training step whose metadata lists the
    optimizer's slots, without them: every restore then said "Every step ... is corrupt"."""
    plan, _ = static8
    tables = se.init_tables(plan, jax.random.key(0), with_slots=False)
    with se.CheckpointManager(tmp_path) as m:
        with pytest.raises(ValueError, match=r"CheckpointManager.save: stack 'items' has no optimizer slots .*"
                                             r"Adagrad slots \['accumulator'\].*se.export_serving"):
            m.save(1, plan, tables)
        m.wait()
        assert m.all_steps() == []
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == []


def test_a_manager_on_a_file_or_a_step_directory_is_refused_naming_it(static8, tmp_path):
    """A file gave orbax's bare NotADirectoryError; a step directory (or a serving export) "No complete checkpoint"
    though it is one, and a save there nested a step inside the step."""
    plan, tables = static8
    with se.CheckpointManager(tmp_path / "ck") as m:
        m.save(3, plan, tables)
    se.export_serving(tmp_path / "served", plan, tables)
    (tmp_path / "file").write_text("x")
    with pytest.raises(se.CheckpointError, match=r"file is a file, not a checkpoint directory"):
        se.CheckpointManager(tmp_path / "file")
    for step_dir in (tmp_path / "ck" / "3", tmp_path / "served"):
        with pytest.raises(se.CheckpointError, match=r"is one checkpoint step \(it has a 'meta' item\), not the "
                                                     r"directory of a CheckpointManager: open the directory above it"):
            se.CheckpointManager(step_dir)
    assert sorted(p.name for p in (tmp_path / "ck" / "3").iterdir() if p.name.isdigit()) == []
    with se.CheckpointManager(tmp_path / "ck") as m:
        assert m.restore(plan).step == 3

def test_restore_step_must_be_an_integer(static8, tmp_path):
    plan, tables = static8
    with se.CheckpointManager(tmp_path, async_save=False) as m:
        m.save(5, plan, tables)
        for bad in ("5", 5.0, True):
            for read in (lambda: m.restore(plan, step=bad), lambda: m.info(bad)):
                with pytest.raises(TypeError, match=r"CheckpointManager: step must be an integer, got"):
                    read()
            with pytest.raises(TypeError, match=r"^step must be an integer, got"):
                se.read_info(tmp_path, step=bad)
        assert m.restore(plan, step=np.int64(5)).step == 5 and m.info(jnp.int32(5)).step == 5
        assert se.read_info(tmp_path, step=np.int32(5)).step == 5
