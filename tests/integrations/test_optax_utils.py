"""optax_tx / apply_updates: embedding state replaced bit for bit, dense params exactly as plain optax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sparse_embed as se
from train_fixtures import B, assert_trees_equal, features_vector, make_batch, make_plan

LABELS = np.random.default_rng(5).normal(size=B).astype(np.float32)

DENSE_TXS = {
    "adam": lambda: optax.adam(1e-2),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2, weight_decay=0.1)),
}


def _loss(plan):
    def loss(tables, dense, batch, step):
        x = features_vector(se.lookup(plan, batch, tables, step))
        out = jax.nn.relu(x @ dense["hidden"]["w"] + dense["hidden"]["b"][None]) @ dense["out"]
        return jnp.mean((out - LABELS) ** 2)

    return loss


def _dense_params():
    rng = np.random.default_rng(0)
    return {"hidden": {"w": jnp.asarray(rng.normal(size=(40, 8)) * 0.3, jnp.float32), "b": jnp.zeros(8)},
            "out": jnp.asarray(rng.normal(size=(8,)), jnp.float32)}


@pytest.mark.parametrize("dense_tx, items_optimizer",
                         [("adam", "adagrad"), ("sgd_momentum", "sgd"), ("clip_adamw", "rowwise")])
def test_train_step_equals_backward_and_plain_optax(mesh8, dense_tx, items_optimizer):
    plan = make_plan(mesh8, items_optimizer)
    loss = _loss(plan)
    layout = se.LayoutMap(mesh8, plan=plan)
    params = {"embedding": se.init_tables(plan, jax.random.key(0)), "dense": _dense_params()}
    tx, plain = se.optax_tx(DENSE_TXS[dense_tx]()), DENSE_TXS[dense_tx]()
    opt_state, plain_state = tx.init(params), plain.init(params["dense"])
    # Pinned shardings (the recipe for a step that compiles once), inputs committed to them.
    p_sh, o_sh, r_sh = (layout.shardings(x) for x in (params, opt_state, plain_state))
    params, opt_state, plain_state = jax.device_put((params, opt_state, plain_state), (p_sh, o_sh, r_sh))
    # The embedding holds no optimizer state: every state leaf is dense-sized.
    assert max(x.size for x in jax.tree.leaves(opt_state)) == 40 * 8

    @jax.jit(donate_argnums=(0, 1), out_shardings=(p_sh, o_sh))
    def train_step(params, opt_state, batch, step):
        grads = jax.grad(lambda p: loss(p["embedding"], p["dense"], batch, step))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return se.apply_updates(params, updates), opt_state

    @jax.jit(out_shardings=(p_sh["embedding"], p_sh["dense"], r_sh))
    def reference_step(tables, dense, dense_state, batch, step):
        new_tables, g = jax.grad(loss, argnums=(0, 1))(tables, dense, batch, step)
        updates, dense_state = plain.update(g, dense_state, dense)
        return new_tables, optax.apply_updates(dense, updates), dense_state

    ref = (params["embedding"], params["dense"], plain_state)
    ref = jax.device_put(jax.tree.map(jnp.copy, ref), (p_sh["embedding"], p_sh["dense"], r_sh))  # params get donated
    for step in range(3):
        batch = make_batch(plan, step)
        params, opt_state = train_step(params, opt_state, batch, jnp.int32(step))
        ref = reference_step(*ref, batch, jnp.int32(step))
        assert_trees_equal(params["embedding"], ref[0])
        assert_trees_equal(params["dense"], ref[1])
    assert train_step._cache_size() == 1 and reference_step._cache_size() == 1
    assert not np.array_equal(np.asarray(params["dense"]["out"]), np.asarray(_dense_params()["out"]))


def _tiny_embedding():
    """EmbeddingVariables without a plan: the helpers only look at the pytree."""
    return se.EmbeddingVariables(jnp.arange(12.0).reshape(6, 2), {"acc": jnp.ones((6, 2))})


def test_labels_and_exact_replacement():
    params = {"emb": {"s": _tiny_embedding()}, "w": jnp.ones(3)}
    assert se.param_labels(params) == {"emb": {"s": "embedding"}, "w": "dense"}
    tx = se.optax_tx(optax.sgd(0.5))
    state = tx.init(params)
    new_state = se.EmbeddingVariables(jnp.full((6, 2), 7.0), {"acc": jnp.full((6, 2), 3.0)})
    grads = {"emb": {"s": new_state}, "w": jnp.full(3, 2.0)}
    updates, state = tx.update(grads, state, params)
    assert updates["emb"]["s"].state is new_state  # passed through untouched (wrapped: see below)
    new = se.apply_updates(params, updates)
    assert new["emb"]["s"] is new_state  # replaced, no arithmetic on the table
    np.testing.assert_array_equal(np.asarray(new["w"]), np.zeros(3))
    # optax.apply_updates would add the new state to the old one (every row doubled, silently): it fails instead
    with pytest.raises(ValueError, match=r"(?s)\['emb'\]\['s'\].*EmbeddingVariables.*NewState"):
        optax.apply_updates(params, updates)
    # an update tree built by hand from param_labels (optax.identity on the embeddings) is applied as well
    by_hand = optax.multi_transform({"dense": optax.sgd(0.5), "embedding": optax.identity()}, se.param_labels)
    updates, _ = by_hand.update(grads, by_hand.init(params), params)
    assert se.apply_updates(params, updates)["emb"]["s"] is new_state


def test_plain_trees_behave_like_plain_optax():
    params = {"a": jnp.linspace(-1.0, 1.0, 5), "b": jnp.ones((2, 2))}
    grads = jax.tree.map(lambda x: x * 0.3 + 0.1, params)
    ours, plain = se.optax_tx(optax.adam(0.1)), optax.adam(0.1)
    u1, _ = ours.update(grads, ours.init(params), params)
    u2, _ = plain.update(grads, plain.init(params), params)
    assert_trees_equal(se.apply_updates(params, u1), optax.apply_updates(params, u2))
    only_embedding = {"s": _tiny_embedding()}
    u, _ = ours.update(only_embedding, ours.init(only_embedding), only_embedding)
    assert se.apply_updates(only_embedding, u)["s"] is only_embedding["s"]


def test_an_embedding_update_that_is_not_the_new_state_is_rejected():
    params = {"s": _tiny_embedding()}
    with pytest.raises(TypeError, match=r"must be the EmbeddingVariables that jax.grad returned.*optax_tx"):
        se.apply_updates(params, {"s": {"table": jnp.zeros((6, 2))}})


@pytest.mark.parametrize("wrap, match", [
    (lambda tx: optax.MultiSteps(tx, 2), "NewState"),  # its zero updates between steps zeroed the tables
    (lambda tx: optax.apply_if_finite(tx, 3), "NewState"),
    (lambda tx: optax.chain(tx, optax.scale(2.0)), "NewState"),  # scaled the new tables
], ids=["MultiSteps", "apply_if_finite", "chain_then_scale"])
def test_a_transform_around_or_after_optax_tx_fails_instead_of_corrupting_the_tables(wrap, match):
    """optax.MultiSteps(optax_tx(adam)) moved rows no batch had touched (its zeros between steps became the
    tables), silently; a NewState is an opaque leaf, so what would rewrite one fails."""
    params = {"emb": {"s": _tiny_embedding()}, "w": jnp.ones(3)}
    grads = {"emb": {"s": _tiny_embedding()._replace(table=jnp.full((6, 2), 7.0))}, "w": jnp.full(3, 2.0)}
    tx = wrap(se.optax_tx(optax.adam(0.1)))
    with pytest.raises(TypeError, match=match):
        jax.jit(lambda g, st, p: se.apply_updates(p, tx.update(g, st, p)[0]))(grads, tx.init(params), params)
    plain = se.optax_tx(optax.adam(0.1))
    with pytest.raises(TypeError, match="NewState"):  # out of the jit that computed it
        jax.jit(lambda g, st, p: plain.update(g, st, p)[0])(grads, plain.init(params), params)


def test_optax_tx_of_multisteps_swaps_the_tables_each_step_and_accumulates_the_dense_grads():
    params = {"emb": {"s": _tiny_embedding()}, "w": jnp.ones(3)}
    tx = se.optax_tx(optax.MultiSteps(optax.sgd(1.0), 2))
    state = tx.init(params)
    for k in range(2):
        new = _tiny_embedding()._replace(table=jnp.full((6, 2), float(k)))
        updates, state = tx.update({"emb": {"s": new}, "w": jnp.full(3, float(k + 1))}, state, params)
        params = se.apply_updates(params, updates)
        assert params["emb"]["s"] is new
        np.testing.assert_array_equal(np.asarray(params["w"]), np.ones(3) if k == 0 else np.full(3, -0.5))
