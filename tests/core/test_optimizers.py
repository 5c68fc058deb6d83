"""Every embedded optimizer and option, trained through lookup on 8 devices, against numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sparse_embed as se
from sparse_embed import optimizers as opt
import reference as ref
from cases import assert_states_close
from conftest import make_mesh

pytestmark = pytest.mark.usefixtures("each_kernel")  # every test on the generic and the native kernel

B = 16
SCHEDULES = {
    "linear": optax.linear_schedule(0.2, 0.02, 4),
    "warmup_cosine": optax.warmup_cosine_decay_schedule(0.0, 0.3, 2, 6, 0.01),
}


def _momentum_sign_sgd(rows, slots, grads, step):
    m = 0.5 * slots["m"] + grads
    return rows - 0.1 * jnp.sign(m), {"m": m}


def _ref_momentum_sign_sgd(w, slots, g, lr, step):
    m = 0.5 * slots["m"] + g
    return w - 0.1 * np.sign(m), {"m": m}


# name -> (spec, numpy update)
CASES = {
    "sgd": (opt.SGD(0.1), ref.sgd),
    "adagrad": (opt.Adagrad(0.2, initial_accumulator_value=0.3), ref.adagrad),
    "rowwise_adagrad": (opt.RowwiseAdagrad(0.2, epsilon=1e-3), ref.rowwise_adagrad(1e-3)),
    "adam": (opt.Adam(0.05, b1=0.8, b2=0.9, eps=1e-3), ref.adam(0.8, 0.9, 1e-3)),
    "adagrad_momentum": (opt.AdagradMomentum(0.1, momentum=0.8), ref.adagrad_momentum(0.8, 1.0, 1e-10, 2.0, False)),
    "adagrad_momentum_nesterov_beta2": (
        opt.AdagradMomentum(0.1, momentum=0.7, beta2=0.9, epsilon=1e-3, exponent=3.0, use_nesterov=True),
        ref.adagrad_momentum(0.7, 0.9, 1e-3, 3.0, True)),
    "ftrl": (opt.FTRL(0.5), ref.ftrl(-0.5, 0.0, 0.0, 0.0, False)),
    "ftrl_l1_l2_beta": (opt.FTRL(0.5, learning_rate_power=-0.7, l1=0.02, l2=0.1, beta=0.3),
                        ref.ftrl(-0.7, 0.02, 0.1, 0.3, False)),
    "ftrl_multiply_linear": (opt.FTRL(0.5, l1=0.02, l2=0.1, beta=0.3, multiply_linear_by_learning_rate=True),
                             ref.ftrl(-0.5, 0.02, 0.1, 0.3, True)),
    "laprop": (opt.LaProp(0.05, b1=0.8, b2=0.9, eps=1e-6), ref.laprop(0.8, 0.9, 1e-6)),
    "sgd_all_options": (opt.SGD(0.1, clip_gradient=(-0.05, 0.05), clip_weight=(-0.3, 0.3), weight_decay=0.5),
                        ref.with_options(ref.sgd, (-0.05, 0.05), (-0.3, 0.3), 0.5)),
    "adam_all_options": (opt.Adam(0.05, clip_gradient=(-0.1, 0.2), clip_weight=(-0.2, 0.25), weight_decay=0.1),
                         ref.with_options(ref.adam(0.9, 0.999, 1e-8), (-0.1, 0.2), (-0.2, 0.25), 0.1)),
    "ftrl_decay": (opt.FTRL(0.5, l1=0.01, weight_decay=0.2), ref.with_options(ref.ftrl(-0.5, 0.01, 0, 0, False), None, None, 0.2)),
    "adagrad_linear_schedule": (opt.Adagrad(SCHEDULES["linear"]), ref.adagrad),
    "sgd_warmup_cosine": (opt.SGD(SCHEDULES["warmup_cosine"]), ref.sgd),
    "custom": (opt.Custom(_momentum_sign_sgd, {"m": opt.SlotSpec(4, 0.0)}), _ref_momentum_sign_sgd),
}


def _lr_at(o, step):
    return float(o.learning_rate(step)) if callable(o.learning_rate) else o.learning_rate


def _samples(rng, f, step):
    vocab = f.table.vocabulary_size
    if step == 1:  # only a few low ids: most rows untouched this step (lazy updates)
        return ref.random_samples(rng, f.batch_size, vocab, 3, weighted=True, id_pool=4)
    if step == 2:  # full of duplicates
        return ref.random_samples(rng, f.batch_size, vocab, 6, weighted=True, min_len=4, id_pool=2)
    return ref.random_samples(rng, f.batch_size, vocab, 4, weighted=True)


def _excluded(case: str, placement: str, kernel: str) -> str | None:
    """Why `case` does not run under (placement, kernel), or None: the two combinations the native kernel leaves
    to the generic one. Each is still checked on the generic kernel; forcing native on it is an error that
    another test checks."""
    o = CASES[case][0]
    if kernel == "native" and isinstance(o, opt.Custom):
        return "Custom optimizers run on the generic kernel (test_kernels checks that forcing native says so)"
    if kernel == "native" and placement == "column" and not o.elementwise:
        return ("a row-wise optimizer on rows split by columns runs on the generic kernel (test_placement checks "
                "that forcing native says so)")
    return None


def _features(cases: list[str]) -> dict[str, se.FeatureSpec]:
    """Per case, two tables with its optimizer: `<case>_a` (sum, read by two features) and `<case>_b` (mean)."""
    feats = {}
    for c in cases:
        o = CASES[c][0]
        a = se.TableSpec(f"{c}_a", 40, 4, combiner="sum", optimizer=o)
        b = se.TableSpec(f"{c}_b", 19, 4, combiner="mean", optimizer=o)
        feats |= {f"{c}_a1": se.FeatureSpec(f"{c}_a1", a, B), f"{c}_a2": se.FeatureSpec(f"{c}_a2", a, B),
                  f"{c}_b1": se.FeatureSpec(f"{c}_b1", b, B)}
    return feats


def _case_of(table: str) -> str:
    return table.rsplit("_", 1)[0]


def _reference_step(state, feats, samples, cts, step) -> None:
    """One step of every table in numpy (float64), in place: its rows' gradients summed over its features."""
    for tname, table_state in state.items():
        grads: dict[int, np.ndarray] = {}
        for n, f in feats.items():
            if f.table.name == tname:
                for r, g in ref.row_grads(table_state["table"], samples[n], cts[n], combiner=f.table.combiner).items():
                    grads[r] = grads.get(r, 0.0) + g
        o, update = CASES[_case_of(tname)]
        ref.apply(update, table_state, grads, _lr_at(o, step), step)


@pytest.mark.parametrize("placement", ["row", "table", "replicated", "column"])
def test_training_matches_numpy(mesh8, placement, each_kernel):
    """Every optimizer case of CASES at once, 5 steps on 8 devices: one plan in which each case's two tables are
    stacks of their own (auto stacking never mixes optimizers or combiners), so that one compiled train step
    serves them all; every table's rows and slots against numpy, all differences reported together, each
    naming its case and table. Cases `_excluded` names run on the generic kernel only."""
    cases = [c for c in CASES if not _excluded(c, placement, each_kernel)]
    feats = _features(cases)
    # capacity: every step's batch fits (per device and shard, 2 samples of at most 6 ids from 2 features), so one
    # compiled step serves the 5 steps (auto capacity would grow on step 2's longer samples and recompile)
    plan = se.plan(feats, mesh8, placement=placement, capacity=24)
    assert len(plan.stacks) == 2 * len(cases), plan.stack_names  # each table a stack of its own, as alone
    rng = np.random.default_rng(1)
    # the default initializer's rows, stacked on the host: no program to compile but the train step
    tables = se.stack_tables(plan, {n: ref.initial_rows(rng, t.vocabulary_size, t.embedding_dim)
                                    for n, t in plan.tables.items()})
    state = {n: {k: v.astype(np.float64) for k, v in s.items()} for n, s in se.unstack_state(plan, tables).items()}
    cts = {n: rng.normal(size=f.output_shape).astype(np.float32) for n, f in feats.items()}

    def loss(tables, batch, step):
        acts = se.lookup(plan, batch, tables, step)
        return sum(jnp.sum(acts[k] * cts[k]) for k in cts)

    train = jax.jit(jax.grad(loss), donate_argnums=0)
    for step in range(5):
        samples = {n: _samples(rng, f, step) for n, f in feats.items()}
        ids, w = zip(*(ref.render(samples[n], "list") for n in feats))
        batch, _ = se.preprocess(plan, dict(zip(feats, ids)), dict(zip(feats, w)))
        _reference_step(state, feats, samples, cts, step)
        tables = train(tables, batch, jnp.int32(step))
    # rtol 1e-5, plus an atol of 1e-5 of the array's scale for f32 cancellation near zero
    assert_states_close(se.unstack_state(plan, tables), state, rtol=1e-5, atol=1e-5, atol_relative=True,
                        name=lambda t: f"optimizer case {_case_of(t)!r}, table {t!r}")


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_sgd_and_adagrad_equal_optax_on_touched_rows(mesh8, name):
    o, tx = {"sgd": (opt.SGD(0.3), optax.sgd(0.3)),
             "adagrad": (opt.Adagrad(0.3, initial_accumulator_value=0.2), optax.adagrad(0.3, 0.2, eps=0.0))}[name]
    t = se.TableSpec("t", 24, 4, combiner="sum", optimizer=o)
    plan = se.plan({"f": se.FeatureSpec("f", t, 8)}, mesh8)
    tables = se.init_tables(plan, jax.random.key(3))
    W = jnp.asarray(se.unstack_tables(plan, tables)["t"])
    ids = np.array([[1, 1, 5], [5, 7, -1]] * 4)
    touched = np.array([1, 5, 7])
    ct = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
    batch, _ = se.preprocess(plan, {"f": ids})
    state = tx.init(W[touched])
    train = jax.jit(jax.grad(lambda tb, step: jnp.sum(se.lookup(plan, batch, tb, step)["f"] * ct)))
    for step in range(3):
        dense_grad = jax.grad(lambda w: jnp.sum(jnp.stack([w[r[r >= 0]].sum(0) for r in ids]) * ct))(W)
        upd, state = tx.update(dense_grad[touched], state, W[touched])
        W = W.at[touched].set(optax.apply_updates(W[touched], upd))
        tables = train(tables, jnp.int32(step))
    np.testing.assert_allclose(se.unstack_tables(plan, tables)["t"], np.asarray(W), rtol=1e-5, atol=1e-6)


def test_step_is_required_for_bias_correction(mesh8):
    t = se.TableSpec("t", 16, 4, optimizer=opt.Adam(0.1))
    plan = se.plan({"f": se.FeatureSpec("f", t, 8)}, mesh8)
    tables = se.init_tables(plan, jax.random.key(0))
    batch, _ = se.preprocess(plan, {"f": np.arange(8)})
    with pytest.raises(ValueError, match="Adam needs the global step"):
        jax.grad(lambda tb: se.lookup(plan, batch, tb)["f"].sum())(tables)


def test_slot_free_tables_look_up_but_do_not_train(mesh8):
    t = se.TableSpec("t", 16, 4, optimizer=opt.Adagrad(0.1))
    plan = se.plan({"f": se.FeatureSpec("f", t, 8)}, mesh8)
    full = se.init_tables(plan, jax.random.key(0))
    lean = se.init_tables(plan, jax.random.key(0), with_slots=False)
    assert lean["t"].slots == {}
    batch, _ = se.preprocess(plan, {"f": np.arange(8)})
    np.testing.assert_array_equal(np.asarray(se.lookup(plan, batch, lean)["f"]),
                                  np.asarray(se.lookup(plan, batch, full)["f"]))
    with pytest.raises(ValueError, match=r"Stack 't' cannot be trained: its Adagrad optimizer needs slots \['accumulator'\]"):
        jax.grad(lambda tb: se.lookup(plan, batch, tb, 0)["f"].sum())(lean)
    lean2 = se.stack_tables(plan, se.unstack_tables(plan, full), with_slots=False)
    assert lean2["t"].slots == {}
    # SGD has no slots: slot-free tables train
    sgd_plan = se.plan({"f": se.FeatureSpec("f", se.TableSpec("t", 16, 4, optimizer=opt.SGD(0.1)), 8)}, mesh8)
    new = jax.grad(lambda tb: se.lookup(sgd_plan, batch, tb, 0)["f"].sum())(se.init_tables(sgd_plan, jax.random.key(0), with_slots=False))
    assert new["t"].slots == {}


def test_mismatched_slots_are_rejected(mesh8):
    t = se.TableSpec("t", 16, 4, optimizer=opt.Adam(0.1))
    plan = se.plan({"f": se.FeatureSpec("f", t, 8)}, mesh8)
    tables = se.init_tables(plan, jax.random.key(0))
    bad = {"t": se.EmbeddingVariables(tables["t"].table, {"momentum": tables["t"].slots["momentum"]})}
    batch, _ = se.preprocess(plan, {"f": np.arange(8)})
    with pytest.raises(ValueError, match=r"Stack 't': slots \['momentum'\] do not match its Adam optimizer's"):
        se.lookup(plan, batch, bad)
    # slots of another dtype (a tree cast to bf16 but for its tables): the native kernel failed at run time naming
    # nothing, the generic one trained them in bf16
    for dtype in (jnp.bfloat16, jnp.float16):
        cast = {"t": tables["t"]._replace(slots={**tables["t"].slots, "velocity": np.zeros((plan.stacks[0].array_rows,
                                                                                             4), dtype)})}
        with pytest.raises(ValueError, match=rf"^Stack 't': slot 'velocity' has dtype {jnp.dtype(dtype)}, optimizer "
                                             r"slots are float32; build the tables with the plan"):
            jax.grad(lambda tb: se.lookup(plan, batch, tb, 0)["f"].sum())(cast)


def test_auto_stacking_never_mixes_optimizers(mesh8):
    feats = {n: se.FeatureSpec(n, se.TableSpec(n, 10, 4, optimizer=o), 8) for n, o in
             [("a", opt.Adam(0.1)), ("b", opt.Adam(0.1)), ("c", opt.Adam(0.1, b1=0.5)), ("d", opt.FTRL(0.1)),
              ("e", opt.RowwiseAdagrad(0.1))]}
    assert set(se.plan(feats, mesh8).stack_names) == {"a_b", "c", "d", "e"}
    with pytest.raises(ValueError, match=r"Tables 'a' and 'c' cannot be stacked: optimizer: Adam\(.*b1=0.9.*vs Adam\(.*b1=0.5"):
        se.plan(feats, mesh8, stacking=[["a", "c"]])


def test_ftrl_at_a_learning_rate_of_0_leaves_rows_and_slots_as_they_are(each_kernel):
    """A schedule's warmup from 0: FTRL's linear slot is in units of 1/lr, and every touched row became NaN at
    lr 0 (both kernels). Now a step at 0 changes nothing, the next (lr > 0) trains as from the same state, and the
    multiply-by-lr form trains at 0 as its math says (finite)."""
    for mult in (False, True):
        t = se.TableSpec("t", 16, 4, optimizer=opt.FTRL(optax.linear_schedule(0.0, 0.1, 2), l2=0.01,
                                                          multiply_linear_by_learning_rate=mult))
        plan = se.plan({"f": se.FeatureSpec("f", t, 4)}, make_mesh(2))
        tables = se.init_tables(plan, jax.random.key(0))
        before = se.unstack_state(plan, tables)["t"]
        batch, _ = se.preprocess(plan, {"f": np.array([[1, 2], [3, -1], [1, 5], [7, 7]])})
        train = jax.jit(jax.grad(lambda tb, s: jnp.sum(jnp.sin(se.lookup(plan, batch, tb, s)["f"]))))
        first = se.unstack_state(plan, train(tables, jnp.int32(0)))["t"]
        second = se.unstack_state(plan, train(train(tables, jnp.int32(0)), jnp.int32(1)))["t"]
        for k in first:
            assert np.all(np.isfinite(first[k])) and np.all(np.isfinite(second[k])), (mult, k)
            if not mult:
                np.testing.assert_array_equal(first[k], before[k], err_msg=k)
        touched = [1, 2, 3, 5, 7]
        if mult:  # docs/optimizers.md's exception: at 0 the multiply-by-lr form still moves touched rows (TF's math)
            untouched = [r for r in range(16) if r not in touched]
            assert not np.allclose(first["table"][touched], before["table"][touched])
            np.testing.assert_array_equal(first["table"][untouched], before["table"][untouched])
            assert np.all(first["accumulator"][touched] > before["accumulator"][touched])
        assert not np.allclose(second["table"][touched], before["table"][touched])


def test_a_custom_optimizer_whose_slots_do_not_fit_its_fn_says_what_it_was_given():
    """A slot 64 wide on a table of dim 4 (the docs' example on a smaller table) failed inside jax with "add got
    incompatible shapes for broadcasting", naming nothing; an fn that changes a shape is refused too."""
    def plan_of(o):
        return se.plan({"f": se.FeatureSpec("f", se.TableSpec("t", 16, 4, optimizer=o), 4)}, make_mesh(1),
                       kernel="generic")  # Custom: the generic kernel, whatever the module runs

    def step(plan):
        tables = se.init_tables(plan, jax.random.key(0))
        batch, _ = se.preprocess(plan, {"f": np.array([[1], [2], [3], [4]])})
        return jax.grad(lambda tb: jnp.sum(se.lookup(plan, batch, tb, 0)["f"]))(tables)

    wide = plan_of(opt.Custom(_momentum_sign_sgd, {"m": opt.SlotSpec(64, 0.0)}))
    with pytest.raises(TypeError, match=r"Custom optimizer '_momentum_sign_sgd' failed on rows \(\d+, 4\), slots "
                                        r"\{'m': \(\d+, 64\)\}, grads \(\d+, 4\) \(slot widths from its "
                                        r"slot_specs\): .*incompatible shapes"):
        step(wide)

    def shrinks(rows, slots, grads, step):
        return rows[:, :2], slots

    with pytest.raises(ValueError, match=r"'shrinks' was given rows \(\d+, 4\).* returned rows \(\d+, 2\)"):
        step(plan_of(opt.Custom(shrinks, {"m": opt.SlotSpec(4, 0.0)})))


@pytest.mark.parametrize("make, match", [
    (lambda: opt.Adam(0.1, b1=1.0), "b1 must be in"),
    (lambda: opt.Adagrad(0.1, initial_accumulator_value=-1), "initial_accumulator_value must be finite and > 0"),
    (lambda: opt.FTRL(0.1, learning_rate_power=0.5), "learning_rate_power must be <= 0"),
    (lambda: opt.FTRL(0.1, l1=-1), "l1 must be finite and >= 0"),
    (lambda: opt.SGD(0.1, clip_gradient=(1, -1)), "clip_gradient needs min <= max"),
    (lambda: opt.SGD(0.1, clip_weight=3), "clip_weight must be a"),
    (lambda: opt.SGD(0.1, weight_decay=-0.1), "weight_decay must be finite and >= 0"),
    (lambda: opt.AdagradMomentum(0.1, beta2=0), "beta2 must be in"),
    (lambda: opt.LaProp(0.1, b2=1.5), "b2 must be in"),
    (lambda: opt.Custom(None), "fn must be a function"),
    # non-finite values trained every touched row into NaN (or froze it), silently
    (lambda: opt.Adagrad(float("nan")), r"Adagrad: learning_rate must be finite and >= 0, got nan"),
    (lambda: opt.SGD(float("inf")), r"SGD: learning_rate must be finite and >= 0, got inf"),
    (lambda: opt.SGD(-0.1), r"SGD: learning_rate must be finite and >= 0, got -0.1"),
    (lambda: opt.SGD(0.1, weight_decay=float("inf")), "weight_decay must be finite and >= 0"),
    (lambda: opt.Adam(0.1, eps=float("nan")), "eps must be finite and > 0"),
    (lambda: opt.RowwiseAdagrad(0.1, epsilon=float("nan")), "epsilon must be finite and >= 0"),
    (lambda: opt.Adagrad(0.1, initial_accumulator_value=float("inf")), "initial_accumulator_value must be finite"),
    (lambda: opt.FTRL(0.1, l2=float("nan")), "l2 must be finite and >= 0"),
    (lambda: opt.LaProp(0.1, eps=float("nan")), "eps must be finite and > 0"),
    (lambda: opt.LaProp(0.1, eps=0.0), "eps must be finite and > 0"),  # a zero gradient's row became NaN
    (lambda: opt.AdagradMomentum(0.1, momentum=float("nan")), "momentum must be finite and >= 0"),
    (lambda: opt.AdagradMomentum(0.1, epsilon=float("nan")), "initial_accumulator_value \\+ epsilon must be finite"),
    # the accumulator decays towards 0 (to 0.05 here at once, then below): (acc + eps)^(-1/2) made the row NaN
    (lambda: opt.AdagradMomentum(0.1, beta2=0.5, epsilon=-0.05),
     r"AdagradMomentum: with beta2 < 1 the accumulator decays towards 0, so epsilon must be finite and > 0, got -0.05"),
    (lambda: opt.AdagradMomentum(0.1, beta2=0.9, epsilon=0.0), "so epsilon must be finite and > 0, got 0.0"),
    (lambda: opt.Custom(_momentum_sign_sgd, {"m": (4, 0.0)}), "must be a SlotSpec"),
])
def test_bad_hyperparameters(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_a_numpy_scalar_learning_rate_is_a_float_as_every_other_hyperparameter_takes_it():
    """np.float32(0.5) (a config or a sweep's value) was refused: "learning_rate must be a float ..., got
    np.float32(0.5)"; the other hyperparameters took it. A bool or an array still is refused."""
    for lr in (np.float32(0.5), np.float16(0.5), np.int64(0)):
        o = opt.Adagrad(lr, initial_accumulator_value=np.float32(0.5))
        assert o == opt.Adagrad(float(lr), initial_accumulator_value=0.5) and type(o.learning_rate) is float
    for bad in (True, np.bool_(True), np.array([0.1]), "0.1"):
        with pytest.raises(TypeError, match=r"^SGD: learning_rate must be a float or an optax schedule, got "):
            opt.SGD(bad)


def test_specs_hash_by_value_and_have_documented_slots():
    assert hash(opt.FTRL(0.1, l1=0.1)) == hash(opt.FTRL(0.1, l1=0.1))
    assert opt.Adam(0.1) != opt.Adam(0.2)
    assert opt.Custom(_momentum_sign_sgd, {"m": opt.SlotSpec(4, 0.0)}) == opt.Custom(_momentum_sign_sgd, {"m": opt.SlotSpec(4, 0.0)})
    widths = {type(o).__name__: {k: s.width for k, s in o.slots(8).items()} for o in (
        opt.SGD(), opt.Adagrad(), opt.RowwiseAdagrad(), opt.Adam(), opt.AdagradMomentum(), opt.FTRL(), opt.LaProp())}
    assert widths == {
        "SGD": {}, "Adagrad": {"accumulator": 8}, "RowwiseAdagrad": {"accumulator": 1},
        "Adam": {"momentum": 8, "velocity": 8}, "AdagradMomentum": {"accumulator": 8, "momentum": 8},
        "FTRL": {"accumulator": 8, "linear": 8}, "LaProp": {"mu": 8, "nu": 8},
    }
