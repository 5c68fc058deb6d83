"""Placements ("row", "table", "replicated", "auto"): lookup and training against numpy, replicas,
checkpoints across placements, the planner's cost model and memory budget, and its byte estimate
against the collectives of the compiled step."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import sparse_embed as se
from sparse_embed import optimizers as opt
from sparse_embed.core import kernels
from sparse_embed.core import cost
from sparse_embed.core.cost import TableLoad
from benchmarks.measuring import hlo_collective_bytes
from conftest import make_mesh, require_native
import reference as ref

B = 16
PLACEMENTS = ["row", "table", "replicated", "column", "mixed", "auto"]
MIXED = {"a": "table", "b": "replicated", "c": "row", "d": "column"}
NATIVE_COLUMN = {"a": "column", "b": "column", "d": "column"}  # c has max_norm: split, it runs on the generic kernel


def _placement(name, kernel="auto"):
    if name == "column" and kernel == "native":
        return NATIVE_COLUMN
    return MIXED if name == "mixed" else name


def _features(o):
    """Shared tables, a sequence feature, max_norm, two dims, three combiners."""
    a = se.TableSpec("a", 61, 8, combiner="sum", optimizer=o)
    b = se.TableSpec("b", 26, 8, combiner="mean", optimizer=o)
    c = se.TableSpec("c", 19, 4, combiner="sqrtn", optimizer=o, max_norm=0.4)
    d = se.TableSpec("d", 45, 8, combiner="sum", optimizer=o)
    return {"a1": se.FeatureSpec("a1", a, B), "a2": se.FeatureSpec("a2", a, 2 * B),
            "b_seq": se.FeatureSpec("b_seq", b, B, max_sequence_length=2), "b1": se.FeatureSpec("b1", b, B),
            "c1": se.FeatureSpec("c1", c, B), "d1": se.FeatureSpec("d1", d, B)}


def _batch(rng, feats, step, fmt_of):
    pool = 3 if step == 2 else None  # step 2: full of duplicates, also across features sharing a table
    samples = {n: ref.random_samples(rng, f.batch_size, f.table.vocabulary_size, 5, weighted=True, id_pool=pool)
               for n, f in feats.items()}
    rendered = {n: ref.render(s, fmt_of(n), 5) for n, s in samples.items()}
    return samples, {n: r[0] for n, r in rendered.items()}, {n: r[1] for n, r in rendered.items()}


def _host_tables(plan, rng):
    """The default initializer's rows, stacked on the host (`stack_tables`; fresh slots): tables to train or look
    up with no program compiled for them (init_tables' own program: test_init_tables_is_placement_independent)."""
    return se.stack_tables(plan, {n: ref.initial_rows(rng, t.vocabulary_size, t.embedding_dim)
                                  for n, t in plan.tables.items()})


def _train_against_numpy(plan, feats, o, update, steps, seed=3, fmt_of=lambda n: "list"):
    """Trains `steps` steps through lookup and in numpy (float64); returns both final states."""
    rng = np.random.default_rng(seed)
    tables = _host_tables(plan, rng)
    state = {n: {k: v.astype(np.float64) for k, v in s.items()} for n, s in se.unstack_state(plan, tables).items()}
    cts = {n: rng.normal(size=f.output_shape).astype(np.float32) for n, f in feats.items()}

    def loss(tables, batch, step):
        acts = se.lookup(plan, batch, tables, step)
        return sum(jnp.sum(acts[k] * cts[k]) for k in cts)

    train = jax.jit(jax.grad(loss), donate_argnums=0)
    for step in range(steps):
        samples, ids, w = _batch(rng, feats, step, fmt_of)
        batch, _ = se.preprocess(plan, ids, w)
        for tname in state:
            W, grads = state[tname]["table"], {}
            for n, f in feats.items():
                if f.table.name == tname:
                    kw = dict(combiner=f.table.combiner, seq_len=f.max_sequence_length, max_norm=f.table.max_norm)
                    for r, g in ref.row_grads(W, samples[n], cts[n], **kw).items():
                        grads[r] = grads.get(r, 0.0) + g
            ref.apply(update, state[tname], grads, o.learning_rate, step)
        tables = train(tables, batch, jnp.int32(step))
    return se.unstack_state(plan, tables), state


def _forward_reference(plan, tables, feats, samples):
    W = se.unstack_tables(plan, tables)
    return {n: ref.lookup(W[f.table.name], samples[n], combiner=f.table.combiner, seq_len=f.max_sequence_length,
                          max_norm=f.table.max_norm) for n, f in feats.items()}


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_forward_matches_numpy(mesh, placement, each_kernel):
    feats = _features(opt.SGD(0.1))
    plan = se.plan(feats, mesh, placement=_placement(placement, each_kernel), stacking=None if placement == "mixed" else "auto")
    rng = np.random.default_rng(0)
    tables = _host_tables(plan, rng)
    formats = ["dense", "list", "pair", "list", "dense", "pair"]
    samples, ids, w = _batch(rng, feats, 0, lambda n: formats[sorted(feats).index(n)])
    batch, _ = se.preprocess(plan, ids, w)
    acts = jax.jit(lambda b, t: se.lookup(plan, b, t))(batch, tables)
    for n, want in _forward_reference(plan, tables, feats, samples).items():
        assert acts[n].shape == feats[n].output_shape
        np.testing.assert_allclose(np.asarray(acts[n]), want, rtol=1e-5, atol=1e-6, err_msg=n)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_training_matches_numpy(mesh, placement, each_kernel):
    """Adagrad here; every optimizer and option under every placement: test_optimizers."""
    o, update = opt.Adagrad(0.1, initial_accumulator_value=0.5), ref.adagrad
    feats = _features(o)
    plan = se.plan(feats, mesh, placement=_placement(placement, each_kernel))
    got, want = _train_against_numpy(plan, feats, o, update, steps=4)
    for t in want:
        for k in want[t]:
            np.testing.assert_allclose(got[t][k], want[t][k], rtol=1e-4, atol=1e-5, err_msg=f"{t}/{k}")


def test_bf16_tables_and_sequence_features_per_placement(mesh8):
    o = opt.Adagrad(0.1)
    t = se.TableSpec("t", 50, 8, dtype=jnp.bfloat16, optimizer=o)
    feats = {"s": se.FeatureSpec("s", t, B, max_sequence_length=3), "p": se.FeatureSpec("p", t, B)}
    outs = {}
    for placement in ("row", "table", "replicated"):
        plan = se.plan(feats, mesh8, placement=placement)
        got, want = _train_against_numpy(plan, feats, o, ref.adagrad, steps=3)
        np.testing.assert_allclose(got["t"]["table"].astype(np.float32), want["t"]["table"], rtol=2e-2, atol=2e-2)
        outs[placement] = got["t"]["table"]
    # bf16 rounding of the same updates: the placements agree with each other closely, too
    np.testing.assert_allclose(outs["table"].astype(np.float32), outs["row"].astype(np.float32), atol=1e-2)


@pytest.mark.parametrize("kernel", ["generic", "native"])
def test_replicas_stay_bitwise_identical(mesh8, kernel):
    o = opt.Adam(0.05)
    t = se.TableSpec("t", 30, 8, optimizer=o, max_norm=1.0)
    feats = {"f": se.FeatureSpec("f", t, 64), "g": se.FeatureSpec("g", t, 64, max_sequence_length=2)}
    plan = se.plan(feats, mesh8, placement="replicated", kernel=kernel)
    tables = se.init_tables(plan, jax.random.key(1))
    rng = np.random.default_rng(2)

    def loss(tables, batch, step):
        acts = se.lookup(plan, batch, tables, step)
        return sum(jnp.sum(jnp.sin(3.0 * a)) for a in acts.values())  # gradients differ on every device

    train = jax.jit(jax.grad(loss), donate_argnums=0)
    for step in range(20):
        ids = {"f": rng.integers(0, 30, (64, 4)), "g": rng.integers(0, 30, (64, 2))}
        batch, _ = se.preprocess(plan, ids)
        tables = train(tables, batch, jnp.int32(step))
    for a in (tables["t"].table, *tables["t"].slots.values()):
        copies = np.asarray(a).reshape(8, -1, a.shape[1])
        assert not np.array_equal(copies[0], np.asarray(se.init_tables(plan, jax.random.key(1))["t"].table)[:copies.shape[1]])
        for d in range(1, 8):
            assert np.array_equal(copies[d].view(np.uint32), copies[0].view(np.uint32)), f"replica {d} drifted"


# ---------------------------------------------------------------- rows split by columns, statistics of whole rows
def _wide_features(o):
    """dim 20 over up to 8 devices: every device holds real columns (3 each, the last 4 padding on 8)."""
    t = se.TableSpec("t", 37, 20, combiner="sqrtn", optimizer=o, max_norm=0.6)
    u = se.TableSpec("u", 23, 20, combiner="sum", optimizer=o)
    return {"t1": se.FeatureSpec("t1", t, B), "t_seq": se.FeatureSpec("t_seq", t, B, max_sequence_length=2),
            "u1": se.FeatureSpec("u1", u, 2 * B)}


def _normalized_step(rows, slots, grads, step):
    """A Custom rule that needs whole rows: the step is the gradient's direction (its norm over the row)."""
    g = grads / (np.float32(1e-3) + jnp.sqrt(jnp.sum(grads * grads, axis=-1, keepdims=True)))
    return rows - 0.1 * g - 0.01 * slots["seen"], {"seen": slots["seen"] + 1.0, "m": 0.5 * slots["m"] + g}


def _ref_normalized_step(w, slots, g, lr, step):
    d = g / (1e-3 + np.sqrt(np.sum(g * g)))
    return w - 0.1 * d - 0.01 * slots["seen"], {"seen": slots["seen"] + 1.0, "m": 0.5 * slots["m"] + d}


CUSTOM = opt.Custom(_normalized_step, {"seen": opt.SlotSpec(1, 0.5), "m": opt.SlotSpec(20, 0.0)})


@pytest.mark.parametrize("o, update, sums", [
    (opt.RowwiseAdagrad(0.2, epsilon=1e-3), ref.rowwise_adagrad(1e-3), 5),  # 3 max_norm, 1 mean, 1 skip
    (opt.Adam(0.05, b1=0.8, b2=0.9, eps=1e-3), ref.adam(0.8, 0.9, 1e-3), 4),
    (CUSTOM, _ref_normalized_step, 3)], ids=["rowwise_adagrad", "adam", "custom"])  # rows gathered whole
def test_column_sums_whole_row_statistics_over_devices(mesh, o, update, sums):
    """max_norm's norm and RowwiseAdagrad's mean(g²) are over whole rows, though each device holds a few columns;
    a Custom rule sees whole rows."""
    feats = _wide_features(o)
    plan = se.plan(feats, mesh, placement="column", stacking=None)
    assert cost.row_sums(plan.stack("t")) == sums
    got, want = _train_against_numpy(plan, feats, o, update, steps=4)
    for t in want:
        for k in want[t]:
            np.testing.assert_allclose(got[t][k], want[t][k], rtol=1e-4, atol=1e-5, err_msg=f"{t}/{k}")
    if mesh.size > 1 and not o.elementwise:  # a per-row slot: one copy per device, bitwise equal
        name = "accumulator" if "accumulator" in got["u"] else "seen"
        tables = se.stack_tables(plan, {n: v["table"] for n, v in got.items()},
                                 {n: {name: v[name]} for n, v in got.items()})
        copies = np.asarray(tables["u"].slots[name]).reshape(mesh.size, -1)
        assert (copies == copies[0]).all() and copies.shape[1] == plan.stack("u").total_rows


def test_column_skips_a_nonfinite_row_on_every_device(mesh8):
    o = opt.RowwiseAdagrad(0.2)
    feats = _wide_features(o)
    results = {}
    for placement in ("row", "column"):
        plan = se.plan(feats, mesh8, placement=placement, stacking=None)
        tables = se.init_tables(plan, jax.random.key(1))
        batch, _ = se.preprocess(plan, {n: np.arange(f.batch_size * 2).reshape(f.batch_size, 2) % 7
                                        for n, f in feats.items()})
        cts = {n: np.ones(f.output_shape, np.float32) for n, f in feats.items()}
        cts["u1"][3, 5] = np.nan  # rows 6 and 0 of u (3 * 2 % 7, 7 % 7): skipped, on every device that holds a column
        grad = jax.jit(jax.grad(lambda t: sum(jnp.sum(a * cts[k]) for k, a in se.lookup(plan, batch, t, 0).items())))
        new = grad(tables)
        assert int(se.nonfinite_rows(plan, batch, cts)["u"]) == 2
        results[placement] = se.unstack_state(plan, new)
        before = se.unstack_state(plan, tables)
        for k in ("table", "accumulator"):
            np.testing.assert_array_equal(results[placement]["u"][k][[0, 6]], before["u"][k][[0, 6]])
            assert not np.array_equal(results[placement]["u"][k][1], before["u"][k][1])
        if placement == "column":
            copies = np.asarray(new["u"].slots["accumulator"]).reshape(8, -1)
            assert (copies == copies[0]).all()
    for t in results["row"]:
        for k in results["row"][t]:
            np.testing.assert_allclose(results["column"][t][k], results["row"][t][k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("o, update", [
    (opt.SGD(0.1, clip_weight=(0.05, 10.0)), ref.with_options(ref.sgd, clip_weight=(0.05, 10.0))),
    (opt.RowwiseAdagrad(0.2, epsilon=1e-3, clip_gradient=(0.01, 10.0)),
     ref.with_options(ref.rowwise_adagrad(1e-3), clip_gradient=(0.01, 10.0)))], ids=["clip_weight", "clip_gradient"])
def test_column_padding_stays_out_of_whole_row_statistics(o, update):
    """dim 20 on 8 devices: 3 columns each, the last 4 padding. A clip range without 0 gave the padding columns
    values (clip_weight: 0.05; clip_gradient: their zero gradients clipped to 0.01), which max_norm's norm and
    RowwiseAdagrad's mean(g²) counted: activations and rows off the row-wise ones by up to 0.005."""
    feats = _wide_features(o)
    plan = se.plan(feats, make_mesh(8), placement="column", stacking=None)
    got, want = _train_against_numpy(plan, feats, o, update, steps=3)
    for t in want:
        for k in want[t]:
            np.testing.assert_allclose(got[t][k], want[t][k], rtol=1e-4, atol=1e-5, err_msg=f"{t}/{k}")


def test_forcing_the_native_kernel_on_split_rows_that_need_whole_row_statistics_says_so(mesh8):
    require_native("kernel")
    feats = _wide_features(opt.RowwiseAdagrad(0.1))
    auto = se.plan(feats, mesh8, placement="column", stacking=None)
    assert {kernels.for_stack(auto, s).name for s in auto.stacks} == {"generic"}
    native = se.plan(feats, mesh8, placement="column", kernel="native", stacking=None)
    batch, _ = se.preprocess(native, {n: np.zeros((f.batch_size, 1), np.int64) for n, f in feats.items()})
    with pytest.raises(ValueError, match=r"Stack 't': the native kernel cannot run it: its rows are split by columns "
                                         r"and it needs statistics of whole rows"):
        se.lookup(native, batch, se.init_tables(native, jax.random.key(0)))


# ---------------------------------------------------------------- checkpoints are placement-free
@pytest.mark.parametrize("saved, restored, o", [
    ("row", "table", opt.Adam(0.01)), ("table", "replicated", opt.Adam(0.01)), ("replicated", "row", opt.Adam(0.01)),
    ("mixed", "auto", opt.Adam(0.01)), ("table", "mixed", opt.Adam(0.01)), ("column", "row", opt.Adam(0.01)),
    ("column", "replicated", opt.RowwiseAdagrad(0.1)), ("row", "column", opt.RowwiseAdagrad(0.1)),
    ("column", "table", CUSTOM)])
def test_checkpoint_restores_exactly_under_another_placement_and_mesh(tmp_path, saved, restored, o):
    feats = _features(o)
    rng = np.random.default_rng(5)
    tables = {f.table.name: rng.normal(size=(f.table.vocabulary_size, f.table.embedding_dim)).astype(np.float32)
              for f in feats.values()}
    slots = {n: {k: rng.uniform(0.1, 1, (len(w), s.width)).astype(np.float32)
                 for k, s in o.slots(w.shape[1]).items()} for n, w in tables.items()}
    plan8 = se.plan(feats, make_mesh(8), placement=_placement(saved))
    with se.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, plan8, se.stack_tables(plan8, tables, slots))
        ckpt.wait()
        for devices, stacking in ((2, None), (8, "auto")):
            plan = se.plan(feats, make_mesh(devices), placement=_placement(restored), stacking=stacking)
            got = se.unstack_state(plan, ckpt.restore(plan).tables)
            for n, w in tables.items():
                np.testing.assert_array_equal(got[n]["table"], w, err_msg=n)
                for k, v in slots[n].items():
                    np.testing.assert_array_equal(got[n][k], v, err_msg=f"{n}/{k}")


@pytest.mark.parametrize("placement", ["table", "replicated"])
def test_init_tables_is_placement_independent(mesh8, placement):
    feats = _features(opt.Adagrad(0.1))
    custom = se.TableSpec("u", 33, 8, initializer=lambda key, shape, dtype: jax.random.uniform(key, shape, dtype))
    feats["u1"] = se.FeatureSpec("u1", custom, B)
    want = se.unstack_state(se.plan(feats, make_mesh(1)), se.init_tables(se.plan(feats, make_mesh(1)), jax.random.key(7)))
    plan = se.plan(feats, mesh8, placement=placement)
    got = se.unstack_state(plan, se.init_tables(plan, jax.random.key(7)))
    for n in want:
        for k in want[n]:
            np.testing.assert_array_equal(got[n][k], want[n][k], err_msg=f"{n}/{k}")


# ---------------------------------------------------------------- the estimate against the compiled step
@pytest.mark.parametrize("placement, o", [(p, opt.Adagrad(0.1)) for p in ("row", "table", "replicated", "mixed", "auto",
                                                                           "column")]
                         + [("column", opt.RowwiseAdagrad(0.1)), ("column", CUSTOM)])  # row statistics; whole rows
@pytest.mark.parametrize("devices", [2, 8])
def test_collective_bytes_equal_the_compiled_train_step(placement, o, devices):
    feats = _wide_features(o) if o is CUSTOM else _features(o)
    plan = se.plan(feats, make_mesh(devices), placement=_placement(placement), capacity=80)
    rng = np.random.default_rng(0)
    tables = _host_tables(plan, rng)  # only their shapes and shardings matter
    batch, _ = se.preprocess(plan, {n: rng.integers(0, f.table.vocabulary_size, (f.batch_size, 2))
                                    for n, f in feats.items()})
    cts = {n: jnp.ones(f.output_shape) for n, f in feats.items()}

    def step(tables, batch, cts):
        acts, vjp = jax.vjp(lambda t: se.lookup(plan, batch, t, 0), tables)
        return acts, vjp(cts)[0]

    text = jax.jit(step).lower(tables, batch, cts).compile().as_text()
    assert plan.collective_bytes() == pytest.approx(hlo_collective_bytes(text, devices), abs=1)
    assert plan.collective_bytes() > 0


@pytest.mark.parametrize("nonfinite", ["skip", "apply"])
def test_describe_gives_each_stack_the_bytes_of_the_plans_policy(nonfinite):
    """A "column" stack's whole-row statistics count a non-finite flag under "skip" only: describe's stack column
    gave the "skip" bytes under "apply" too (8.4 KiB for a plan whose total said 7.1 KiB)."""
    t = se.TableSpec("c", 19, 5, combiner="sqrtn", optimizer=opt.RowwiseAdagrad(0.1), max_norm=0.4)
    plan = se.plan([se.FeatureSpec("c1", t, 24)], make_mesh(3), placement="column", capacity=80,
                   nonfinite_gradients=nonfinite)
    want = {"skip": 8 * 1024 + 384, "apply": 7 * 1024 + 128}[nonfinite]  # 2 (D-1) C * 4 bytes per row sum less
    assert plan.collective_bytes() == want
    header, _, line = plan.describe().splitlines()
    assert f"{want / 1024:.1f} KiB through collectives" in header
    assert line.split()[-2:] == [f"{want / 1024:.1f}", "KiB"]


# ---------------------------------------------------------------- the planner
def _mixed_workload(small=12, large=2, large_optimizer=None):
    feats = []
    for i in range(small):
        t = se.TableSpec(f"s{i:02d}", int(10 * 10 ** (3 * i / max(small - 1, 1))), 16, optimizer=opt.Adagrad(0.1))
        feats.append(se.FeatureSpec(f"fs{i:02d}", t, 512))
    for i in range(large):
        feats.append(se.FeatureSpec(f"fl{i}", se.TableSpec(f"l{i}", 10**5, 64, optimizer=large_optimizer or opt.Adagrad(0.1)), 512))
    return feats


def test_auto_replicates_small_tables_and_cuts_traffic(mesh8):
    feats = _mixed_workload()
    auto = se.plan(feats, mesh8, placement="auto", ids_per_sample={"fl0": 8, "fl1": 8})
    row = se.plan(feats, mesh8)
    placements = {t.table.name: s.placement for s in auto.stacks for t in s.tables}
    assert placements["s00"] == "replicated" and placements["s11"] == "table" and placements["l0"] == "column"
    assert auto.collective_bytes() < 0.5 * row.collective_bytes()
    # every choice is the cheapest of the cost model, table by table
    loads = {f.table.name: TableLoad(f.table.vocabulary_size, f.table.embedding_dim, 1, 512 // 8,
                                     (8 if f.name in ("fl0", "fl1") else 1) * 512 / 8) for f in feats}
    stacks = {t.table.name: s for s in auto.stacks for t in s.tables}
    for name, p in placements.items():
        load = loads[name]
        if p == "table":  # its stack's k tables send ceil(k/8) tables' rows to every shard
            k = len(stacks[name].tables)
            assert load.cost("table", 8, -(-k // 8) / k) <= min(load.cost("row", 8), load.cost("replicated", 8)), name
        else:
            assert load.cost(p, 8) <= min(load.cost(q, 8) for q in ("row", "replicated", "column")), name
    # "table" tables are balanced: no device holds two of them more than another
    owners = np.bincount([t.shard for s in auto.stacks for t in s.tables if s.placement == "table"], minlength=8)
    assert owners.max() - owners.min() <= 1


@pytest.mark.parametrize("stacking", ["auto", "explicit"])
def test_auto_puts_fewer_tables_than_devices_row_wise_when_whole_tables_cost_more(mesh8, stacking):
    """Two tables on 8 devices: "table" sends every shard a segment as large as a whole table's ids (the
    exchange's capacity is the busiest shard's); the cost model counted 1/D of that, so auto chose "table" at
    1.6x the bytes of "row" by the plan's own count."""
    feats = [se.FeatureSpec(f"f{i}", se.TableSpec(f"t{i}", rows, 8), 64) for i, rows in enumerate((2000, 3000))]
    kw = dict(ids_per_sample={"f0": 20, "f1": 20}, stacking="auto" if stacking == "auto" else [["t0", "t1"]])
    auto, row, table = (se.plan(feats, mesh8, placement=p, **kw) for p in ("auto", "row", "table"))
    assert table.collective_bytes() > row.collective_bytes()
    assert [s.placement for s in auto.stacks] == ["row"] and auto.collective_bytes() == row.collective_bytes()
    many = [se.FeatureSpec(f"g{i}", se.TableSpec(f"u{i}", 2000, 8), 64) for i in range(16)]  # 2 a device: spread
    assert {s.placement for s in se.plan(many, mesh8, placement="auto", ids_per_sample=20).stacks} == {"table"}


@pytest.mark.parametrize("nonfinite, want", [("skip", "row"), ("apply", "column")])
def test_auto_counts_column_statistics_under_the_plans_nonfinite_policy(mesh8, nonfinite, want):
    """RowwiseAdagrad by columns all-reduces its mean per id, and a non-finite flag under "skip" only: under
    "apply" the cost model still counted the flag and kept this table row-wise (30688 bytes per step) where
    columns cost 25984."""
    feats = [se.FeatureSpec("f", se.TableSpec("t", 100_000, 64, optimizer=opt.RowwiseAdagrad(0.1)), 64)]
    kw = dict(ids_per_sample=20, nonfinite_gradients=nonfinite)
    cost_of = {p: se.plan(feats, mesh8, placement=p, **kw).collective_bytes() for p in ("row", "column")}
    assert min(cost_of, key=cost_of.get) == want, cost_of
    assert se.plan(feats, mesh8, placement="auto", **kw).stacks[0].placement == want


def test_auto_on_one_device_is_row(mesh):
    plan = se.plan(_mixed_workload(4, 1), mesh, placement="auto")
    if mesh.size == 1:
        assert {s.placement for s in plan.stacks} == {"row"}


def test_memory_budget_demotes_until_the_plan_fits(mesh8):
    feats = _mixed_workload(large_optimizer=opt.RowwiseAdagrad(0.1))
    free = se.plan(feats, mesh8, placement="auto")
    large = lambda p: {s.placement for s in p.stacks if s.first.name.startswith("l")}  # noqa: E731
    # by columns, RowwiseAdagrad's per-row accumulator is whole on every device: a little more than row-wise
    assert large(free) == {"column"}
    fit = se.plan(feats, mesh8, placement="auto", memory_budget=free.memory_per_device() - 1)
    assert fit.memory_per_device() < free.memory_per_device()
    assert "row" in large(fit)
    # "replicated" -> "table" -> "row", "column" -> "row": the all-row-wise plan's memory always fits
    row = se.plan(feats, mesh8)
    fit = se.plan(feats, mesh8, placement="auto", memory_budget=row.memory_per_device())
    assert fit.memory_per_device() <= row.memory_per_device() and large(fit) == {"row"}
    with pytest.raises(ValueError, match=r"No placement fits memory_budget=1000 bytes per device: the plan "
                                         r"needs") as every_table_auto:
        se.plan(feats, mesh8, placement="auto", memory_budget=1000)
    assert '"auto"' not in str(every_table_auto.value)  # (it said to let more tables be placed "auto")
    with pytest.raises(ValueError, match=r"No placement fits .* let tables \['l0'\] be placed \"auto\""):
        se.plan(feats, mesh8, placement={"l0": "replicated"}, memory_budget=row.memory_per_device())  # never moved
    # memory per device: every stack's rows on one device times its row bytes (f32 table columns, Adagrad's
    # slot [dim] or RowwiseAdagrad's [1], whole)
    want = sum(s.rows_per_shard * 4 * (s.array_dim + (1 if s.first.name.startswith("l") else s.array_dim))
               for s in free.stacks)
    assert free.memory_per_device() == want


def _narrow_workload():
    """12-wide tables: on 8 devices "column" pads each row to 16 columns, more memory than "row" needs."""
    return [se.FeatureSpec(f"f{i}", se.TableSpec(f"t{i}", 1000 * (i + 1), 12, optimizer=opt.Adagrad(0.1)), 64)
            for i in range(3)]


def test_memory_budget_moves_padded_columns_back_to_row(mesh8):
    feats = _narrow_workload()
    free, row = se.plan(feats, mesh8, placement="auto"), se.plan(feats, mesh8)
    assert {s.placement for s in free.stacks} == {"column"}
    assert free.memory_per_device() > row.memory_per_device()  # 2 of 12 columns per device, not 1.5
    # the all-row plan's need, and every budget between it and the free choice's, gives a plan that fits
    budgets = np.linspace(row.memory_per_device(), free.memory_per_device(), 6).astype(int)
    for budget in budgets:
        fit = se.plan(feats, mesh8, placement="auto", memory_budget=int(budget))
        assert fit.memory_per_device() <= budget, budget
    fit = se.plan(feats, mesh8, placement="auto", memory_budget=row.memory_per_device())
    assert {s.placement for s in fit.stacks} == {"row"}
    assert se.plan(feats, mesh8, placement="auto", memory_budget=free.memory_per_device()).stacks == free.stacks
    with pytest.raises(ValueError, match=r"No placement fits .* the plan needs %d " % row.memory_per_device()):
        se.plan(feats, mesh8, placement="auto", memory_budget=row.memory_per_device() - 1)


def test_memory_budget_moves_an_explicit_stack_as_a_whole(mesh8):
    """An explicit stack's one placement was recorded as if the caller had fixed it: a budget the all-row plan
    meets gave "No placement fits ... let more tables be placed auto" (every table was). Now the stack moves as
    a whole; a stack holding a table the caller placed still never moves."""
    feats = [se.FeatureSpec(f"f{i}", se.TableSpec(f"t{i}", rows, 16), 64) for i, rows in enumerate((2000, 3000, 500))]
    kw = dict(stacking=[["t0", "t1", "t2"]], ids_per_sample=20)
    row = se.plan(feats, mesh8, placement="row", **kw)
    free = se.plan(feats, mesh8, placement="auto", **kw)
    assert [s.placement for s in free.stacks] == ["table"] and free.memory_per_device() > row.memory_per_device()
    fit = se.plan(feats, mesh8, placement="auto", memory_budget=row.memory_per_device(), **kw)
    assert [s.placement for s in fit.stacks] == ["row"] and fit.memory_per_device() <= row.memory_per_device()
    with pytest.raises(ValueError, match="No placement fits"):  # t2 is the caller's: its stack stays "table"
        se.plan(feats, mesh8, placement={"t2": "table"}, memory_budget=row.memory_per_device(), **kw)


def test_table_load_memory_is_what_the_plan_holds(mesh8):
    """`TableLoad.memory` counts the rows and columns that the plan pads, for every placement it can size."""
    rowwise = se.TableSpec("rw", 1001, 12, optimizer=opt.RowwiseAdagrad(0.1))  # a per-row slot, whole by columns
    feats = _narrow_workload() + [se.FeatureSpec("r", rowwise, 64)]
    loads = cost.table_loads({f.name: f for f in feats}, {f.table.name: f.table for f in feats}, 8,
                              dict.fromkeys((f.name for f in feats), 1.0))
    for p in ("row", "replicated", "column"):
        plan = se.plan(feats, mesh8, placement=p, stacking=None)
        for s in plan.stacks:
            assert loads[s.first.name].memory(p, 8) == cost.memory_per_device(s), (p, s.name)
    plan = se.plan(feats, mesh8, placement="table", stacking=None)  # alone in its stack: the whole padded table
    for s in plan.stacks:
        assert loads[s.first.name].memory("table", 8) == cost.memory_per_device(s), s.name


@st.composite
def _table_sets(draw):
    """A few tables of random vocab, dim, optimizer, max_norm and dtype, each read by one or two features."""
    devices = draw(st.sampled_from([1, 2, 4, 8]))
    optimizers = [opt.SGD(0.1), opt.Adagrad(0.1), opt.RowwiseAdagrad(0.1), opt.Adam(0.01), opt.Custom(_sgd, ())]
    feats = []
    for i in range(draw(st.integers(1, 5))):
        t = se.TableSpec(f"t{i}", draw(st.integers(1, 3000)), draw(st.integers(1, 40)),
                         optimizer=draw(st.sampled_from(optimizers)),
                         max_norm=draw(st.sampled_from([None, 1.0])),
                         dtype=draw(st.sampled_from([np.float32, jnp.bfloat16])))
        for j in range(draw(st.integers(1, 2))):
            feats.append(se.FeatureSpec(f"f{i}_{j}", t, 8 * draw(st.integers(1, 64)),
                                        max_sequence_length=draw(st.sampled_from([0, 0, 3]))))
    ids = {f.name: draw(st.sampled_from([1, 4, 50])) for f in feats}
    fixed = {f.table.name: "row" for f in feats if draw(st.integers(0, 9)) == 0}  # a few tables placed by hand
    return devices, feats, ids, fixed, draw(st.sampled_from(["auto", None])), draw(st.floats(0, 1))


def test_a_table_the_budget_leaves_alone_in_a_table_stack_goes_back_to_its_cheapest_other_placement(mesh8):
    """The budget moves the big tables off "table"; "mid", left alone there, sends its whole activation rows to
    every shard (as row-wise, but on one device's memory): it moves too, and the plan is no worse than all-row
    in memory and cheaper in traffic (it was worse in both)."""
    specs = [se.TableSpec("mid", 400, 8), *(se.TableSpec(f"big{i}", v, 8) for i, v in enumerate((3000, 2500, 2000)))]
    feats = [se.FeatureSpec(t.name, t, 64) for t in specs]
    ips = {"mid": 20, "big0": 2, "big1": 2, "big2": 2}
    row = se.plan(feats, mesh8, placement="row", ids_per_sample=ips)
    fit = se.plan(feats, mesh8, placement="auto", ids_per_sample=ips, memory_budget=50_000)
    assert se.plan(feats, mesh8, placement="auto", ids_per_sample=ips).stacks[0].placement == "table"  # no budget
    lone = [s for s in fit.stacks if s.placement == "table" and len(s.tables) == 1]
    assert not lone, [(s.name, s.placement) for s in fit.stacks]
    assert fit.memory_per_device() <= row.memory_per_device() and fit.collective_bytes() < row.collective_bytes()


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(_table_sets())
def test_memory_budget_the_row_plan_meets_always_gives_a_plan(case):
    devices, feats, ids, fixed, stacking, between = case
    mesh = make_mesh(devices)
    placement = fixed or "auto"  # {table: "row"}: the others "auto"
    row = se.plan(feats, mesh, stacking=stacking).memory_per_device()
    free = se.plan(feats, mesh, placement=placement, stacking=stacking, ids_per_sample=ids).memory_per_device()
    # the all-row plan's need, and a budget between it and what the cost model's choice needs
    for budget in {row, int(row + between * max(free - row, 0))}:
        fit = se.plan(feats, mesh, placement=placement, stacking=stacking, ids_per_sample=ids, memory_budget=budget)
        assert fit.memory_per_device() <= budget
    if row > 0:
        with pytest.raises(ValueError, match="No placement fits"):
            se.plan(feats, mesh, placement=placement, stacking=stacking, ids_per_sample=ids, memory_budget=row - 1)


def test_explicit_placements_override_auto_and_describe_prints_them(mesh8):
    feats = _mixed_workload(4, 1)
    plan = se.plan(feats, mesh8, placement={"s00": "row", "l0": "replicated"})
    where = {t.table.name: (s.placement, t.shard) for s in plan.stacks for t in s.tables}
    assert where["s00"] == ("row", None) and where["l0"] == ("replicated", None)
    text = plan.describe()
    assert "8 device(s)" in text and "through collectives" in text
    for name, (p, shard) in where.items():
        line = next(x for x in text.splitlines() if x.startswith(name + " "))
        assert (f"table (device {shard})" if p == "table" else p) in line
    assert "replicated" in repr(plan)


def test_table_placement_balances_rows_and_outputs(mesh8):
    tables = [se.TableSpec(f"t{i}", 100 + 10 * i, 8) for i in range(16)]
    plan = se.plan([se.FeatureSpec(f"f{i}", t, 64) for i, t in enumerate(tables)], mesh8, placement="table")
    (s,) = plan.stacks
    per = np.bincount([t.shard for t in s.tables], minlength=8)
    assert per.tolist() == [2] * 8  # equal traffic: two tables each
    assert s.partial_rows == 2 * 64 // 8
    assert s.rows_per_shard == max(sum(t.padded_rows for t in s.tables if t.shard == d) for d in range(8))


def test_bad_placements_name_the_problem(mesh8):
    feats = _features(opt.SGD(0.1))
    with pytest.raises(ValueError, match="placement must be one of"):
        se.plan(feats, mesh8, placement="columns")
    with pytest.raises(ValueError, match=r"Table 'a': placement must be one of"):
        se.plan(feats, mesh8, placement={"a": "everywhere"})
    with pytest.raises(ValueError, match=r"placement names tables \['zzz'\]"):
        se.plan(feats, mesh8, placement={"zzz": "row"})
    with pytest.raises(TypeError, match="placement must be a string"):
        se.plan(feats, mesh8, placement=3)
    with pytest.raises(ValueError, match=r"Tables 'a' and 'd' cannot be stacked: their placements differ"):
        se.plan(feats, mesh8, stacking=[["a", "d"]], placement={"a": "table", "d": "row"})
    raw = se.TableSpec("r", 64, 8, dynamic=se.Dynamic())
    with pytest.raises(ValueError, match=r"Table 'r' is keyed by raw ids.*only the \"row\" placement"):
        se.plan({"r1": se.FeatureSpec("r1", raw, B)}, mesh8, placement={"r": "table"})
    plan = se.plan({"r1": se.FeatureSpec("r1", raw, B)}, mesh8, placement="replicated")
    assert plan.stacks[0].placement == "row"  # a raw-id table is always "row"
    with pytest.raises(ValueError, match=r"Feature 'zz': ids_per_sample|unknown features \['zz'\]"):
        se.plan(feats, mesh8, placement="auto", ids_per_sample={"zz": 2})
    with pytest.raises(ValueError, match=r"Feature 'a1': ids_per_sample must be a positive number"):
        se.plan(feats, mesh8, placement="auto", ids_per_sample={"a1": -1})


def test_a_batch_for_another_placement_is_rejected(mesh8):
    feats = _features(opt.SGD(0.1))
    row, rep = se.plan(feats, mesh8), se.plan(feats, mesh8, placement="replicated")
    batch, _ = se.preprocess(row, {n: np.zeros((f.batch_size, 1), np.int64) for n, f in feats.items()})
    with pytest.raises(ValueError, match=r"Stack '.*': batch arrays have shapes .* another plan"):
        se.lookup(rep, batch, se.init_tables(rep, jax.random.key(0)))


def _two_tables(mesh, placement="row", vocab=800, combiner="mean"):
    t, u = (se.TableSpec(n, vocab, 8, combiner=combiner, optimizer=opt.SGD(0.5)) for n in ("t", "u"))
    return se.plan([se.FeatureSpec("a", t, 64), se.FeatureSpec("b", u, 64)], mesh, placement=placement,
                   stacking=None)


@pytest.mark.parametrize("built_for, looked_up_with, says", [
    (dict(placement="row"), dict(placement="table"), r"placement 'row' over 8 devices, 100 rows each, tables t; "
                                                     r"this plan: placement 'table'"),
    (dict(placement="table"), dict(placement="row"), r"placement 'table' .* this plan: placement 'row'"),
    (dict(vocab=800), dict(vocab=792),
     r"100 rows each, tables t; this plan: placement 'row' over 8 devices, 99 rows each"),
    (dict(combiner="mean"), dict(combiner="sum"), r"other tables, vocabularies or features in it"),
], ids=["row-as-table", "table-as-row", "other-vocabulary", "other-combiner"])
def test_a_batch_of_equal_shapes_for_another_plan_is_rejected_also_under_jit(mesh8, built_for, looked_up_with,
                                                                               says):
    """Two plans can give a stack batches of the same shapes whose entries mean other rows (row against table
    placement, another vocabulary) or other gains (another combiner): their activations would be wrong, silently.
    The batch carries its plan's layout mark, checked by `lookup` (at trace time inside a jitted step)."""
    A, B = _two_tables(mesh8, **built_for), _two_tables(mesh8, **looked_up_with)
    ids = {"a": np.arange(64)[:, None] * 7 % 700, "b": np.arange(64)[:, None]}
    (ba, _), (bb, _) = se.preprocess(A, ids), se.preprocess(B, ids)
    assert {k: [x.shape for x in v] for k, v in ba.items()} == {k: [x.shape for x in v] for k, v in bb.items()}
    tables = se.init_tables(B, jax.random.key(0))
    msg = r"Stack 't': the batch was built for another plan's stack 't' \(.*" + says
    with pytest.raises(ValueError, match=msg):
        se.lookup(B, ba, tables)
    step = jax.jit(lambda batch, tables: jax.grad(lambda t: sum(x.sum() for x in se.lookup(B, batch, t).values()))(
        tables))
    with pytest.raises(ValueError, match=msg):
        step(ba, tables)
    # its own plan's batch, and one of an equal plan built again (the mark is a digest, not the plan object), train
    again = _two_tables(mesh8, **looked_up_with)
    for batch in (bb, se.preprocess(again, ids)[0]):
        got = step(batch, tables)
        chex.assert_trees_all_equal(got, step(bb, tables))
    # a batch built by hand (no mark) is not checked
    unmarked = {k: v._replace(layout=None) for k, v in bb.items()}
    chex.assert_trees_all_equal(se.lookup(B, unmarked, tables), se.lookup(B, bb, tables))


def test_stats_size_the_cost_model(mesh8):
    feats = _mixed_workload(4, 1)
    row = se.plan(feats, mesh8, stacking=None)
    rng = np.random.default_rng(0)
    ids = {f.name: rng.integers(0, f.table.vocabulary_size, (512, 30 if f.name == "fl0" else 1)) for f in feats}
    _, stats = se.preprocess(row, ids)
    plain = se.plan(feats, mesh8, placement="auto")
    seen = se.plan(feats, mesh8, placement="auto", stats=stats)
    ids_of = lambda p: {t.table.name: t.expected_ids for s in p.stacks for t in s.tables}  # noqa: E731
    assert ids_of(plain)["l0"] == 64 and ids_of(seen)["l0"] > 20 * 64


@pytest.mark.parametrize("placement", ["row", "table", "column", "replicated"])
def test_stats_of_any_placements_batches_give_the_ids_per_sample_they_saw(mesh8, placement):
    """The stats' ids (not a partition's most, which under "row" is a device's ids over 8 shards and elsewhere
    all of them): the cost model expects what numpy counts, whatever plan the stats came from, and the merged
    stats of several batches their mean (not their sum)."""
    feats = _mixed_workload(2, 1)
    source = se.plan(feats, mesh8, placement=placement, stacking=None)
    rng = np.random.default_rng(0)
    widths = {"fs00": 3, "fs01": 1, "fl0": 10}
    ids = [{f.name: rng.integers(0, f.table.vocabulary_size, (512, widths[f.name])) for f in feats} for _ in range(2)]
    stats = [se.preprocess(source, i)[1] for i in ids]
    merged = stats[0].merge(stats[1])
    assert merged.batches == 2
    want = se.plan(feats, mesh8, stacking=None, ids_per_sample=widths)
    for s in (stats[0], merged):
        seen = se.plan(feats, mesh8, stacking=None, stats=s)
        expected = {t.table.name: t.expected_ids for st in seen.stacks for t in st.tables}
        assert expected == {t.table.name: t.expected_ids for st in want.stacks for t in st.tables}
        assert expected["l0"] == 10 * 512 / 8  # numpy's count: ids of a device


@pytest.mark.parametrize("names", [("item", "user_id", "user"), ("a_b", "a", "b_c")])
def test_stats_of_stacks_whose_table_names_share_parts_size_the_cost_model(mesh8, names):
    """A stack's name is its sorted tables' names joined with "_": "item_user_id" is item + user_id even with a
    table "user" beside them (it was left out of the cost model, silently)."""
    tables = [se.TableSpec(n, 1000, 8) for n in names]
    feats = [se.FeatureSpec(f"f{i}", t, 64) for i, t in enumerate(tables)]
    stacking = [sorted(names[:2]), [names[2]]]
    p = se.plan(feats, mesh8, stacking=stacking)
    ids = {f.name: np.random.default_rng(0).integers(0, 1000, (64, 30 if i < 2 else 1)) for i, f in enumerate(feats)}
    _, stats = se.preprocess(p, ids)
    seen = se.plan(feats, mesh8, stacking=stacking, stats=stats)
    expected = {t.table.name: t.expected_ids for s in seen.stacks for t in s.tables}
    assert expected[names[0]] > 20 * 8 and expected[names[1]] > 20 * 8 and expected[names[2]] < 64  # 8 samples/device


def test_stats_of_a_table_named_as_two_others_joined_are_its_own(mesh8):
    """Tables "a", "b" and "a_b" each alone: the stats' stack "a_b" is the table "a_b" (it was read as a + b,
    overwriting a's own, and a_b fell back to 1 id a sample)."""
    widths = {"a": 5, "b": 2, "a_b": 3}
    feats = [se.FeatureSpec(f"f_{n}", se.TableSpec(n, 1000, 8), 64) for n in widths]
    stacking = [[n] for n in widths]
    ids = {f"f_{n}": np.random.default_rng(0).integers(0, 1000, (64, w)) for n, w in widths.items()}
    _, stats = se.preprocess(se.plan(feats, mesh8, stacking=stacking), ids)
    seen = se.plan(feats, mesh8, stacking=stacking, stats=stats)
    assert {t.table.name: t.expected_ids for s in seen.stacks for t in s.tables} == {
        n: w * 64 / 8 for n, w in widths.items()}


def test_bad_stats_and_memory_budgets_are_refused_or_named(mesh8):
    feats = _features(opt.SGD(0.1))
    for budget in ("2GiB", 0, -1, True, 1.5e9):
        with pytest.raises(ValueError, match=f"memory_budget must be a positive number of bytes .* got {budget!r}"):
            se.plan(feats, mesh8, placement="auto", memory_budget=budget)
    with pytest.raises(TypeError, match="stats must be the Stats that preprocess returns .* got dict"):
        se.plan(feats, mesh8, stats={"a": 3})
    with pytest.raises(ValueError, match="ids_per_sample must be a positive number, got inf"):
        se.plan(feats, mesh8, ids_per_sample=float("inf"))
    other = se.TableSpec("other", 100, 8)
    _, stats = se.preprocess(p := se.plan([se.FeatureSpec("o", other, 8)], mesh8), {"o": np.zeros((8, 1), np.int64)})
    assert p.stack_names == ("other",)
    with pytest.warns(UserWarning, match="the stats' stack 'other' is not made of tables of these features"):
        se.plan(feats, mesh8, stats=stats)


def _sgd(rows, slots, grads, step):
    return rows - 0.1 * grads, slots


def test_a_table_alone_in_its_stack_is_not_placed_whole(mesh8):
    """Alone, a "table" table sends as many activation rows to every shard as row-wise, with D times the memory."""
    whole_rows = opt.Custom(_sgd, ())  # never "column": the choice is between row and table
    feats = _mixed_workload(3, 2, large_optimizer=whole_rows)
    assert "table" not in {s.placement for s in se.plan(feats, mesh8, placement="auto", stacking=None).stacks}
    together = se.plan(feats, mesh8, placement="auto")
    assert {s.placement for s in together.stacks if s.first.name.startswith("l")} == {"table"}


@pytest.mark.parametrize("devices, vocab, placement", [
    (1, 2**31 + 16, "row"),  # one device holds every row
    (8, 2**31, "column"),  # each device holds every row (a slice of its columns)
    (8, 2**31, "replicated"),
])
def test_more_rows_per_device_than_int32_numbers_hold_are_refused(devices, vocab, placement):
    """A batch numbers each device's rows in int32 (padding: one past the last): more rows would wrap to others."""
    big = se.TableSpec("big", vocab, 8)
    with pytest.raises(ValueError, match=r"Stack 'big' \(tables 'big', placement '\w+'\): \d+ table rows on each "
                                         r"device, more than a batch's int32 row numbers hold"):
        se.plan([se.FeatureSpec("f", big, 8)], make_mesh(devices), placement=placement)
    if devices > 1:  # split by rows over the devices, they fit
        p = se.plan([se.FeatureSpec("f", big, 8)], make_mesh(devices), placement="row")
        assert p.stacks[0].rows_per_shard == -(-vocab // devices)


def test_explicit_stacks_take_one_placement_fixed_by_a_table_or_chosen_for_the_stack(mesh8):
    """Tables the caller stacks share a placement: a fixed one's, or auto's for the stack as a whole (auto chose
    per table, and differing choices were refused as "their placements differ")."""
    small, big = (se.TableSpec(n, v, 64, optimizer=opt.SGD(0.5), combiner="sum") for n, v in (("small", 1), ("big", 100_000)))
    feats = [se.FeatureSpec("a", small, 16), se.FeatureSpec("b", big, 16)]
    alone = se.plan(feats, mesh8, placement="auto", ids_per_sample={"a": 30, "b": 30})  # stacked by placement
    assert len({s.placement for s in alone.stacks}) == 2  # each alone: two different choices
    together = se.plan(feats, mesh8, placement="auto", ids_per_sample={"a": 30, "b": 30}, stacking=[["big", "small"]])
    assert [s.name for s in together.stacks] == ["big_small"]
    for p in ("row", "table", "column"):
        fixed = se.plan(feats, mesh8, placement={"small": p}, stacking=[["big", "small"]])
        assert [(s.name, s.placement) for s in fixed.stacks] == [("big_small", p)]
    with pytest.raises(ValueError, match="cannot be stacked: their placements differ"):
        se.plan(feats, mesh8, placement={"small": "row", "big": "table"}, stacking=[["big", "small"]])
    ids = {"a": np.zeros((16, 2), np.int64), "b": np.random.default_rng(1).integers(0, 1000, (16, 3))}
    tables = se.init_tables(together, jax.random.key(0))
    got = se.lookup(together, se.preprocess(together, ids)[0], tables)
    rows = se.unstack_state(together, tables)
    for f, t in (("a", "small"), ("b", "big")):
        np.testing.assert_allclose(got[f], rows[t]["table"][ids[f]].sum(1), rtol=1e-6, atol=1e-6)
