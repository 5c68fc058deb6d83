"""sparse_embed.flax.linen.Embed: the same activations and updated tables as lookup + jax.grad."""

from __future__ import annotations

import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import OVERWRITE_WITH_GRADIENT

import sparse_embed as se
from sparse_embed.flax import linen as sel
from conftest import make_mesh
from train_fixtures import PLACEMENTS, B, assert_trees_equal, features_vector, make_batch, make_plan


class Head(nn.Module):
    @nn.compact
    def __call__(self, acts):
        return nn.Dense(1)(nn.relu(nn.Dense(16)(features_vector(acts))))[:, 0]


class Tower(nn.Module):
    plan: se.EmbeddingPlan

    def setup(self):
        self.embed = sel.Embed(self.plan)
        self.head = Head()

    def __call__(self, batch, step=None):
        acts = self.embed(batch, step)
        return self.head(acts), acts


LABELS = np.random.default_rng(3).normal(size=B).astype(np.float32)


def _model_loss(model):
    def loss(params, batch, step):
        out, acts = model.apply({"params": params}, batch, step)
        return jnp.mean((out - LABELS) ** 2), acts

    return loss


def _direct_loss(plan):
    def loss(tables, head, batch, step):
        acts = se.lookup(plan, batch, tables, step)
        return jnp.mean((Head().apply({"params": head}, acts) - LABELS) ** 2), acts

    return loss


def _params(plan):
    """What Tower.init makes, from init_tables and Head.init (cheaper: no lookup in the init)."""
    acts = {n: jnp.ones(f.output_shape) for n, f in plan.features.items()}
    return {"embed": {"tables": se.init_tables(plan, jax.random.key(0))},
            "head": Head().init(jax.random.key(1), acts)["params"]}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_activations_and_updated_tables_equal_lookup(mesh8, placement):
    plan = make_plan(mesh8, "sgd", placement=placement)  # test_flax_nnx covers adagrad and rowwise
    batch, step = make_batch(plan, 0), jnp.int32(3)
    params = _params(plan)
    tables = params["embed"]["tables"]

    grads, acts = jax.jit(jax.grad(_model_loss(Tower(plan)), has_aux=True))(params, batch, step)
    (new_tables, head_grads), want_acts = jax.jit(jax.grad(_direct_loss(plan), argnums=(0, 1), has_aux=True))(
        tables, params["head"], batch, step)
    assert_trees_equal(acts, want_acts)
    assert_trees_equal(grads["embed"]["tables"], new_tables)
    assert_trees_equal(grads["head"], head_grads)
    for s in plan.stack_names:  # the "gradient" is the updated table, not a delta
        changed = np.asarray(new_tables[s].table) != np.asarray(tables[s].table)
        assert changed.any() and not changed.all()


def test_jit_init_keeps_tables_sharded(mesh8):
    plan = make_plan(mesh8)
    params = jax.jit(Tower(plan).init)(jax.random.key(1), make_batch(plan, 0), 0)["params"]
    assert jax.tree.structure(params) == jax.tree.structure(jax.eval_shape(lambda: _params(plan)))
    for leaf in jax.tree.leaves(params["embed"]):
        assert leaf.sharding.is_equivalent_to(plan.table_sharding(), 2)
    assert set(params["embed"]["tables"]["users"].slots) == {"momentum", "velocity"}


def test_eval_module_has_no_slots(mesh8):
    plan = make_plan(mesh8)
    variables = jax.eval_shape(sel.Embed(plan, with_slots=False).init, jax.random.key(0), make_batch(plan, 0))
    assert all(v.slots == {} for v in variables["params"]["tables"].values())


def test_an_eval_module_reads_trained_tables_and_refuses_another_plans_naming_the_stack(mesh8):
    """Trained params (with slots) applied by an eval Embed(with_slots=False) give lookup's activations; tables
    of another shape get lookup's error naming the stack (not Flax's shape error between two stacks)."""
    plan = make_plan(mesh8)
    batch = make_batch(plan, 0)
    params = jax.jit(sel.Embed(plan).init)(jax.random.key(0), batch, 0)["params"]
    got = sel.Embed(plan, with_slots=False).apply({"params": params}, batch)
    assert_trees_equal(got, se.lookup(plan, batch, params["tables"]))
    users = params["tables"]["users"]
    bad = {**params["tables"], "users": users._replace(table=users.table[:8])}
    with pytest.raises(ValueError, match=r"Stack 'users': table has shape \(8, .*\), the plan expects"):
        sel.Embed(plan, with_slots=False).apply({"params": {"tables": bad}}, batch)


def _readme_train_step(model, tx):
    """The README's linen step: grad, update, apply; donated."""
    loss_fn = lambda p, b, s: _model_loss(model)(p, b, s)[0]

    @jax.jit(donate_argnums=(0, 1))
    def train_step(params, opt_state, batch, step):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, step)
        updates, opt_state = tx.update(grads, opt_state, params)
        return se.apply_updates(params, updates), opt_state, loss

    return train_step


def test_documented_train_step_equals_lookup_plus_plain_optax(mesh8):
    """The README's linen step: grad, update, apply; donated; no recompile for a new batch."""
    plan = make_plan(mesh8)
    model = Tower(plan)
    tx = se.optax_tx(optax.adam(1e-2))
    layout = se.LayoutMap(mesh8, plan=plan)  # dense state replicated and committed, as the step returns it
    params = _params(plan)
    params = jax.device_put(params, layout.shardings(params))
    opt_state = jax.jit(tx.init, out_shardings=layout.shardings(jax.eval_shape(tx.init, params)))(params)
    train_step = _readme_train_step(model, tx)

    ref = (params["embed"]["tables"], params["head"], optax.adam(1e-2).init(params["head"]))
    ref_sh = layout.shardings(ref)  # pinned: the reference compiles once too
    ref = jax.device_put(jax.tree.map(jnp.copy, ref), ref_sh)  # params are donated below

    @jax.jit(out_shardings=ref_sh)
    def reference_step(tables, head, head_state, batch, step):
        new_tables, g = jax.grad(lambda *a: _direct_loss(plan)(*a)[0], argnums=(0, 1))(tables, head, batch, step)
        updates, head_state = optax.adam(1e-2).update(g, head_state, head)
        return new_tables, optax.apply_updates(head, updates), head_state

    for step in range(3):
        batch = make_batch(plan, step)
        old_table = params["embed"]["tables"]["items"].table
        params, opt_state, _ = train_step(params, opt_state, batch, jnp.int32(step))
        ref = reference_step(*ref, batch, jnp.int32(step))
        assert old_table.is_deleted()
        assert_trees_equal(params["embed"]["tables"], ref[0])
        assert_trees_equal(params["head"], ref[1])
    assert train_step._cache_size() == 1 and reference_step._cache_size() == 1


def _documented_linen_checkpoint() -> tuple[str, str]:
    """docs/checkpoints.md's linen lines (the "With Flax" block up to its nnx part), as (save, restore) code: the
    save runs every line but the restore's, the restore every line but the save."""
    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md").read_text()
    block = re.search(r"### With Flax.*?```python\n(.*?)```", text, re.S).group(1).split("\n# nnx:")[0]
    lines = block.splitlines()
    cut = next(i for i, line in enumerate(lines) if "manager.restore(" in line)
    return ("\n".join(lines[:cut]), "\n".join(line for line in lines if "manager.save(" not in line))


def test_the_documented_checkpoint_restores_into_a_fresh_run_that_trains_on_bitwise(mesh8, tmp_path):
    """docs/checkpoints.md's linen code, as it stands: saved after two steps of the README's linen training, restored
    into params and an optax state made afresh (`jax.jit(model.init)`, `tx.init`: the state's step count lies on
    one device), two more steps equal the run's, bit for bit."""
    plan = make_plan(mesh8)
    model = Tower(plan)
    tx = se.optax_tx(optax.adam(1e-2))
    train_step = _readme_train_step(model, tx)

    def fresh(seed):
        params = jax.jit(model.init)(jax.random.key(seed), make_batch(plan, 0), 0)["params"]
        return params, tx.init(params)

    save, restore = _documented_linen_checkpoint()
    params, opt_state = fresh(0)
    for step in range(2):
        params, opt_state, _ = train_step(params, opt_state, make_batch(plan, step), jnp.int32(step))
    with se.CheckpointManager(tmp_path) as manager:
        exec(save, {"jax": jax, "manager": manager, "step": 2, "plan": plan, "params": params, "opt_state": opt_state})
    params2, opt_state2 = fresh(5)
    ns = {"jax": jax, "plan": plan, "params": params2, "opt_state": opt_state2}
    with se.CheckpointManager(tmp_path) as ns["manager"]:
        exec(restore, ns)
    params2, opt_state2 = ns["params"], ns["opt_state"]
    for step in range(2, 4):
        params, opt_state, want = train_step(params, opt_state, make_batch(plan, step), jnp.int32(step))
        params2, opt_state2, got = train_step(params2, opt_state2, make_batch(plan, step), jnp.int32(step))
        assert float(got) == float(want)
    assert_trees_equal(params2, params)
    assert_trees_equal(opt_state2, opt_state)


def test_train_state_steps_dense_params_with_tx_and_swaps_in_the_new_tables(mesh8):
    """`sel.TrainState` over three steps: the tables are the lookup's updated tables, the head is adam's step on
    its own gradient (optax alone), and the jitted step compiles once (optax's step count starts on the mesh)."""
    plan = make_plan(mesh8, "adagrad")
    params, model, dense = _params(plan), Tower(plan), optax.adam(1e-2)
    state = sel.TrainState.create(apply_fn=model.apply, params=params, tx=dense)
    loss = _model_loss(model)

    @jax.jit
    def train_step(state, batch, step):
        grads, _ = jax.grad(loss, has_aux=True)(state.params, batch, step)
        return state.apply_gradients(grads=grads)

    direct = jax.jit(jax.grad(_direct_loss(plan), argnums=(0, 1), has_aux=True))
    tables, head, opt = params["embed"]["tables"], params["head"], dense.init(params["head"])
    for i in range(3):
        batch, step = make_batch(plan, i), jnp.int32(i)
        state = train_step(state, batch, step)
        (tables, head_grads), _ = direct(tables, head, batch, step)
        updates, opt = dense.update(head_grads, opt, head)
        head = optax.apply_updates(head, updates)
    # close, not equal: adam inside one jit and outside it round alike only to float32's last bits
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    jax.tree.map(close, state.params, {"embed": {"tables": tables}, "head": head})
    assert int(state.step) == 3 and train_step._cache_size() == 1
    with pytest.raises(NotImplementedError, match="'_overwrite_with_gradient' collection are not supported"):
        state.apply_gradients(grads={"params": state.params, OVERWRITE_WITH_GRADIENT: {}})


def test_optax_tx_state_starts_on_the_tables_mesh(mesh8):
    """`optax_tx(adam).init`'s step count (made uncommitted by optax) lands replicated on the tables' mesh, so the
    step's second call reuses the first one's program; a dense leaf the caller placed on one device stays."""
    plan = make_plan(mesh8)
    params = _params(plan)
    params["head"] = jax.device_put(params["head"], jax.devices()[3])
    state = se.optax_tx(optax.adam(1e-3)).init(params)
    (count,) = [x for x in jax.tree.leaves(state) if x.ndim == 0]
    assert count.sharding.is_equivalent_to(jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec()), 0)
    for leaf in jax.tree.leaves(state):
        if leaf.ndim:  # adam's moments of the head: where the head is
            assert leaf.sharding.device_set == {jax.devices()[3]}


@pytest.mark.parametrize("devices", [1, 8])
def test_the_train_step_compiles_once_on_one_device_too(devices):
    """A one-device mesh (`se.plan(features)` on one CPU) is a mesh too: the jitted step returns the dense params
    and optax's count on it, so an eager `model.init`'s params and the count must start there (they were left on
    their default device, and the README's linen step and a `TrainState` step compiled twice)."""
    plan = make_plan(make_mesh(devices))
    model, batch = Tower(plan), make_batch(plan, 0)
    params = model.init(jax.random.key(0), batch, 0)["params"]  # eager: the head's params unplaced
    tx = se.optax_tx(optax.adam(1e-2))
    loss = _model_loss(model)

    @jax.jit
    def readme_step(params, opt_state, batch, step):
        grads, _ = jax.grad(loss, has_aux=True)(params, batch, step)
        updates, opt_state = tx.update(grads, opt_state, params)
        return se.apply_updates(params, updates), opt_state

    @jax.jit
    def state_step(state, batch, step):
        return state.apply_gradients(grads=jax.grad(loss, has_aux=True)(state.params, batch, step)[0])

    placed = jax.jit(model.init)(jax.random.key(0), batch, 0)["params"]
    args = (placed, tx.init(placed))  # the README's: placed by jit, optax's count not
    state = sel.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    for i in range(2):
        batch = make_batch(plan, i)
        args = readme_step(*args, batch, jnp.int32(i))
        state = state_step(state, batch, jnp.int32(i))
    assert (readme_step._cache_size(), state_step._cache_size()) == (1, 1)


def test_a_train_state_subclass_with_batch_stats_compiles_once(mesh8):
    """flax's recipe for BatchNorm, a `TrainState` subclass with a `batch_stats` field given to `create`: an eager
    init's batch stats start replicated on the tables' mesh, where the jitted step returns them (they stayed
    unplaced, and the step compiled again at its second call)."""
    plan = make_plan(mesh8)

    class Normed(nn.Module):
        @nn.compact
        def __call__(self, batch, step=None):
            return nn.Dense(1)(nn.BatchNorm(use_running_average=False)(features_vector(sel.Embed(plan)(batch, step))))

    class State(sel.TrainState):
        batch_stats: dict

    model = Normed()
    variables = model.init(jax.random.key(0), make_batch(plan, 0), 0)
    state = State.create(apply_fn=model.apply, params=variables["params"], tx=optax.adam(1e-2),
                         batch_stats=variables["batch_stats"])

    @jax.jit
    def train_step(state, batch, step):
        def loss(params):
            out, new = model.apply({"params": params, "batch_stats": state.batch_stats}, batch, step,
                                   mutable=["batch_stats"])
            return jnp.mean((out[:, 0] - LABELS) ** 2), new["batch_stats"]

        grads, batch_stats = jax.grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=batch_stats)

    for i in range(2):
        state = train_step(state, make_batch(plan, i), jnp.int32(i))
    assert train_step._cache_size() == 1
