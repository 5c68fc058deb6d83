"""Checkpoints: exact restores across mesh sizes and stackings, training continuity, errors, crash safety."""

from __future__ import annotations

import gc
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import sparse_embed as se
from sparse_embed.io.ckpt_format import STAGING
from sparse_embed import optimizers as opt
from conftest import devices as conftest_devices, make_mesh

B = 8
STACKINGS = {"auto": "auto", "none": None, "explicit": [["a", "c"]]}


def _specs(vocab_a=37, dim_a=8, optimizer_a=None):
    a = se.TableSpec("a", vocab_a, dim_a, optimizer=optimizer_a or opt.Adagrad(0.1), combiner="sum")
    b = se.TableSpec("b", 70, 4, optimizer=opt.Adam(0.01), combiner="mean")
    c = se.TableSpec("c", 19, 8, optimizer=opt.Adagrad(0.1), combiner="sum")
    return {"fa": se.FeatureSpec("fa", a, B), "fb": se.FeatureSpec("fb", b, B), "fc": se.FeatureSpec("fc", c, B)}


def _random_state(feats, seed=0):
    """Random per-table values and slots (numpy): the independent expectation of every restore."""
    rng = np.random.default_rng(seed)
    tables, slots = {}, {}
    for f in feats.values():
        t = f.table
        tables[t.name] = rng.normal(size=(t.vocabulary_size, t.embedding_dim)).astype(np.float32)
        slots[t.name] = {k: rng.uniform(0.1, 1.0, (t.vocabulary_size, s.width)).astype(np.float32)
                         for k, s in t.resolved_optimizer.slots(t.embedding_dim).items()}
    return tables, slots


def _assert_state(plan, state, tables, slots):
    got = se.unstack_state(plan, state)
    for name, w in tables.items():
        np.testing.assert_array_equal(got[name]["table"], w, err_msg=name)
        for k, v in slots[name].items():
            np.testing.assert_array_equal(got[name][k], v, err_msg=f"{name}/{k}")


@pytest.fixture
def saved8(tmp_path):
    """A checkpoint saved from 8 devices (auto stacking), with a user pytree."""
    feats = _specs()
    tables, slots = _random_state(feats)
    plan = se.plan(feats, make_mesh(8))
    user = {"dense": jnp.arange(6.0).reshape(2, 3), "count": jnp.int32(7)}
    with se.CheckpointManager(tmp_path / "ck") as ckpt:
        assert ckpt.save(3, plan, se.stack_tables(plan, tables, slots), user=user)
        ckpt.wait()
    return tmp_path / "ck", feats, tables, slots


@pytest.mark.parametrize("stacking", list(STACKINGS), ids=list(STACKINGS))
@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_restore_8_to_n_is_exact(saved8, devices, stacking):
    path, feats, tables, slots = saved8
    plan = se.plan(feats, make_mesh(devices), stacking=STACKINGS[stacking])
    with se.CheckpointManager(path) as ckpt:
        r = ckpt.restore(plan)
    assert r.step == 3
    _assert_state(plan, r.tables, tables, slots)
    sharding = plan.table_sharding()
    for v in r.tables.values():
        assert v.table.sharding == sharding and all(s.sharding == sharding for s in v.slots.values())


@pytest.mark.parametrize("saved_on", [1, 2], ids=["1dev", "2dev"])
@pytest.mark.parametrize("stacking", list(STACKINGS), ids=list(STACKINGS))
def test_restore_n_to_8_is_exact(tmp_path, stacking, saved_on):
    feats = _specs()
    tables, slots = _random_state(feats, seed=1)
    plan2 = se.plan(feats, make_mesh(saved_on), stacking=STACKINGS[stacking])
    with se.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, plan2, se.stack_tables(plan2, tables, slots))
        ckpt.wait()
        plan8 = se.plan(feats, make_mesh(8), stacking="auto")
        _assert_state(plan8, ckpt.restore(plan8).tables, tables, slots)


def test_restore_between_a_one_axis_and_a_two_axis_mesh_is_exact(tmp_path):
    """Tables sharded over one axis of a 2-D mesh are replicated over the other: the store counted every
    replica's rows in the checksums it saved and compared, so a save on a 1-D mesh restored onto a 2-D one (or
    back) raised CorruptCheckpointError on a good checkpoint."""
    feats = _specs()
    tables, slots = _random_state(feats, seed=2)
    flat = se.plan(feats, make_mesh(4))
    two_axes = se.plan(feats, Mesh(conftest_devices(8).reshape(2, 4), ("data", "model")), axis_name="model")
    for k, (saved, restored) in enumerate(((flat, two_axes), (two_axes, flat), (two_axes, two_axes))):
        with se.CheckpointManager(tmp_path / str(k)) as ckpt:
            ckpt.save(1, saved, se.stack_tables(saved, tables, slots))
            ckpt.wait()
            _assert_state(restored, ckpt.restore(restored).tables, tables, slots)


def test_user_pytree_with_optax_state_restores_onto_another_mesh(saved8, tmp_path):
    feats = _specs()
    plan = se.plan(feats, make_mesh(2))
    params = {"w": jnp.linspace(0, 1, 12).reshape(3, 4)}
    tx = optax.adam(0.1)
    state = tx.init(params)
    _, state = tx.update(params, state, params)  # non-trivial moments
    user = {"params": params, "opt": state}
    with se.CheckpointManager(tmp_path / "u") as ckpt:
        ckpt.save(5, plan, se.init_tables(plan, jax.random.key(0)), user=user)
        ckpt.wait()
        target = jax.tree.map(lambda x: jax.device_put(jnp.zeros_like(x), jax.devices()[3]), user)
        r = ckpt.restore(se.plan(feats, make_mesh(4)), user=target)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), r.user, user)
    assert jax.tree.structure(r.user) == jax.tree.structure(user)
    assert r.user["params"]["w"].devices() == {jax.devices()[3]}


def test_saving_small_replicated_user_arrays_compiles_nothing(tmp_path):
    """orbax's replica-parallel writing sliced each replicated leaf into one piece per device, a program each,
    compiled at the first save of every process (here: 8 programs for "n", the leaf whose rows divide by 8);
    small leaves are now written by their first replica. A typed PRNG key (in orbax's array metadata) restores."""
    plan = se.plan(_specs(), make_mesh(8))
    replicated = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec())
    user = {"w": jnp.arange(1001 * 3, dtype=jnp.float32).reshape(1001, 3), "b": jnp.ones((997, 5), jnp.bfloat16),
            "n": jnp.arange(8 * 131, dtype=jnp.int32), "key": jax.random.key(3)}
    user = jax.device_put(user, replicated)
    tables = se.init_tables(plan, jax.random.key(0))
    programs = []

    def note(name, secs, **kw):
        if name.endswith(("backend_compile_duration", "cache_retrieval_time_sec")):
            programs.append(kw.get("fun_name", name))

    with se.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, plan, tables)  # the tables' programs
        ckpt.wait()
        jax.monitoring.register_event_duration_secs_listener(note)
        try:
            ckpt.save(2, plan, tables, user=user)
            ckpt.wait()
        finally:
            jax.monitoring.unregister_event_duration_listener(note)
    assert programs == []
    target = jax.tree.map(lambda x: jax.device_put(x, replicated), user)
    with se.CheckpointManager(tmp_path) as ckpt:
        back = ckpt.restore(plan, user=target).user
    for k in ("w", "b", "n"):
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(user[k]))
    np.testing.assert_array_equal(jax.random.key_data(back["key"]), jax.random.key_data(user["key"]))


def test_saving_a_user_pytree_warns_of_nothing(tmp_path, caplog):
    """orbax tries to merge per-process OCDBT files at the end of every save, and warned at every save that it
    found none ("Skipping merge of OCDBT checkpoints"): this library writes without OCDBT, nothing to warn of."""
    plan = se.plan(_specs(), make_mesh(2))
    user = jax.device_put({"w": jnp.ones(3)}, jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec()))
    with caplog.at_level(logging.WARNING), se.CheckpointManager(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(step, plan, se.init_tables(plan, jax.random.key(0)), user=user)
            ckpt.wait()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    with se.CheckpointManager(tmp_path) as ckpt:
        np.testing.assert_array_equal(np.asarray(ckpt.restore(plan, user=user).user["w"]), np.ones(3))


def _train_step(plan, tables, ids, step):
    batch, _ = se.preprocess(plan, ids)

    def loss(t):
        acts = se.lookup(plan, batch, t, step)
        return sum(jnp.sum(jnp.tanh(a) * (i + 1)) for i, a in enumerate(acts.values()))

    return jax.jit(jax.grad(loss))(tables)


@pytest.mark.parametrize("devices", [8, 2])
def test_train_step_after_restore_equals_train_step_without(tmp_path, devices):
    feats = _specs()
    plan8 = se.plan(feats, make_mesh(8))
    rng = np.random.default_rng(3)
    ids = {n: rng.integers(0, f.table.vocabulary_size, (B, 3)) for n, f in feats.items()}
    state = _train_step(plan8, se.init_tables(plan8, jax.random.key(0)), ids, 0)  # slots are non-trivial now
    with se.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, plan8, state)
        ckpt.wait()
        plan = se.plan(feats, make_mesh(devices), stacking=None)
        restored = ckpt.restore(plan).tables
    want = se.unstack_state(plan8, _train_step(plan8, state, ids, 1))
    got = se.unstack_state(plan, _train_step(plan, restored, ids, 1))
    for name in want:
        for k in want[name]:
            if devices == 8:  # same mesh: bit-identical
                np.testing.assert_array_equal(got[name][k], want[name][k], err_msg=f"{name}/{k}")
            else:  # another mesh sums partial activations in another order
                np.testing.assert_allclose(got[name][k], want[name][k], rtol=1e-5, atol=1e-6, err_msg=f"{name}/{k}")


def test_vocab_growth_initialises_new_rows_and_fresh_slots(saved8):
    path, _, tables, slots = saved8
    grown = _specs(vocab_a=100)
    plan = se.plan(grown, make_mesh(4))
    with se.CheckpointManager(path) as ckpt:
        with pytest.raises(ValueError, match=r"Table 'a'.*37.*100.*allow_vocab_growth=True"):
            ckpt.restore(plan)
        # without rng: the table named (it said "Restoring a larger vocabulary needs ... (rng=)", naming none)
        with pytest.raises(ValueError, match=r"Table 'a': vocabulary_size is 37 in the checkpoint .* but 100 in the "
                                             r"plan: its new rows need their initial values, pass rng="):
            ckpt.restore(plan, allow_vocab_growth=True)
        r = ckpt.restore(plan, allow_vocab_growth=True, rng=jax.random.key(9))
    got = se.unstack_state(plan, r.tables)
    fresh = se.unstack_tables(plan, se.init_tables(plan, jax.random.key(9)))
    np.testing.assert_array_equal(got["a"]["table"][:37], tables["a"])
    np.testing.assert_array_equal(got["a"]["table"][37:], fresh["a"][37:])
    np.testing.assert_array_equal(got["a"]["accumulator"][:37], slots["a"]["accumulator"])
    init = opt.Adagrad(0.1).slots(8)["accumulator"].init
    np.testing.assert_array_equal(got["a"]["accumulator"][37:], np.full((63, 8), init, np.float32))
    np.testing.assert_array_equal(got["b"]["table"], tables["b"])


@pytest.mark.parametrize("change, match", [
    ("missing", r"Table 'extra' is not in the checkpoint"),
    ("unused", r"Table 'c' of the checkpoint .* is not in the plan"),
    ("smaller_vocab", r"Table 'a': vocabulary_size is 37 in the checkpoint .* but 30 .* cannot shrink"),
    ("dim", r"Table 'a': embedding_dim is 8 in the checkpoint .* but 16"),
    ("optimizer", r"Table 'a': the checkpoint .* optimizer Adagrad .* Adam"),
])
def test_mismatched_specs_name_the_table(saved8, change, match):
    path = saved8[0]
    feats = {
        "missing": lambda: {**_specs(), "fx": se.FeatureSpec("fx", se.TableSpec("extra", 5, 8), B)},
        "unused": lambda: {k: v for k, v in _specs().items() if k != "fc"},
        "smaller_vocab": lambda: _specs(vocab_a=30),
        "dim": lambda: _specs(dim_a=16),
        "optimizer": lambda: _specs(optimizer_a=opt.Adam(0.1)),
    }[change]()
    with se.CheckpointManager(path) as ckpt, pytest.raises(ValueError, match=match):
        ckpt.restore(se.plan(feats, make_mesh(2)))



@pytest.mark.parametrize("devices", [1, 4])
def test_tables_without_slots_restore_into_a_plan_with_another_optimizer(saved8, devices):
    """`restore_embeddings(..., with_slots=False)` reads no slot, so the plan's optimizer does not matter (an
    eval plan with SGD was refused: "the checkpoint has optimizer Adagrad ... use the same optimizer", while a
    serving export of the same step restored); a restore with slots still refuses it."""
    path, _, tables, _ = saved8
    feats = _specs(vocab_a=45, optimizer_a=opt.SGD(0.1))
    plan = se.plan(feats, make_mesh(devices))
    state = se.restore_embeddings(plan, path, with_slots=False, allow_vocab_growth=True, rng=jax.random.key(2))
    assert all(v.slots == {} for v in state.values())
    got = se.unstack_tables(plan, state)
    fresh = se.unstack_tables(plan, se.init_tables(plan, jax.random.key(2), with_slots=False))
    np.testing.assert_array_equal(got["a"][:37], tables["a"])
    np.testing.assert_array_equal(got["a"][37:], fresh["a"][37:])
    for name in ("b", "c"):
        np.testing.assert_array_equal(got[name], tables[name])
    with pytest.raises(ValueError, match=r"Table 'a': the checkpoint .* optimizer Adagrad .* SGD"):
        se.restore_embeddings(plan, path, allow_vocab_growth=True, rng=jax.random.key(2))

# orbax leaves a tensorstore future behind when a read fails; its callback may fire after its event
# loop closed ("Event loop is closed", an unraisable exception at garbage collection): not ours.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_bad_checkpoints_give_clear_errors(saved8, tmp_path):
    path = saved8[0]
    plan = se.plan(_specs(), make_mesh(2))
    with pytest.raises(se.CheckpointError, match="does not exist"):
        se.restore_embeddings(plan, tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(se.CheckpointError, match="No complete checkpoint"):
        se.restore_embeddings(plan, tmp_path / "empty")
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    for array in (broken / "3" / "embeddings").iterdir():  # the arrays' data
        if array.is_dir() and array.name != "array_metadatas":
            shutil.rmtree(array)
    with pytest.raises(se.CheckpointError, match="corrupt or incomplete"):
        se.restore_embeddings(plan, broken)
    gc.collect()  # surface orbax's leftover future here (see the mark above)
    shutil.copytree(path, tmp_path / "badmeta")
    (tmp_path / "badmeta" / "3" / "meta" / "metadata").write_text("{not json")
    with pytest.raises(se.CheckpointError, match="cannot read its metadata"):
        se.read_info(tmp_path / "badmeta")


def test_max_to_keep_latest_step_and_interval(tmp_path):
    feats = _specs()
    plan = se.plan(feats, make_mesh(2))
    state = se.init_tables(plan, jax.random.key(0))
    with se.CheckpointManager(tmp_path, max_to_keep=2, save_interval_steps=2) as ckpt:
        saved = [ckpt.save(s, plan, state) for s in range(7)]
        ckpt.wait()
        assert saved == [True, False, True, False, True, False, True]
        assert ckpt.all_steps() == [4, 6] and ckpt.latest_step() == 6
        assert ckpt.info().step == 6 and ckpt.info().num_shards == 2



def test_a_step_just_saved_restores_without_waiting_first(tmp_path):
    """`restore` right after an asynchronous `save` of the same manager restores that step (it reported it
    missing: "No step 4 ...; complete steps are [2]"): saves in progress are waited for first."""
    plan = se.plan(_specs(), make_mesh(1))
    state = se.init_tables(plan, jax.random.key(0))
    with se.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(2, plan, state)
        later = jax.tree.map(lambda x: x + 1, state)
        ckpt.save(4, plan, later)
        r = ckpt.restore(plan)
    assert r.step == 4
    chex.assert_trees_all_equal(se.unstack_state(plan, r.tables), se.unstack_state(plan, later))

_CHILD = textwrap.dedent("""
    import os, sys, time
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np
    import sparse_embed as se
    from orbax.checkpoint._src.path import atomicity

    path, mode = sys.argv[1], sys.argv[2]
    t = se.TableSpec("a", 50_000, 64, optimizer=se.optimizers.Adagrad(0.1))
    plan = se.plan({"f": se.FeatureSpec("f", t, 2)})
    state = se.init_tables(plan, jax.random.key(0))
    ckpt = se.CheckpointManager(path)
    if mode == "first":
        ckpt.save(1, plan, state); ckpt.wait(); ckpt.close(); sys.exit(0)
    if mode == "hang":  # the data is written, the commit never happens
        async def never(self):
            print("COMMITTING", flush=True); time.sleep(600)
        atomicity.AtomicRenameTemporaryPath.finalize = never
    state = jax.tree.map(lambda x: x + 1, state)
    print("SAVING", flush=True)
    ckpt.save(2, plan, state)
    ckpt.wait()
    print("DONE", flush=True)
""")


@pytest.mark.parametrize("mode", ["hang", "during_write"])
def test_killed_save_keeps_the_last_good_checkpoint(tmp_path, mode):
    path = str(tmp_path / "ck")
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    subprocess.run([sys.executable, str(script), path, "first"], check=True, env=env, timeout=120)
    proc = subprocess.Popen([sys.executable, str(script), path, mode], stdout=subprocess.PIPE, text=True, env=env)
    wait_for = "COMMITTING" if mode == "hang" else "SAVING"
    with proc.stdout:
        for line in proc.stdout:
            if wait_for in line:
                break
    if mode == "during_write":  # kill as soon as the temporary step directory exists
        deadline = time.time() + 60
        while not any("tmp" in n for n in os.listdir(path)) and time.time() < deadline:
            time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert sorted(n for n in os.listdir(path) if n.isdigit()) == ["1"]  # step 2 never became a step

    t = se.TableSpec("a", 50_000, 64, optimizer=opt.Adagrad(0.1))
    plan = se.plan({"f": se.FeatureSpec("f", t, 2)}, make_mesh(2))
    with se.CheckpointManager(path) as ckpt:  # its first save removes the leftover temporary directory
        assert ckpt.latest_step() == 1
        r = ckpt.restore(plan)
        want = se.unstack_tables(plan, se.init_tables(plan, jax.random.key(0)))["a"]
        np.testing.assert_array_equal(se.unstack_tables(plan, r.tables)["a"], want)
        assert ckpt.save(2, plan, r.tables)  # the step can be written again
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2]
    assert not [n for n in os.listdir(path) if "tmp" in n]


def test_a_manager_opened_to_restore_leaves_a_save_in_flight_alone(tmp_path):
    """An evaluation job opening the training's directory removed every temporary step as a leftover, the one
    of a save in flight included: that save then failed in orbax ('No ArrayMetadata found') and its step was
    lost. Leftovers are removed at a manager's first save, not when it opens."""
    plan = se.plan(_specs(), make_mesh(2))
    state = se.init_tables(plan, jax.random.key(0))
    with se.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, plan, state)
    in_flight = [tmp_path / "2.orbax-checkpoint-tmp", tmp_path / f"{STAGING}-2"]  # as a save of step 2 has them
    for d in in_flight:
        d.mkdir()
        (d / "part").write_bytes(b"x")
    with se.CheckpointManager(tmp_path) as reader:  # opened to restore: touches nothing
        assert reader.restore(plan).step == 1
    assert all((d / "part").exists() for d in in_flight)
    with se.CheckpointManager(tmp_path) as trainer:  # a manager that saves: those are its leftovers now
        assert trainer.save(3, plan, state)
        trainer.wait()
        assert trainer.all_steps() == [1, 3]
    assert not any(d.exists() for d in in_flight)


def test_leaves_of_a_target_never_placed_restore_unplaced(tmp_path):
    """A fresh `tx.init(params)`'s step count (`jnp.zeros(())`, never placed: uncommitted) was restored pinned to
    one device, and the next step, jitted over params on the plan's mesh, failed on incompatible devices."""
    plan = se.plan(_specs(), make_mesh(8))
    on_mesh = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec())
    params = jax.device_put({"w": jnp.linspace(0, 1, 8, dtype=jnp.float32)}, on_mesh)
    tx = optax.adam(0.1)
    user = {"params": params, "opt": tx.init(params), "key": jax.random.key(5)}
    _, user["opt"] = tx.update(params, user["opt"], params)  # count 1, moments on the mesh
    with se.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, plan, se.init_tables(plan, jax.random.key(0)), user=user)
        ckpt.wait()
        fresh = {"params": params, "opt": tx.init(params), "key": jax.random.key(0)}
        assert not fresh["opt"][0].count.committed and not fresh["key"].committed  # what a fresh run holds
        back = ckpt.restore(plan, user=fresh).user
    assert int(back["opt"][0].count) == 1 and not back["opt"][0].count.committed
    assert not back["key"].committed
    np.testing.assert_array_equal(jax.random.key_data(back["key"]), jax.random.key_data(user["key"]))
    assert back["params"]["w"].sharding == on_mesh  # a placed leaf keeps its placement
    step = jax.jit(lambda p, s: tx.update(p, s, p))  # the next train step's update: runs beside the mesh's arrays
    updates, state = step(back["params"], back["opt"])
    want, _ = tx.update(user["params"], user["opt"], user["params"])
    np.testing.assert_array_equal(np.asarray(updates["w"]), np.asarray(want["w"]))


def test_processes_saving_differently_are_told_before_anything_is_written(tmp_path, monkeypatch):
    """Under jax.distributed, processes saving another step failed with a missing staging file on one and a gloo
    timeout on the other; `data` passed on one process only restored its state on every one. The processes'
    save arguments are compared first (here: another process's, through a stand-in exchange)."""
    from sparse_embed.host import distributed

    feats = _specs()
    plan = se.plan(feats, make_mesh(8))
    tables = se.init_tables(plan, jax.random.key(0))
    others = {}
    monkeypatch.setattr(distributed, "mesh_processes", lambda mesh: (0, 1))
    monkeypatch.setattr(distributed, "allgather_ints", lambda procs, mine, **kw: np.asarray([mine, others["row"]]))
    ckpt = se.CheckpointManager(tmp_path / "ck")
    for row, match in (([4, 0, 0, 0, 0], r"\(step \{0: 3, 1: 4\}, by process;"),
                       ([3, 0, 0, 0, 1], r"\(data \{0: 0, 1: 1\}, by process;")):
        others["row"] = row
        with pytest.raises(ValueError, match=r"CheckpointManager.save: the processes called it differently " + match
                                             + r" id_maps, user, data: 1 if passed\): every process must save the "
                                               r"same step with the same items"):
            ckpt.save(3, plan, tables)
    assert ckpt.all_steps() == [] and not [n for n in os.listdir(tmp_path / "ck") if not n.startswith(".")]
    others["row"] = [3, 0, 0, 0, 0]  # the same call on both: saved
    assert ckpt.save(3, plan, tables)
    ckpt.close()


def test_processes_restoring_other_steps_are_told_so(saved8, monkeypatch):
    """Under jax.distributed, processes restoring different steps each read their own rows of their own step:
    the checksums summed over the processes matched neither, and both steps were reported corrupt. The
    processes' steps are compared first (here: another process's, through a stand-in exchange)."""
    from sparse_embed.host import distributed

    path, feats, tables, slots = saved8
    plan = se.plan(feats, make_mesh(8))
    others = {}
    monkeypatch.setattr(distributed, "mesh_processes", lambda mesh: (0, 1))
    monkeypatch.setattr(distributed, "allgather_ints", lambda procs, mine, **kw: np.asarray([mine, others["row"]]))
    others["row"] = [4, 0]
    with pytest.raises(ValueError, match=r"CheckpointManager.restore: the processes restore differently \(step "
                                         r"\{0: 3, 1: 4\}, by process; user: 1 if passed\), here .*3: every process "
                                         r"must restore the same step"):
        se.CheckpointManager(path).restore(plan)
    others["row"] = [3, 0]  # the same step on both: restored
    _assert_state(plan, se.CheckpointManager(path).restore(plan).tables, tables, slots)
