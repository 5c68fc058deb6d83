"""sparse_embed.flax.nnx: Embed gives lookup's activations and updated tables; Optimizer trains it exactly."""

from __future__ import annotations

import chex
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sparse_embed as se
from sparse_embed.flax import nnx as sen
from conftest import make_mesh
from train_fixtures import PLACEMENTS, B, assert_trees_equal, features_vector, make_batch, make_plan

LABELS = np.random.default_rng(3).normal(size=B).astype(np.float32)


class Head(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(40, 16, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, acts):
        return self.out(nnx.relu(self.hidden(features_vector(acts))))[:, 0]


class Tower(nnx.Module):
    def __init__(self, plan, rngs: nnx.Rngs):
        self.embed = sen.Embed(plan, rngs=rngs)
        self.head = Head(rngs)

    def __call__(self, batch, step=None):
        acts = self.embed(batch, step)
        return self.head(acts), acts


def loss_fn(model, batch, step):
    out, acts = model(batch, step)
    return jnp.mean((out - LABELS) ** 2), acts


def direct_loss(plan, head_def):
    """lookup + the head, on plain arrays: the reference for the module."""

    def loss(tables, head_state, batch, step):
        acts = se.lookup(plan, batch, tables, step)
        return jnp.mean((nnx.merge(head_def, head_state)(acts) - LABELS) ** 2), acts

    return loss


def _embedding_grads(grads: nnx.State, plan) -> dict[str, se.EmbeddingVariables]:
    g = grads["embed"]["tables"]
    return {s: se.EmbeddingVariables(g[s]["table"].get_value(), {k: v.get_value() for k, v in g[s]["slots"].items()})
            for s in plan.stack_names}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("items_optimizer", ["adagrad", "rowwise"])
def test_activations_and_updated_tables_equal_lookup(mesh8, items_optimizer, placement):
    plan = make_plan(mesh8, items_optimizer, placement=placement)
    batch, step = make_batch(plan, 0), jnp.int32(2)
    model = Tower(plan, nnx.Rngs(0))
    tables = model.embed.embedding_variables()

    grad_fn = nnx.jit(nnx.grad(loss_fn, has_aux=True))
    grads, acts = grad_fn(model, batch, step)
    head_def, head_state = nnx.split(model.head)
    (new_tables, head_grads), want_acts = jax.jit(
        jax.grad(direct_loss(plan, head_def), argnums=(0, 1), has_aux=True))(tables, head_state, batch, step)
    assert_trees_equal(acts, want_acts)
    assert_trees_equal(_embedding_grads(grads, plan), new_tables)
    assert_trees_equal(nnx.as_pure(grads["head"]), nnx.as_pure(head_grads))
    changed = np.asarray(new_tables["items"].table) != np.asarray(tables["items"].table)
    assert changed.any() and not changed.all()


def test_variables_are_typed_and_sharded(mesh8):
    plan = make_plan(mesh8)
    model = Tower(plan, nnx.Rngs(0))
    assert_trees_equal(model.embed.embedding_variables(), se.init_tables(plan, nnx.Rngs(0).params()))
    emb = nnx.state(model, sen.EmbeddingTable).flat_state().paths
    assert sorted(emb) == sorted(
        [("embed", "tables", "items", "table"), ("embed", "tables", "items", "slots", "accumulator"),
         ("embed", "tables", "users", "table"), ("embed", "tables", "users", "slots", "momentum"),
         ("embed", "tables", "users", "slots", "velocity")])
    assert len(nnx.state(model, sen.EmbeddingSlot).flat_state()) == 3
    assert all(p[0] == "head" for p in nnx.state(model, sen.DENSE).flat_state().paths)
    shardings = nnx.get_named_sharding(nnx.state(model, sen.EmbeddingTable), mesh8)
    for (_, var), sharding in zip(nnx.state(model, sen.EmbeddingTable).flat_state(), jax.tree.leaves(shardings)):
        assert var.get_value().sharding.is_equivalent_to(plan.table_sharding(), 2)
        assert sharding.is_equivalent_to(plan.table_sharding(), 2)
    # LayoutMap shardings fit an nnx State: device_put, then update the model in place.
    state = nnx.state(model)
    layout = se.LayoutMap(mesh8, [(r"hidden/kernel$", jax.P(None, "x"))], plan=plan)
    nnx.update(model, jax.device_put(state, layout.shardings(state)))
    assert model.head.hidden.kernel.get_value().sharding.spec == jax.P(None, "x")
    assert model.embed.tables["users"]["table"].get_value().sharding.is_equivalent_to(plan.table_sharding(), 2)


def test_eval_module_has_no_slots(mesh8):
    embed = nnx.eval_shape(lambda: sen.Embed(make_plan(mesh8), rngs=nnx.Rngs(0), with_slots=False))
    assert len(nnx.state(embed, sen.EmbeddingTable).flat_state()) == 2
    assert len(nnx.state(embed, sen.EmbeddingSlot).flat_state()) == 0


def test_documented_train_step_equals_lookup_plus_plain_optax(mesh8):
    """The README's nnx step: value_and_grad, optimizer.update; donated; no state of table size."""
    make_tx = lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1, momentum=0.9))
    plan = make_plan(mesh8)
    model = Tower(plan, nnx.Rngs(0))
    optimizer = sen.Optimizer(model, make_tx())
    assert max(x.size for x in jax.tree.leaves(nnx.state(optimizer))) < 40 * 16 + 1  # dense-sized only

    @nnx.jit(donate_argnums=(0, 1))
    def train_step(model, optimizer, batch, step):
        (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch, step)
        optimizer.update(model, grads)
        return loss

    head_def, head = nnx.split(model.head)
    head = nnx.as_pure(head)
    tx = make_tx()

    ref = (model.embed.embedding_variables(), head, tx.init(head))
    ref_sh = se.LayoutMap(mesh8, plan=plan).shardings(ref)  # pinned: the reference compiles once
    ref = jax.device_put(jax.tree.map(jnp.copy, ref), ref_sh)  # the model's arrays are donated below

    @jax.jit(out_shardings=ref_sh)
    def reference_step(tables, head, head_opt, batch, step):
        new_tables, g = jax.grad(lambda *a: direct_loss(plan, head_def)(*a)[0], argnums=(0, 1))(
            tables, head, batch, step)
        updates, head_opt = tx.update(g, head_opt, head)
        return new_tables, optax.apply_updates(head, updates), head_opt

    for step in range(3):
        batch = make_batch(plan, step)
        old = model.embed.tables["items"]["table"].get_value()
        train_step(model, optimizer, batch, jnp.int32(step))
        ref = reference_step(*ref, batch, jnp.int32(step))
        assert old.is_deleted()
        assert_trees_equal(model.embed.embedding_variables(), ref[0])
        assert_trees_equal(nnx.as_pure(nnx.state(model.head)), ref[1])
    assert int(optimizer.step.get_value()) == 3 and reference_step._cache_size() == 1


def test_update_rejects_grads_without_embedding_state(mesh8):
    plan = make_plan(mesh8)
    model = Tower(plan, nnx.Rngs(0))
    optimizer = sen.Optimizer(model, optax.sgd(0.1))
    grads = nnx.state(model, sen.DENSE)  # what nnx.grad(..., argnums=nnx.DiffState(0, sen.DENSE)) returns
    with pytest.raises(ValueError, match=r"grads hold embedding state \[\] but the optimizer's wrt selects "
                                         r"\[\('embed', 'tables', .*take nnx.grad with the wrt given to the "
                                         r"optimizer .*not with `optimizer.wrt`: that is its dense part"):
        optimizer.update(model, grads)
    # flax's docs give nnx.grad `optimizer.wrt`; here that is the dense part, and the message says so
    grads = nnx.grad(lambda m: loss_fn(m, make_batch(plan, 0), 0)[0], argnums=nnx.DiffState(0, optimizer.wrt))(model)
    with pytest.raises(ValueError, match=r"grads hold embedding state \[\] .*not with `optimizer.wrt`"):
        optimizer.update(model, grads)
    frozen = sen.Optimizer(model, optax.sgd(0.1), wrt=sen.DENSE)
    with pytest.raises(ValueError, match=r"grads hold embedding state \[\('embed', .* but the optimizer's wrt "
                                         r"selects \[\]"):
        frozen.update(model, nnx.state(model, nnx.Param))


def test_an_optimizer_whose_wrt_splits_a_stacks_state_is_refused_naming_it(mesh8):
    """A wrt with a table but not its slots trained the table while its Adagrad accumulator never grew (and slots
    without their table changed the slots only), silently; a whole stack, or none, is fine."""
    plan = make_plan(mesh8)
    model = Tower(plan, nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"^Optimizer: wrt selects part of the embedding state of stack "
                                         r"'embed/tables/items', leaving out \['slots/accumulator'\]: the lookup's "
                                         r"backward updates a table and its optimizer slots together\."):
        sen.Optimizer(model, optax.sgd(0.1), wrt=nnx.All(nnx.Param, nnx.Not(sen.EmbeddingSlot)))
    with pytest.raises(ValueError, match=r"stack 'embed/tables/items', leaving out \['table'\]"):
        sen.Optimizer(model, optax.sgd(0.1), wrt=nnx.Any(sen.DENSE, sen.EmbeddingSlot))
    users_only = sen.Optimizer(model, optax.sgd(0.1), wrt=nnx.Any(sen.DENSE, nnx.PathContains("users")))
    assert {p[2] for p in nnx.state(model, users_only.embedding_wrt).flat_state().paths} == {"users"}


def test_an_optimizer_with_wrt_dense_trains_the_head_and_leaves_the_tables_frozen(mesh8):
    """docs/concepts.md: keep the tables out of wrt to freeze them. The head trains as plain optax on the
    lookup's activations (the reference, with the tables as constants); the tables stay bit for bit."""
    plan = make_plan(mesh8)
    model = Tower(plan, nnx.Rngs(0))
    optimizer = sen.Optimizer(model, optax.sgd(0.1), wrt=sen.DENSE)
    tables = jax.tree.map(jnp.copy, model.embed.embedding_variables())
    head_def, head = nnx.split(model.head)
    head = jax.tree.map(jnp.copy, nnx.as_pure(head))

    @nnx.jit
    def train_step(model, optimizer, batch, step):
        (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True, argnums=nnx.DiffState(0, sen.DENSE))(
            model, batch, step)
        optimizer.update(model, grads)
        return loss

    for step in range(2):
        batch = make_batch(plan, step)
        train_step(model, optimizer, batch, jnp.int32(step))
        g = jax.grad(lambda h: direct_loss(plan, head_def)(jax.lax.stop_gradient(tables), h, batch, step)[0])(head)
        head = jax.tree.map(lambda p, d: p - 0.1 * d, head, g)
        assert_trees_equal(model.embed.embedding_variables(), tables)
        chex.assert_trees_all_close(nnx.as_pure(nnx.state(model.head)), head, rtol=1e-6, atol=1e-7)


def _raw_plan(mesh):
    """A raw-id users table small enough to fill (8 rows a shard): admission, eviction; items static."""
    users = se.TableSpec("users", 64, 8, optimizer=se.optimizers.Adagrad(0.3),
                         dynamic=se.Dynamic(admit_after=2))
    items = se.TableSpec("items", 61, 8, optimizer=se.optimizers.SGD(0.2))
    return se.plan([se.FeatureSpec("user", users, B), se.FeatureSpec("item", items, B)], mesh)


def _raw_batch(plan, step):
    rng = np.random.default_rng(step)
    users = rng.choice(2**63 - 1 - np.arange(100, dtype=np.int64) * 2**40, size=(B, 3))  # 100 ids near 2**63
    users[rng.random((B, 3)) < 0.2] = -1
    return se.preprocess(plan, {"user": users, "item": rng.integers(0, 61, B)})[0]


class RawTower(nnx.Module):
    def __init__(self, plan, rngs: nnx.Rngs):
        self.embed = sen.Embed(plan, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, batch, step):
        acts = self.embed(batch, step)
        return self.out(jnp.concatenate([acts["user"], acts["item"]], -1))[:, 0]


def test_map_ids_trains_a_raw_id_table_as_the_functional_api_does(mesh8):
    """`Embed.map_ids` then the documented nnx step, against `se.map_ids` + `lookup` + optax on plain arrays,
    bit for bit over steps that admit, keep waiting and evict; `train=False` changes nothing."""
    plan = _raw_plan(mesh8)
    model = RawTower(plan, nnx.Rngs(0))
    optimizer = sen.Optimizer(model, optax.sgd(0.1))
    maps = se.init_id_maps(plan, jax.random.key(1))

    @nnx.jit(donate_argnums=(0, 1, 2))  # model, optimizer and maps updated in place
    def train_step(model, optimizer, maps, batch, step):
        batch, maps, id_stats = model.embed.map_ids(batch, maps, step)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(batch, step) - LABELS) ** 2))(model)
        optimizer.update(model, grads)
        return loss, maps, id_stats

    out_def, out = nnx.split(model.out)
    out = nnx.as_pure(out)
    tx = optax.sgd(0.1)

    @jax.jit
    def reference_step(tables, out, out_opt, maps, batch, step):
        batch, tables, maps, id_stats = se.map_ids(plan, batch, tables, maps, step)

        def loss(tables, out):
            acts = se.lookup(plan, batch, tables, step)
            pred = nnx.merge(out_def, out)(jnp.concatenate([acts["user"], acts["item"]], -1))[:, 0]
            return jnp.mean((pred - LABELS) ** 2)

        new_tables, g = jax.grad(loss, argnums=(0, 1))(tables, out)
        updates, out_opt = tx.update(g, out_opt, out)
        return new_tables, optax.apply_updates(out, updates), out_opt, maps, id_stats

    ref = jax.tree.map(jnp.copy, (model.embed.embedding_variables(), out, tx.init(out), maps))  # the step donates
    admitted = evicted = 0
    for step in range(10):
        batch = _raw_batch(plan, step)
        _, maps, stats = train_step(model, optimizer, maps, batch, jnp.int32(step))
        *ref, want_stats = reference_step(*ref, batch, jnp.int32(step))
        assert_trees_equal(model.embed.embedding_variables(), ref[0])
        assert_trees_equal(nnx.as_pure(nnx.state(model.out)), ref[1])
        assert_trees_equal(maps, ref[3])
        assert_trees_equal(stats, want_stats)
        admitted += int(stats["users"].admitted)
        evicted += int(stats["users"].evicted)
    assert admitted > 64 and evicted > 0  # the table filled and rows were reused

    before = jax.tree.map(np.asarray, model.embed.embedding_variables())
    batch, same_maps, stats = model.embed.map_ids(_raw_batch(plan, 99), maps, 10, train=False)
    assert_trees_equal(model.embed.embedding_variables(), before)
    assert_trees_equal(same_maps, maps)
    assert int(stats["users"].admitted) == 0 and type(batch["users"]) is se.ShardedCooMatrix  # mapped: rows


def test_a_model_calling_its_embed_twice_under_grad_is_refused(mesh8):
    """Two calls of one `Embed` in a loss would add two updated states (every row doubled): nnx.grad raises,
    naming the stack; two calls in a forward-only (eval) step are fine and equal."""
    plan = make_plan(mesh8, "adagrad")
    batch = make_batch(plan, 0)
    model = Tower(plan, nnx.Rngs(0))

    def twice(model, batch):
        return sum(jnp.sum(a) for a in model.embed(batch).values()) + jnp.sum(model(batch)[0])

    with pytest.raises(ValueError, match=rf"Stack '({'|'.join(plan.stack_names)})'.*second time"):
        nnx.grad(twice)(model, batch)
    first, second = nnx.jit(lambda m, b: (m.embed(b), m.embed(b)))(model, batch)
    assert_trees_equal(first, second)


def test_a_checkpointed_model_and_optimizer_restore_into_a_fresh_one_and_train_on_alike(mesh8, tmp_path):
    """The documented nnx checkpoint: tables from `embedding_variables()`, the rest as the user pytree;
    restored into a model and optimizer made afresh (other initial values), two more steps equal the run's."""
    plan = make_plan(mesh8)

    @nnx.jit
    def train_step(model, optimizer, batch, step):
        (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch, step)
        optimizer.update(model, grads)
        return loss

    def dense(model, optimizer):  # the user pytree, replicated over the mesh (the restore target's placement)
        state = {"model": nnx.state(model, nnx.Not(sen.EmbeddingTable)), "opt": nnx.state(optimizer)}
        return jax.device_put(state, jax.sharding.NamedSharding(mesh8, jax.sharding.PartitionSpec()))

    model = Tower(plan, nnx.Rngs(0))
    optimizer = sen.Optimizer(model, optax.adam(0.01))
    for step in range(2):
        train_step(model, optimizer, make_batch(plan, step), jnp.int32(step))
    with se.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(2, plan, model.embed.embedding_variables(), user=dense(model, optimizer))
    fresh = Tower(plan, nnx.Rngs(7))
    fresh_opt = sen.Optimizer(fresh, optax.adam(0.01))
    with se.CheckpointManager(tmp_path) as ckpt:
        r = ckpt.restore(plan, user=dense(fresh, fresh_opt))
    fresh.embed.set_embedding_variables(r.tables)
    nnx.update(fresh, r.user["model"])
    nnx.update(fresh_opt, r.user["opt"])
    for step in range(2, 4):
        want = train_step(model, optimizer, make_batch(plan, step), jnp.int32(step))
        got = train_step(fresh, fresh_opt, make_batch(plan, step), jnp.int32(step))
        assert float(got) == float(want)
    assert_trees_equal(fresh.embed.embedding_variables(), model.embed.embedding_variables())
    assert_trees_equal(nnx.as_pure(nnx.state(fresh.head)), nnx.as_pure(nnx.state(model.head)))


def test_set_embedding_variables_checks_the_tables_and_an_eval_module_takes_no_slots(mesh8):
    plan = make_plan(mesh8)
    trained = se.init_tables(plan, jax.random.key(5))
    ev = sen.Embed(plan, rngs=nnx.Rngs(0), with_slots=False)
    ev.set_embedding_variables(trained)  # a training state into an eval module: the tables only
    assert_trees_equal({k: v.table for k, v in ev.embedding_variables().items()},
                       {k: v.table for k, v in trained.items()})
    assert all(not v.slots for v in ev.embedding_variables().values())
    module = sen.Embed(plan, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"Stack 'items': the module trains, so it needs the optimizer's slots "
                                         r"\['accumulator'\], and these tables have none"):
        module.set_embedding_variables(se.init_tables(plan, jax.random.key(5), with_slots=False))
    with pytest.raises(ValueError, match=r"tables do not match the plan: stacks missing \['items'\]"):
        module.set_embedding_variables({k: v for k, v in trained.items() if k != "items"})
    wrong = {**trained, "items": trained["items"]._replace(table=trained["items"].table[:-1])}
    with pytest.raises(ValueError, match=r"Stack 'items': table has shape"):
        module.set_embedding_variables(wrong)


@pytest.mark.parametrize("devices", [1, 8])
def test_the_documented_step_compiles_once_on_one_device_too(devices):
    """The model's eagerly made dense params and the optimizer's state start where the jitted step returns them,
    replicated on the tables' mesh, a one-device one included (there they stayed unplaced: two compiles)."""
    plan = make_plan(make_mesh(devices))
    model = Tower(plan, nnx.Rngs(0))
    optimizer = sen.Optimizer(model, optax.adam(1e-2))
    traces = []

    @nnx.jit
    def train_step(model, optimizer, batch, step):
        traces.append(step)
        (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch, step)
        optimizer.update(model, grads)
        return loss

    for step in range(2):
        train_step(model, optimizer, make_batch(plan, step), jnp.int32(step))
    assert len(traces) == 1
