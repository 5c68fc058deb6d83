"""lookup forward and backward (training) against the dense numpy reference."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparse_embed as se
from sparse_embed import optimizers as opt
from sparse_embed.core.relayout import from_shard_major
from cases import Failures, merged_plan, renamed
import reference as ref

pytestmark = pytest.mark.usefixtures("each_kernel")  # every test on the generic and the native kernel

B = 16  # global batch: divides 1, 2 and 8 devices


def _run_forward(plan, tables, ids, weights=None):
    batch, stats = se.preprocess(plan, ids, weights)
    acts = jax.jit(lambda b, t: se.lookup(plan, b, t))(batch, tables)
    return {k: np.asarray(v) for k, v in acts.items()}, stats


def _check_forward(plan, tables, cases, samples, ids, weights):
    """One lookup of `plan`; each case's features (`cases`: case -> {feature: spec}) against the reference, every
    failing case named."""
    acts, _ = _run_forward(plan, tables, ids, weights)
    W = se.unstack_tables(plan, tables)
    failures = Failures()
    for case, feats in cases.items():
        with failures.case(case):
            for name, f in feats.items():
                want = ref.lookup(W[f.table.name], samples[name], combiner=f.table.combiner,
                                  seq_len=f.max_sequence_length, max_norm=f.table.max_norm)
                assert acts[name].shape == f.output_shape
                np.testing.assert_allclose(acts[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
    failures.check()


@pytest.mark.parametrize("fmt", ["dense", "list", "pair", "1d"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_forward_every_combiner_and_format(mesh, fmt, weighted):
    rng = np.random.default_rng(0)
    max_len = 1 if fmt == "1d" else 5
    feats, samples, ids, weights = {}, {}, {}, {}
    for combiner in ("sum", "mean", "sqrtn"):
        t = se.TableSpec(f"t_{combiner}", 50 + len(combiner), 8, combiner=combiner)
        name = f"f_{combiner}"
        feats[name] = se.FeatureSpec(name, t, B)
        samples[name] = ref.random_samples(rng, B, t.vocabulary_size, max_len, weighted=weighted)
        samples[name][3] = []  # an empty row -> zero activation
        ids[name], weights[name] = ref.render(samples[name], fmt)
    plan = se.plan(feats, mesh)
    tables = se.init_tables(plan, jax.random.key(1))
    _check_forward(plan, tables, {fmt: feats}, samples, ids, weights if weighted else None)


def _mixed_features():
    """Two tables shared by several features, a sequence feature, max_norm, two dims."""
    a = se.TableSpec("a", 97, 8, combiner="sum")
    b = se.TableSpec("b", 40, 8, combiner="sum")
    c = se.TableSpec("c", 33, 4, combiner="mean", max_norm=0.3)
    return {
        "a1": se.FeatureSpec("a1", a, B),
        "a2": se.FeatureSpec("a2", a, 2 * B),
        "b_seq": se.FeatureSpec("b_seq", b, B, max_sequence_length=3),
        "b1": se.FeatureSpec("b1", b, B),
        "c1": se.FeatureSpec("c1", c, B),
    }


STACKINGS = {"auto": "auto", "none": None, "explicit_ab": [["a", "b"]], "explicit_single": [["b"], ["a"]]}


def test_forward_stacking_shared_tables_sequence_max_norm(mesh):
    """Each stacking (a case each, in one plan: the stacks each makes alone)."""
    cases, samples, ids, weights = {}, {}, {}, {}
    for case, stacking in STACKINGS.items():
        rng = np.random.default_rng(1)
        feats = _mixed_features()
        for n, f in feats.items():
            s = samples[f"{case}_{n}"] = ref.random_samples(rng, f.batch_size, f.table.vocabulary_size, 6,
                                                            weighted=True)
            ids[f"{case}_{n}"], weights[f"{case}_{n}"] = ref.render(s, "list")
        cases[case] = (feats, stacking)
    plan = merged_plan(cases, mesh)
    tables = se.init_tables(plan, jax.random.key(2))
    _check_forward(plan, tables, {case: renamed(case, feats) for case, (feats, _) in cases.items()}, samples, ids,
                   weights)


def test_auto_stacking_groups_compatible_tables(mesh8):
    plan = se.plan(_mixed_features(), mesh8)
    assert plan.stack_names == ("a_b", "c")
    assert se.plan(_mixed_features(), mesh8, stacking=None).stack_names == ("a", "b", "c")


def test_sequence_dense_input_keeps_column_positions(mesh8):
    t = se.TableSpec("t", 30, 4, combiner="sum")
    f = se.FeatureSpec("s", t, 8, max_sequence_length=3)
    plan = se.plan({"s": f}, mesh8)
    tables = se.init_tables(plan, jax.random.key(0))
    ids = np.full((8, 5), -1)
    ids[0] = [1, -1, 2, 7, 9]  # position 1 empty, positions >= 3 truncated
    acts, _ = _run_forward(plan, tables, {"s": ids})
    W = se.unstack_tables(plan, tables)["t"]
    np.testing.assert_allclose(acts["s"][0], np.stack([W[1], np.zeros(4), W[2]]), rtol=1e-6)
    np.testing.assert_array_equal(acts["s"][1:], 0)


def test_zero_weight_sum_gives_zero_activation(mesh8):
    t = se.TableSpec("t", 30, 4, combiner="mean")
    plan = se.plan({"f": se.FeatureSpec("f", t, 8)}, mesh8)
    tables = se.init_tables(plan, jax.random.key(0))
    ids = [np.array([1, 2])] * 8
    w = [np.array([1.0, -1.0])] * 8
    acts, _ = _run_forward(plan, tables, {"f": ids}, {"f": w})
    np.testing.assert_array_equal(acts["f"], 0)


# ---------------------------------------------------------------- training
def _loss_and_train(plan, cts):
    def loss(tables, batch, step):
        acts = se.lookup(plan, batch, tables, step)
        return sum(jnp.sum(acts[k] * cts[k]) for k in cts)

    return jax.jit(jax.grad(loss), donate_argnums=0)


OPTIMIZERS = {
    "sgd": (lambda: opt.SGD(0.05), ref.sgd),
    "adagrad": (lambda: opt.Adagrad(0.1, initial_accumulator_value=0.5), ref.adagrad),
}


def _training_case(o, rng):
    a = se.TableSpec("a", 61, 8, combiner="sum", optimizer=o)
    b = se.TableSpec("b", 26, 8, combiner="sum", optimizer=o)
    c = se.TableSpec("c", 19, 4, combiner="sqrtn", optimizer=o, max_norm=0.4)
    feats = {
        "a1": se.FeatureSpec("a1", a, B),
        "a2": se.FeatureSpec("a2", a, B),
        "b_seq": se.FeatureSpec("b_seq", b, B, max_sequence_length=2),
        "c1": se.FeatureSpec("c1", c, B),
    }
    return feats, {n: rng.normal(size=f.output_shape).astype(np.float32) for n, f in feats.items()}


def _reference_step(state, update, lr, feats, samples, cts, step):
    """One step of the reference on a case's tables `state` (`{table: {array: float64}}`), in place."""
    for tname in state:
        W, grads = state[tname]["table"], {}
        for n, f in feats.items():
            if f.table.name == tname:
                for r, g in ref.row_grads(W, samples[n], cts[n], combiner=f.table.combiner,
                                          seq_len=f.max_sequence_length, max_norm=f.table.max_norm).items():
                    grads[r] = grads.get(r, 0.0) + g
        ref.apply(update, state[tname], grads, lr, step)


def test_multi_step_training_matches_reference(mesh, name=None, stacking="auto", kernel="auto"):
    """Every optimizer with stacking "auto" and None (a case each, in one plan), four steps; test_kernels passes
    `name` (then that case alone, stacked by `stacking`) and its own `kernel`."""
    chosen = [(n, s) for n in OPTIMIZERS for s in ("auto", None)] if name is None else [(name, stacking)]
    cases, feats, rules, rngs, cts = {}, {}, {}, {}, {}
    for n, s in chosen:
        case, o = f"{n}_{s}", OPTIMIZERS[n][0]()
        rules[case], rngs[case] = (OPTIMIZERS[n][1], o.learning_rate), np.random.default_rng(3)
        case_feats, case_cts = _training_case(o, rngs[case])
        cases[case], feats[case] = (case_feats, s), renamed(case, case_feats)
        cts |= {f"{case}_{f}": ct for f, ct in case_cts.items()}
    plan = merged_plan(cases, mesh, kernel=kernel)
    tables = se.init_tables(plan, jax.random.key(4))
    state = {n: {k: v.astype(np.float64) for k, v in s.items()} for n, s in se.unstack_state(plan, tables).items()}
    train = _loss_and_train(plan, cts)
    for step in range(4):
        # step 2 is full of duplicates (ids from a pool of 3), also across features sharing a table
        pool = 3 if step == 2 else None
        samples, ids, w = {}, {}, {}
        for case, case_feats in feats.items():
            for n, f in case_feats.items():
                samples[n] = ref.random_samples(rngs[case], f.batch_size, f.table.vocabulary_size, 5, weighted=True,
                                                id_pool=pool)
                ids[n], w[n] = ref.render(samples[n], "list")
            mine = {t: state[t] for t in {f.table.name for f in case_feats.values()}}
            _reference_step(mine, *rules[case], case_feats, samples, cts, step)
        batch, _ = se.preprocess(plan, ids, w)
        tables = train(tables, batch, jnp.int32(step))
    got, failures = se.unstack_state(plan, tables), Failures()
    for case in cases:
        with failures.case(case):
            for tname in ("a", "b", "c"):
                for k, want in state[f"{case}_{tname}"].items():
                    np.testing.assert_allclose(got[f"{case}_{tname}"][k], want, rtol=1e-4, atol=1e-5,
                                               err_msg=f"{case}: {tname}/{k}")
    failures.check()


def test_schedule_learning_rate_uses_step(mesh8):
    sched = lambda step: 0.1 * (step + 1)
    t = se.TableSpec("t", 16, 4, combiner="sum", optimizer=opt.SGD(sched))
    plan = se.plan({"f": se.FeatureSpec("f", t, 8)}, mesh8)
    tables = se.init_tables(plan, jax.random.key(0))
    W0 = se.unstack_tables(plan, tables)["t"].copy()
    ids = np.arange(8)
    batch, _ = se.preprocess(plan, {"f": ids})
    train = _loss_and_train(plan, {"f": np.ones((8, 4), np.float32)})
    tables = train(tables, batch, jnp.int32(4))
    W1 = se.unstack_tables(plan, tables)["t"]
    np.testing.assert_allclose(W1[:8], W0[:8] - 0.5, rtol=1e-6)
    np.testing.assert_array_equal(W1[8:], W0[8:])  # untouched rows stay bit-identical
    with pytest.raises(ValueError, match="schedule"):
        jax.grad(lambda t: se.lookup(plan, batch, t)["f"].sum())(tables)


def test_a_second_differentiated_lookup_of_the_same_tables_is_refused(mesh8):
    """The gradient is the updated state: a second lookup under jax.grad would double every row. It raises (eager
    and under jit, naming the stack); a forward-only second lookup and a stop_gradient one are allowed, and the
    stop_gradient one leaves the update exactly that of one lookup (SGD 0.5 against numpy)."""
    t = se.TableSpec("t", 16, 4, combiner="sum", optimizer=opt.SGD(0.5))
    plan = se.plan({"f": se.FeatureSpec("f", t, 8)}, mesh8)
    tables = se.init_tables(plan, jax.random.key(0))
    W0 = se.unstack_tables(plan, tables)["t"].copy()
    batch, _ = se.preprocess(plan, {"f": np.arange(8)})
    twice = lambda t: se.lookup(plan, batch, t)["f"].sum() + se.lookup(plan, batch, t)["f"].sum()
    for grad in (jax.grad(twice), jax.jit(jax.grad(twice))):
        with pytest.raises(ValueError, match="'t'.*second time.*double every row"):
            grad(tables)
    a, b = jax.jit(lambda t: (se.lookup(plan, batch, t)["f"], se.lookup(plan, batch, t)["f"]))(tables)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, W0[:8], rtol=1e-6)
    frozen = lambda t: se.lookup(plan, batch, t)["f"].sum() + se.lookup(plan, batch, jax.lax.stop_gradient(t))[
        "f"].sum()
    W1 = se.unstack_tables(plan, jax.jit(jax.grad(frozen))(tables))["t"]
    np.testing.assert_allclose(W1[:8], W0[:8] - 0.5, rtol=1e-6)
    np.testing.assert_array_equal(W1[8:], W0[8:])
    W2 = se.unstack_tables(plan, jax.grad(lambda t: se.lookup(plan, batch, t)["f"].sum())(tables))["t"]
    np.testing.assert_allclose(W2[:8], W0[:8] - 0.5, rtol=1e-6)  # a new trace looks the same tables up again


def test_untouched_rows_and_padding_rows_never_change(mesh8):
    t = se.TableSpec("t", 21, 4, combiner="mean", optimizer=opt.Adagrad(0.5))  # padded to 24 rows
    plan = se.plan({"f": se.FeatureSpec("f", t, 8)}, mesh8, capacity=16)
    tables = se.init_tables(plan, jax.random.key(0))
    before = np.asarray(tables["t"].table).copy()
    batch, _ = se.preprocess(plan, {"f": np.full((8, 2), 20)})  # only the last real row
    tables = _loss_and_train(plan, {"f": np.ones((8, 4), np.float32)})(tables, batch, 0)
    after = np.asarray(tables["t"].table)
    stack = plan.stack("t")
    rows = from_shard_major(stack, after) != from_shard_major(stack, before)
    assert set(np.nonzero(rows.any(1))[0]) == {20}


def test_no_recompile_across_batches(mesh8):
    t = se.TableSpec("t", 100, 4, combiner="sum", optimizer=opt.Adagrad(0.1))
    plan = se.plan({"f": se.FeatureSpec("f", t, 16)}, mesh8)
    train = _loss_and_train(plan, {"f": np.ones((16, 4), np.float32)})
    tables = se.init_tables(plan, jax.random.key(0))
    rng = np.random.default_rng(0)
    first, _ = se.preprocess(plan, {"f": rng.integers(-1, 100, (16, 6))})
    tables = train(tables, first, 0)
    for step in range(1, 4):  # fewer ids than the first batch: capacity does not shrink
        batch, stats = se.preprocess(plan, {"f": rng.integers(-1, 100, (16, 3))})
        chex.assert_trees_all_equal_shapes(batch, first)
        tables = train(tables, batch, step)
    assert train._cache_size() == 1


def test_donated_tables_are_consumed(mesh8):
    t = se.TableSpec("t", 100, 4, combiner="sum")
    plan = se.plan({"f": se.FeatureSpec("f", t, 8)}, mesh8)
    tables = se.init_tables(plan, jax.random.key(0))
    batch, _ = se.preprocess(plan, {"f": np.arange(8)})
    old = tables["t"].table
    new = _loss_and_train(plan, {"f": np.ones((8, 4), np.float32)})(tables, batch, 0)
    assert old.is_deleted()
    assert new["t"].table.sharding == plan.table_sharding()


def test_bf16_table_trains_like_the_reference(mesh8):
    """A bf16 table per optimizer (a case each, in one plan), one step on many duplicates."""
    cases, opts = {}, {}
    for name, (make_opt, _) in OPTIMIZERS.items():
        opts[name] = make_opt()
        t = se.TableSpec("t", 40, 8, combiner="sum", optimizer=opts[name], dtype=jnp.bfloat16)
        cases[name] = ({"f": se.FeatureSpec("f", t, B)}, "auto")
    plan = merged_plan(cases, mesh8)
    tables = se.init_tables(plan, jax.random.key(1))
    ids, cts, want = {}, {}, {}
    for name, (_, update) in OPTIMIZERS.items():
        assert tables[f"{name}_t"].table.dtype == jnp.bfloat16
        state = {k: np.asarray(v, np.float64) for k, v in se.unstack_state(plan, tables)[f"{name}_t"].items()}
        rng = np.random.default_rng(5)
        samples = ref.random_samples(rng, B, 40, 4, weighted=False, id_pool=6)  # many duplicates
        ids[f"{name}_f"] = ref.render(samples, "list")[0]
        cts[f"{name}_f"] = rng.normal(size=(B, 8)).astype(np.float32)
        grads = ref.row_grads(state["table"], samples, cts[f"{name}_f"], combiner="sum")
        ref.apply(update, state, grads, opts[name].learning_rate, 0)
        want[name] = state
    batch, _ = se.preprocess(plan, ids)
    got, failures = se.unstack_state(plan, _loss_and_train(plan, cts)(tables, batch, jnp.int32(0))), Failures()
    for name, state in want.items():
        with failures.case(name):
            # bf16 keeps 8 bits of mantissa: the stored rows are the reference rounded to bf16.
            np.testing.assert_allclose(np.asarray(got[f"{name}_t"]["table"], np.float64), state["table"], rtol=1e-2,
                                       atol=1e-2)
    failures.check()
