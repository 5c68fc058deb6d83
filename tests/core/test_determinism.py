"""Same inputs -> bitwise identical activations and tables, run after run (stacked tables, duplicate ids)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparse_embed as se
from sparse_embed import optimizers as opt
import reference as ref
from train_fixtures import assert_trees_equal

pytestmark = pytest.mark.usefixtures("each_kernel")  # every test on the generic and the native kernel

OPTIMIZERS = {"sgd": opt.SGD(0.1), "adagrad": opt.Adagrad(0.1), "adam": opt.Adam(0.01)}


def _run(mesh, optimizer, max_norm):
    """Plans, initialises and trains 3 steps from scratch (recompiling); returns the activations and state."""
    jax.clear_caches()
    a = se.TableSpec("a", 37, 8, combiner="mean", optimizer=optimizer, max_norm=max_norm)
    b = se.TableSpec("b", 19, 8, combiner="mean", optimizer=optimizer, max_norm=max_norm)
    feats = {"fa": se.FeatureSpec("fa", a, 16), "fb": se.FeatureSpec("fb", b, 16),
             "fa_seq": se.FeatureSpec("fa_seq", a, 16, max_sequence_length=3)}
    plan = se.plan(feats, mesh)
    assert plan.stack_names == ("a_b",)
    rng = np.random.default_rng(0)
    cts = {n: rng.normal(size=f.output_shape).astype(np.float32) for n, f in feats.items()}

    def loss(tables, batch, step):
        acts = se.lookup(plan, batch, tables, step)
        return sum(jnp.sum(acts[k] * cts[k]) for k in cts), acts

    train = jax.jit(jax.grad(loss, has_aux=True), donate_argnums=0)
    tables, outs = se.init_tables(plan, jax.random.key(1)), []
    for step in range(3):
        samples = {n: ref.random_samples(rng, 16, f.table.vocabulary_size, 6, weighted=True, id_pool=4)
                   for n, f in feats.items()}  # many duplicates, within and across features
        ids, w = zip(*(ref.render(s, "list") for s in samples.values()))
        batch, _ = se.preprocess(plan, dict(zip(feats, ids)), dict(zip(feats, w)))
        tables, acts = train(tables, batch, jnp.int32(step))
        outs.append(jax.tree.map(np.asarray, acts))
    return outs, jax.tree.map(np.asarray, se.unstack_state(plan, tables))


@pytest.mark.parametrize("name, max_norm", [("sgd", None), ("adagrad", None), ("adam", 0.5)])
def test_two_runs_are_bitwise_identical(mesh8, name, max_norm):
    first = _run(mesh8, OPTIMIZERS[name], max_norm)
    assert_trees_equal(_run(mesh8, OPTIMIZERS[name], max_norm), first)
