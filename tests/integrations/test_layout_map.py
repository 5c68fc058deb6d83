"""LayoutMap: path rules -> NamedShardings; embedding state always gets the plan's sharding."""

from __future__ import annotations

import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sparse_embed as se
from tests.conftest import devices as eight_devices
from sparse_embed.flax import linen as sel
from sparse_embed.flax import nnx as sen
from sparse_embed.integrations.layout_map import path_string
from train_fixtures import B, features_vector, make_batch, make_plan

SDS = jax.ShapeDtypeStruct


def _specs(shardings):
    return jax.tree.map(lambda s: s.spec, shardings)


def test_first_matching_rule_wins_and_unmatched_leaves_are_replicated(mesh8):
    tree = {
        "decoder": {"dense": {"kernel": SDS((8, 16), jnp.float32), "bias": SDS((16,), jnp.float32)}},
        "encoder": {"dense_1": {"kernel": SDS((16, 8), jnp.float32)}, "layers": [SDS((4, 8), jnp.float32)]},
        "count": SDS((), jnp.int32),
    }
    layout = se.LayoutMap(mesh8, [
        (r"^decoder/.*kernel$", P("x", None)),
        (r"kernel$", P(None, "x")),  # would also match the decoder kernel: the first rule wins
        (r"layers/0$", P(None, ("x",))),
        (r"bias", None),
    ])
    got = layout.shardings(tree)
    assert all(s.mesh is mesh8 for s in jax.tree.leaves(got))
    assert _specs(got) == {
        "decoder": {"dense": {"kernel": P("x", None), "bias": P()}},
        "encoder": {"dense_1": {"kernel": P(None, "x")}, "layers": [P(None, ("x",))]},
        "count": P(),
    }
    assert layout.spec_for("decoder/dense/kernel") == P("x", None) and layout.spec_for("nothing") is None
    # the same rules as a mapping, in its order (Keras' LayoutMap is keyed so): the same shardings
    as_dict = se.LayoutMap(mesh8, {r"^decoder/.*kernel$": P("x", None), r"kernel$": P(None, "x"),
                                   r"layers/0$": P(None, ("x",)), r"bias": None})
    assert _specs(as_dict.shardings(tree)) == _specs(got)


class _Model(nn.Module):
    plan: se.EmbeddingPlan

    @nn.compact
    def __call__(self, batch, step=None):
        x = features_vector(sel.Embed(self.plan)(batch, step))
        hidden = nn.relu(nn.Dense(16, name="hidden")(x))
        return nn.Dense(1, name="out")(hidden)[:, 0]


class _NnxModel(nnx.Module):
    def __init__(self, plan, rngs):
        self.embed = sen.Embed(plan, rngs=rngs)
        self.hidden = nnx.Linear(40, 16, rngs=rngs)


@pytest.mark.parametrize("kind", ["linen_params", "optax_tx_state", "nnx_state"])
def test_embedding_state_gets_the_plan_sharding_whatever_the_rules(mesh8, kind):
    plan = make_plan(mesh8)
    layout = se.LayoutMap(mesh8, [(r"tables", P(None, "x")), (r"hidden/kernel$", P(None, "x"))], plan=plan)
    if kind == "nnx_state":
        tree = nnx.state(nnx.eval_shape(lambda: _NnxModel(plan, nnx.Rngs(0))))
    else:
        params = jax.eval_shape(_Model(plan).init, jax.random.key(0), make_batch(plan, 0))["params"]
        tree = params if kind == "linen_params" else jax.eval_shape(se.optax_tx(optax.adam(0.1)).init, params)
    got = layout.shardings(tree)
    assert jax.tree.structure(got) == jax.tree.structure(tree)
    specs = {path_string(p): s.spec for p, s in jax.tree_util.tree_leaves_with_path(got)}
    embedding = [spec for path, spec in specs.items() if "tables" in path]
    assert embedding == ([] if kind == "optax_tx_state" else [plan.table_sharding().spec] * 5)  # optax_tx: no table state
    for path, spec in specs.items():
        if "tables" not in path:
            assert spec == (P(None, "x") if path.endswith("hidden/kernel") else P()), path
    assert any(spec == P(None, "x") for spec in specs.values())


@pytest.mark.parametrize("rules, tree, error, match", [
    ([(r"bias", P(None, "x"))], {"layer": {"bias": SDS((16,), jnp.float32)}}, ValueError,
     r"P\(None, 'x'\) has 2 entries but the leaf at 'layer/bias' has rank 1"),
    ([(r"w", P("x"))], {"w": SDS((12, 4), jnp.float32)}, ValueError,
     r"splits dim 0 \(size 12\) of the leaf at 'w' \(shape \(12, 4\)\) into 8 parts"),
    ([(r"w", P("x", "x"))], {"w": SDS((8, 8), jnp.float32)}, ValueError, r"for 'w' uses mesh axes \['x'\] twice"),
    ([(r"w", P("model"))], None, ValueError, r"rule 0 \('w'\): P\('model',\) names mesh axes \['model'\], but the mesh has axes \('x',\)"),
    ([(r"w(", P())], None, ValueError, r"rule 0: 'w\(' is not a valid regex"),
    ([(b"w", P("x"))], {"w": SDS((8, 4), jnp.float32)}, ValueError, r"rule 0: b'w' is a bytes regex; .* write 'w'"),
    ([(r"w", P(P.UNCONSTRAINED, None))], None, ValueError, r"rule 0 \('w'\): .* has P.UNCONSTRAINED, which only"),
    ([(r"w", ("x",))], None, TypeError, r"rule 0 \('w'\): expected a PartitionSpec or None"),
    ([r"w"], None, ValueError, r"rule 0: expected a \(regex, PartitionSpec\) pair"),
    ([], {"emb": se.EmbeddingVariables(SDS((8, 4), jnp.float32), {})}, ValueError,
     r"'emb' is embedding state; pass plan="),
], ids=["rank", "divisibility", "axis_twice", "unknown_axis", "bad_regex", "bytes_regex", "unconstrained", "not_a_spec",
        "not_a_pair", "no_plan"])
def test_bad_rules_give_clear_errors(mesh8, rules, tree, error, match):
    with pytest.raises(error, match=match):
        se.LayoutMap(mesh8, rules).shardings(tree)


@pytest.mark.parametrize("other", ["order", "set"])
def test_a_mesh_of_other_devices_or_another_order_than_the_plans_is_refused(mesh8, other):
    """The same devices in another order (jax.make_mesh reorders them on TPU) passed the set check and failed
    later, in jit, with its 'incompatible devices' error."""
    plan = make_plan(mesh8)
    devices = eight_devices(8)
    mesh = (Mesh(devices.reshape(2, 4).T, ("data", "model")) if other == "order"
            else Mesh(devices[:4].reshape(2, 2), ("data", "model")))
    with pytest.raises(ValueError, match=f"the plan's mesh and `mesh` have a different device {other}"):
        se.LayoutMap(mesh, [], plan=plan)
    se.LayoutMap(Mesh(devices.reshape(2, 4), ("data", "model")), [], plan=plan)  # same devices, same order: fine


def _mesh(kind):
    devices = eight_devices(8)
    if kind == "1d":
        return Mesh(devices, ("x",)), "x", "x"
    return Mesh(devices.reshape(4, 2), ("data", "model")), "data", "model"


@pytest.mark.parametrize("mesh_kind", ["1d", "2d"])
def test_shardings_survive_a_donated_jitted_train_step(mesh_kind):
    mesh, table_axis, model_axis = _mesh(mesh_kind)
    plan = make_plan(mesh, axis_name=table_axis)
    model = _Model(plan)
    layout = se.LayoutMap(mesh, [(r"hidden/kernel$", P(None, model_axis)), (r"out/kernel$", P(model_axis, None)),
                                 (r"hidden/bias$", P(model_axis))], plan=plan)
    batch = make_batch(plan, 0)
    abstract = jax.eval_shape(model.init, jax.random.key(0), batch)
    p_sh = layout.shardings(abstract)["params"]
    params = jax.jit(lambda k, b: model.init(k, b)["params"], out_shardings=p_sh)(jax.random.key(0), batch)
    tx = se.optax_tx(optax.adam(1e-2))
    o_sh = layout.shardings(jax.eval_shape(tx.init, params))
    opt_state = jax.jit(tx.init, out_shardings=o_sh)(params)
    b_sh = jax.tree.map(lambda _: plan.batch_sharding(), batch)
    replicated = NamedSharding(mesh, P())

    def train_step(params, opt_state, batch, labels, step):
        def loss_fn(p):
            return jnp.mean((model.apply({"params": p}, batch, step) - labels) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return se.apply_updates(params, updates), opt_state, loss

    step_fn = jax.jit(train_step, in_shardings=(p_sh, o_sh, b_sh, replicated, replicated),
                      out_shardings=(p_sh, o_sh, replicated), donate_argnums=(0, 1))
    labels = jax.device_put(np.linspace(-1, 1, B, dtype=np.float32), replicated)
    for step in range(2):
        old = params
        params, opt_state, loss = step_fn(params, opt_state, make_batch(plan, step), labels, jnp.int32(step))
        assert all(x.is_deleted() for x in jax.tree.leaves(old))
    assert np.isfinite(float(loss)) and step_fn._cache_size() == 1
    for got, want in zip(jax.tree.leaves((params, opt_state)), jax.tree.leaves((p_sh, o_sh))):
        assert got.sharding.is_equivalent_to(want, got.ndim), (got.sharding, want)
    assert params["hidden"]["kernel"].sharding.spec == P(None, model_axis)
    assert params["Embed_0"]["tables"]["items"].table.sharding.spec == P(table_axis)
    assert opt_state.inner_states["dense"].inner_state[0].mu["out"]["kernel"].sharding.spec == P(model_axis, None)
