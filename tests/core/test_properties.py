"""Property-based: random specs, stackings, meshes and inputs against the numpy reference.

Each example plans random tables and features, checks the forward and two
training steps (SGD or Adagrad) against tests/reference.py. Derandomized, so
CI always runs the same examples; each costs about a second of compiling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import sparse_embed as se
from sparse_embed import optimizers as opt
import reference as ref
from conftest import make_mesh

pytestmark = pytest.mark.usefixtures("each_kernel")  # every test on the generic and the native kernel

OPTIMIZERS = {"sgd": (lambda: opt.SGD(0.2), ref.sgd), "adagrad": (lambda: opt.Adagrad(0.3), ref.adagrad)}


@st.composite
def cases(draw):
    """(mesh size, optimizer, stacking, {feature: FeatureSpec}, input format, seed, id pool)."""
    n = draw(st.sampled_from([1, 2, 4, 8]))
    optimizer = draw(st.sampled_from(sorted(OPTIMIZERS)))
    tables = [
        se.TableSpec(f"t{i}", draw(st.integers(1, 40)), draw(st.sampled_from([2, 4])),
                     combiner=draw(st.sampled_from(["sum", "mean", "sqrtn"])),
                     max_norm=draw(st.sampled_from([None, 0.5])), optimizer=OPTIMIZERS[optimizer][0]())
        for i in range(draw(st.integers(1, 3)))
    ]
    feats = {}
    for i in range(draw(st.integers(1, 3))):
        t = tables[draw(st.integers(0, len(tables) - 1))]
        feats[f"f{i}"] = se.FeatureSpec(f"f{i}", t, n * draw(st.integers(1, 2)),
                                        max_sequence_length=draw(st.sampled_from([0, 0, 2])))
    return (n, optimizer, draw(st.sampled_from(["auto", None])), feats,
            draw(st.sampled_from(["list", "pair", "dense"])), draw(st.integers(0, 2**16)),
            draw(st.sampled_from([None, 3])))


def _train(plan, cts):
    def loss(tables, batch, step):
        acts = se.lookup(plan, batch, tables, step)
        return sum(jnp.sum(acts[k] * cts[k]) for k in cts), acts

    return jax.jit(jax.grad(loss, has_aux=True))


def _reference_step(feats, samples, cts, state, update, lr, step):
    """Returns the reference activations and applies one step to `state` in place."""
    acts, grads = {}, {t: {} for t in state}
    for name, f in feats.items():
        kw = dict(combiner=f.table.combiner, seq_len=f.max_sequence_length, max_norm=f.table.max_norm)
        W = state[f.table.name]["table"]
        acts[name] = ref.lookup(W, samples[name], **kw)
        for r, g in ref.row_grads(W, samples[name], cts[name], **kw).items():
            grads[f.table.name][r] = grads[f.table.name].get(r, 0.0) + g
    for t, g in grads.items():
        ref.apply(update, state[t], g, lr, step)
    return acts


@settings(max_examples=10, deadline=None, derandomize=True, database=None)
@given(cases())
def test_forward_and_training_match_reference(case):
    n, optimizer, stacking, feats, fmt, seed, pool = case
    plan = se.plan(feats, make_mesh(n), stacking=stacking)
    rng = np.random.default_rng(seed)
    tables = se.init_tables(plan, jax.random.key(seed))
    state = {t: {k: v.astype(np.float64) for k, v in s.items()} for t, s in se.unstack_state(plan, tables).items()}
    cts = {name: rng.normal(size=f.output_shape).astype(np.float32) for name, f in feats.items()}
    train = _train(plan, cts)
    for step in range(2):
        samples = {name: ref.random_samples(rng, f.batch_size, f.table.vocabulary_size, 4, weighted=True, id_pool=pool)
                   for name, f in feats.items()}
        rendered = {name: ref.render(s, fmt) for name, s in samples.items()}
        batch, _ = se.preprocess(plan, {k: v[0] for k, v in rendered.items()}, {k: v[1] for k, v in rendered.items()})
        want = _reference_step(feats, samples, cts, state, OPTIMIZERS[optimizer][1], 0.2 if optimizer == "sgd" else 0.3,
                               step)
        tables, acts = train(tables, batch, jnp.int32(step))
        for name in feats:
            np.testing.assert_allclose(acts[name], want[name], rtol=1e-4, atol=1e-5, err_msg=f"step {step} {name}")
    got = se.unstack_state(plan, tables)
    for t in state:
        for k in state[t]:
            np.testing.assert_allclose(got[t][k], state[t][k], rtol=1e-4, atol=1e-5, err_msg=f"{t}/{k}")
