"""SparseCore stacks (`plan(sparsecores=S)`), checked on CPU as far as a CPU can check them.

- the CSR the batch carries, decoded by an independent numpy interpreter
  (format invariants, forward `act += gain * row`, backward: per touched row
  the summed gradient, then the per-row computation the SparseCore runs),
  equals the generic lookup and train step on 1, 2 and 8 devices;
- on CPU the plan trains exactly as a plan without SparseCores;
- the train step lowered for ("cpu", "tpu") holds the SparseCore custom
  calls with the expected static parameters;
- what the primitives cannot run falls back, with a warning naming the stack.
"""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sparse_embed as se
from sparse_embed import optimizers as opt
from sparse_embed.core.sparsecore import kernel as sc_kernel
from conftest import importorfail, make_mesh, require_native
import reference as ref

importorfail("jax_tpu_embedding")

PAD = 2**31 - 1
SPARSECORE_CALLS = ["SparseDenseMatmulGradOpWithOptimizerUpdate", "SparseDenseMatmulOp"]
OPTIMIZERS = {
    "sgd": opt.SGD(0.1),
    "adagrad": opt.Adagrad(0.2, initial_accumulator_value=0.3),
    "adam": opt.Adam(0.05, b1=0.8, b2=0.9, eps=1e-3),
    "adagrad_momentum": opt.AdagradMomentum(0.1, momentum=0.8, use_nesterov=True),
    "ftrl": opt.FTRL(0.5, l1=0.02, l2=0.1, beta=0.3),
    "laprop": opt.LaProp(0.05, b1=0.8, b2=0.9, eps=1e-6),
    "adam_options_schedule": opt.Adam(optax.linear_schedule(0.2, 0.02, 4), clip_gradient=(-0.1, 0.2),
                                      clip_weight=(-0.2, 0.25), weight_decay=0.1),
}


def _features(optimizer, batch: int):
    """Stack "a_b": two tables, one shared by two features, one read by a sequence feature; stack "c": sqrtn."""
    a = se.TableSpec("a", 45, 8, combiner="mean", optimizer=optimizer)
    b = se.TableSpec("b", 19, 8, combiner="mean", optimizer=optimizer)
    c = se.TableSpec("c", 30, 16, combiner="sqrtn", optimizer=optimizer)
    return {"f": se.FeatureSpec("f", a, batch), "g": se.FeatureSpec("g", a, batch),
            "h": se.FeatureSpec("h", b, batch), "s": se.FeatureSpec("s", b, batch, max_sequence_length=3),
            "k": se.FeatureSpec("k", c, batch)}


def _ids(feats, seed: int):
    rng = np.random.default_rng(seed)
    ids, weights = {}, {}
    for name, f in feats.items():
        samples = ref.random_samples(rng, f.batch_size, f.table.vocabulary_size, 4, weighted=name != "g",
                                     id_pool=6 if name == "f" else None)  # "f": duplicates within samples
        ids[name], weights[name] = ref.render(samples, "list" if name == "g" else "dense", 4)
    return ids, weights


def _plans(mesh, optimizer, sparsecores: int, batch: int, **kw):
    feats = _features(optimizer, batch)
    return se.plan(feats, mesh, sparsecores=sparsecores, **kw), se.plan(feats, mesh, **kw)


# ------------------------------------------------------------------ the numpy interpreter of the CSR
def _decode(csr, num_devices: int, S: int):
    """Every entry `(device, slice, partition, embedding_id, sample_id, gain)`, checking the format."""
    N = num_devices * S
    rp_len, per_slice = max(N, 8), csr.embedding_ids.shape[1] // S
    assert csr.row_pointers.shape == (num_devices, S * rp_len) and per_slice % (8 * N) == 0
    out = []
    for d in range(num_devices):
        for s in range(S):
            rp = np.asarray(csr.row_pointers[d, s * rp_len:(s + 1) * rp_len])
            eid, sid, gain = (np.asarray(x[d, s * per_slice:(s + 1) * per_slice])
                              for x in (csr.embedding_ids, csr.sample_ids, csr.gains))
            start = 0
            for p in range(N):
                end = int(rp[p])
                assert start <= end <= per_slice
                pairs = list(zip(eid[start:end].tolist(), sid[start:end].tolist()))
                assert pairs == sorted(set(pairs)), "sorted by (embedding_id, sample_id), each pair once"
                out += [(d, s, p, e, i, g) for (e, i), g in zip(pairs, gain[start:end])]
                nxt = -(-end // 8) * 8
                assert (eid[end:nxt] == PAD).all() and (sid[end:nxt] == PAD).all() and np.isnan(gain[end:nxt]).all()
                start = nxt
            assert (rp[N:] == start).all()
    return out


def _device_rows(stack, values: dict[str, np.ndarray], D: int) -> np.ndarray:
    """`{feature: [B, ...dim]}` -> `[D, rows_per_device, dim]`: each device's rows, one slice per SparseCore, each
    holding its share of every feature's rows (features by name), as jax-tpu-embedding lays out a batch."""
    S = stack.sparsecores
    parts = [np.asarray(values[lay.feature.name]).reshape(D, S, lay.rows_per_device // S, -1)
             for lay in sorted(stack.features, key=lambda lay: lay.feature.name)]
    return np.concatenate(parts, axis=2).reshape(D, stack.rows_per_device, -1)


def _interpret_forward(stack, entries, table: np.ndarray, D: int) -> np.ndarray:
    R, b = stack.rows_per_shard // stack.sparsecores, stack.slice_rows
    act = np.zeros((D, stack.sparsecores * b, table.shape[1]))
    for d, s, p, e, i, g in entries:
        act[d, s * b + i] += g * table[p * R + e].astype(np.float64)
    return act[:, :stack.rows_per_device]


def _interpret_backward(stack, entries, state: dict[str, np.ndarray], grads: np.ndarray, step: int,
                        skip: bool) -> dict[str, np.ndarray]:
    """Per touched row: the gradient summed over its entries, then the per-row computation once."""
    R, b, S = stack.rows_per_shard // stack.sparsecores, stack.slice_rows, stack.sparsecores
    grads = np.pad(grads, ((0, 0), (0, S * b - grads.shape[1]), (0, 0)))
    summed: dict[int, np.ndarray] = {}
    for d, s, p, e, i, g in entries:
        summed[p * R + e] = summed.get(p * R + e, 0.0) + np.float32(g) * grads[d, s * b + i]
    row_fn = jax.jit(sc_kernel.row_update(stack, skip))
    names = list(stack.optimizer.slots(stack.embedding_dim))
    lr = float(stack.optimizer.learning_rate_at(step))
    out = {k: v.copy() for k, v in state.items()}
    for r, g in summed.items():
        rows = [jnp.asarray(g, jnp.float32)[None]] + [state[k][r:r + 1] for k in ["table", *names]]
        new = row_fn(*rows, jnp.full((1, stack.embedding_dim), lr), jnp.full((1, stack.embedding_dim), step, float))
        for k, v in zip(["table", *names], new):
            out[k][r] = np.asarray(v)[0]
    return out


def test_the_row_computation_skips_a_finite_gradient_whose_update_overflows():
    """A finite gradient of 1e20 (its square is inf in float32) wrote inf into Adagrad's accumulator under "skip"
    (only a non-finite gradient was checked); the row and slots now keep their values, as on the other kernels."""
    plan, _ = _plans(make_mesh(1), opt.Adagrad(0.1, initial_accumulator_value=0.3), 2, 8)
    stack = plan.stacks[0]
    dim = stack.embedding_dim
    row, acc = np.full((1, dim), 0.5, np.float32), np.full((1, dim), 0.3, np.float32)
    lr, step = np.full((1, dim), 0.1, np.float32), np.zeros((1, dim), np.float32)
    for skip, g in [(True, 1e20), (False, 1e20), (True, 2.0)]:
        new_row, new_acc = jax.jit(sc_kernel.row_update(stack, skip))(np.full((1, dim), g, np.float32), row, acc, lr,
                                                                       step)
        with np.errstate(over="ignore"):
            want_acc = np.float32(0.3) + np.float32(g) * np.float32(g)  # inf for 1e20
        want = (row, acc) if skip and g == 1e20 else (row - 0.1 * g / np.sqrt(want_acc), np.full((1, dim), want_acc))
        np.testing.assert_allclose(new_row, want[0], rtol=1e-6, err_msg=f"skip={skip}, g={g}")
        np.testing.assert_allclose(new_acc, want[1], rtol=1e-6, err_msg=f"skip={skip}, g={g}")


@pytest.mark.parametrize("devices,S", [(1, 2), (2, 4), (8, 2), (8, 4)])
def test_the_csr_interpreted_in_numpy_equals_the_generic_lookup_and_step(devices, S):
    mesh = make_mesh(devices)
    plan, _ = _plans(mesh, opt.Adagrad(0.2, initial_accumulator_value=0.3), S, 8 * devices, kernel="generic")
    assert plan.stack_names == ("a_b", "c") and f"{S} SparseCores per device" in repr(plan)
    ids, weights = _ids(plan.features, 1)
    batch, _ = se.preprocess(plan, ids, weights)
    tables = se.init_tables(plan, jax.random.key(2))
    acts = se.lookup(plan, batch, tables, 0)
    ct = {k: np.random.default_rng(3).normal(size=v.shape).astype(np.float32) for k, v in acts.items()}
    new = jax.grad(lambda t: sum(jnp.vdot(a, ct[k]) for k, a in se.lookup(plan, batch, t, 0).items()))(tables)
    for stack in plan.stacks:
        assert stack.sparsecores == S and stack.rows_per_shard % (8 * S) == 0
        entries = _decode(batch[stack.name].csr, devices, S)
        got = _interpret_forward(stack, entries, np.asarray(tables[stack.name].table), devices)
        np.testing.assert_allclose(got, _device_rows(stack, acts, devices), rtol=1e-5, atol=1e-6)
        state = {"table": np.asarray(tables[stack.name].table),
                 **{k: np.asarray(v) for k, v in tables[stack.name].slots.items()}}
        want = _interpret_backward(stack, entries, state, _device_rows(stack, ct, devices), 0, True)
        np.testing.assert_allclose(np.asarray(new[stack.name].table), want["table"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(new[stack.name].slots["accumulator"]), want["accumulator"], rtol=1e-5)


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_process_builds_the_csr_of_its_own_devices(native, monkeypatch):
    """Under jax.distributed each process converts its devices' COO rows: the same as those rows of the whole."""
    from sparse_embed.host import sparsecore_input as csr

    monkeypatch.setenv("SPARSE_EMBED_NATIVE", native)
    plan, _ = _plans(make_mesh(8), opt.SGD(0.1), 4, 32)
    batch, _ = se.preprocess(plan, *_ids(plan.features, 3), device_put=False)
    for stack in plan.stacks:
        coo = batch[stack.name]
        limit = sc_kernel.max_ids(stack, jax.tree.map(lambda x: x[0], coo.csr))
        mine = csr.from_coo(stack, coo._replace(**{k: getattr(coo, k)[2:4] for k in coo._fields[:5]}), limit)
        jax.tree.map(np.testing.assert_array_equal, mine, jax.tree.map(lambda x: x[2:4], coo.csr))


def test_the_sparsecore_limit_grows_with_the_data_and_never_shrinks():
    plan, _ = _plans(make_mesh(2), opt.SGD(0.1), 2, 16)
    stack = plan.stack("c")

    def limit(ids):
        feats = {n: np.full((16, 1), -1) for n in plan.features}
        feats["k"] = ids
        batch, stats = se.preprocess(plan, feats)
        got = sc_kernel.max_ids(stack, jax.tree.map(lambda x: x[0], batch["c"].csr))
        assert stats.sparsecore_ids_per_partition["c"] <= got
        return got, stats.sparsecore_ids_per_partition["c"]

    small = limit(np.arange(16).reshape(16, 1))
    big = limit(np.zeros((16, 4), int))  # every id 0: one partition gets each slice's 4 * 4 ids
    again = limit(np.arange(16).reshape(16, 1))
    assert small[0] < big[0] == again[0] and big[1] == 16 and again[1] == small[1]


@pytest.mark.parametrize("devices,S", [(1, 4), (8, 2), (4, 4)])
def test_the_c_and_numpy_preprocessing_are_bitwise_equal(devices, S, monkeypatch):
    """The partition into the SparseCore layout and the CSR, in C and in numpy: the same bits."""
    from sparse_embed.host import sparsecore_input as csr

    require_native("preprocess")
    plan, _ = _plans(make_mesh(devices), opt.SGD(0.1), S, 96)
    assert all(s.sparsecores == S for s in plan.stacks)
    batch, _ = se.preprocess(plan, *_ids(plan.features, 4), device_put=False)
    monkeypatch.setenv("SPARSE_EMBED_NATIVE", "0")
    numpy_batch, _ = se.preprocess(plan, *_ids(plan.features, 4), device_put=False)
    for stack in plan.stacks:
        limit = sc_kernel.max_ids(stack, jax.tree.map(lambda x: x[0], batch[stack.name].csr))
        numpy_csr = csr.from_coo(stack, batch[stack.name], limit)
        for got, want, whole in zip(batch[stack.name].csr, numpy_csr, numpy_batch[stack.name].csr):
            np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))  # NaN gaps: bitwise too
            np.testing.assert_array_equal(got.view(np.int32), whole.view(np.int32))
        for field in ("shard_starts", "shard_ends", "col_ids", "row_ids", "values"):
            np.testing.assert_array_equal(getattr(batch[stack.name], field), getattr(numpy_batch[stack.name], field))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_each_optimizers_per_row_computation_equals_the_generic_step(name):
    """Two steps (the second with a NaN gradient, skipped), every option, on 2 devices x 2 SparseCores."""
    plan, _ = _plans(make_mesh(2), OPTIMIZERS[name], 2, 16, kernel="generic")
    stack = plan.stack("a_b")
    tables = se.init_tables(plan, jax.random.key(5))
    for step in range(2):
        ids, weights = _ids(plan.features, 10 + step)
        batch, _ = se.preprocess(plan, ids, weights)
        acts = se.lookup(plan, batch, tables, step)
        ct = {k: np.random.default_rng(step).normal(size=v.shape).astype(np.float32) for k, v in acts.items()}
        if step:
            ct["h"][3, 2] = np.nan  # the rows sample 3 of "h" reads keep their values
        state = {"table": np.asarray(tables[stack.name].table),
                 **{k: np.asarray(v) for k, v in tables[stack.name].slots.items()}}
        want = _interpret_backward(stack, _decode(batch[stack.name].csr, 2, 2), state, _device_rows(stack, ct, 2),
                                   step, True)
        tables = jax.grad(lambda t: sum(jnp.vdot(a, ct[k]) for k, a in se.lookup(plan, batch, t, step).items()))(
            tables)
        got = {"table": tables[stack.name].table, **tables[stack.name].slots}
        for k in want:
            np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=2e-5, atol=1e-6, err_msg=k)


# ------------------------------------------------------------------ CPU: the same training as without SparseCores
def _train(plan, steps: int):
    tables = se.init_tables(plan, jax.random.key(0))

    @jax.jit
    def step_fn(tables, batch, step):
        loss = lambda t: sum(jnp.sum(jnp.tanh(a)) for a in se.lookup(plan, batch, t, step).values())
        return jax.grad(loss)(tables)

    for step in range(steps):
        tables = step_fn(tables, se.preprocess(plan, *_ids(plan.features, step))[0], step)
    return se.unstack_state(plan, tables)


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("kernel", ["generic", "native"])
def test_on_cpu_a_sparsecore_plan_trains_as_one_without(kernel, devices):
    """Bitwise on one device; on 8, rows sit on other devices than without SparseCores (jax-tpu-embedding's
    layout), so activations add the devices' partial sums in another order: equal to float32 rounding."""
    sc, plain = _plans(make_mesh(devices), opt.Adam(0.05), 4, 32, kernel=kernel)
    same = np.testing.assert_array_equal if devices == 1 else functools.partial(np.testing.assert_allclose,
                                                                                 rtol=1e-5, atol=1e-6)
    jax.tree.map(same, _train(sc, 3), _train(plain, 3))


@pytest.mark.parametrize("devices,S", [(1, 4), (2, 2), (8, 4)])
def test_a_custom_initializer_gives_the_same_tables_in_the_sparsecore_layout(devices, S):
    """Custom initializers move natural blocks into the layout (`relayout.blocks_to_mod`): every row where
    jax-tpu-embedding's layout has it (`to_jte`), the same values as without SparseCores."""
    init = jax.nn.initializers.uniform(1.0)
    tables = {n: se.TableSpec(n, v, 8, initializer=init) for n, v in (("a", 45), ("b", 19), ("c", 70))}
    feats = {f"f_{n}": se.FeatureSpec(f"f_{n}", t, 8 * devices) for n, t in tables.items()}
    stacking = [["c", "a", "b"]]
    sc, plain = (se.plan(feats, make_mesh(devices), sparsecores=k, stacking=stacking) for k in (S, 0))
    got = se.init_tables(sc, jax.random.key(5))
    natural = se.unstack_tables(sc, got)
    want = se.unstack_tables(plain, se.init_tables(plain, jax.random.key(5)))
    jax.tree.map(np.testing.assert_array_equal, natural, want)
    order = [p.table.name for p in sc.stacks[0].tables]
    assert order == ["a", "b", "c"]  # a plan stacks tables in name order
    layout = se.jte.jte_layout(sc.tables, devices * S, stacking=[order], rotation=S)
    theirs = se.jte.to_jte(layout, natural, devices * S, pad_value=0.0)
    np.testing.assert_array_equal(np.asarray(got["a_b_c"].table), theirs["a_b_c"])


def test_tables_convert_to_the_natural_format_and_jax_tpu_embeddings_layout_and_back():
    sc, _ = _plans(make_mesh(2), opt.Adagrad(0.1), 4, 16)
    tables = se.init_tables(sc, jax.random.key(1))
    arrays = se.unstack_tables(sc, tables)
    layout = se.jte.jte_layout(sc.tables, num_shards=8, stacking=[["a", "b"], ["c"]], rotation=4)
    back = se.jte.from_jte(layout, se.jte.to_jte(layout, arrays, num_shards=8), num_shards=8)
    again = se.unstack_tables(sc, se.stack_tables(sc, back))
    jax.tree.map(np.testing.assert_array_equal, again, arrays)


@pytest.mark.parametrize("saved_sc, restored_sc, devices", [(4, 0, 2), (0, 2, 8), (2, 4, 1)])
def test_a_checkpoint_restores_exactly_across_sparsecore_counts_and_meshes(tmp_path, saved_sc, restored_sc, devices):
    feats = _features(opt.Adam(0.05), 32)  # 4 rows per device of 8: a slice per SparseCore
    rng = np.random.default_rng(4)
    tables = {n: rng.normal(size=(t.vocabulary_size, t.embedding_dim)).astype(np.float32)
              for n, t in {f.table.name: f.table for f in feats.values()}.items()}
    slots = {n: {k: rng.uniform(size=w.shape).astype(np.float32) for k in ("momentum", "velocity")}
             for n, w in tables.items()}
    saved = se.plan(feats, make_mesh(8), sparsecores=saved_sc)
    with se.CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, saved, se.stack_tables(saved, tables, slots))
        ckpt.wait()
        plan = se.plan(feats, make_mesh(devices), sparsecores=restored_sc)
        got = se.unstack_state(plan, ckpt.restore(plan).tables)
    for n, w in tables.items():
        np.testing.assert_array_equal(got[n]["table"], w, err_msg=n)
        for k, v in slots[n].items():
            np.testing.assert_array_equal(got[n][k], v, err_msg=f"{n}/{k}")


# ------------------------------------------------------------------ lowered for TPU
def _custom_calls(text: str) -> list[tuple[str, dict]]:
    out = []
    for target, config in re.findall(r'custom_call @(SparseDenseMatmul\w+)\(.*?backend_config = "(.*?)"', text):
        out.append((target, eval(config.replace("\\22", '"'))["sparse_dense_matmul_config"]))  # noqa: S307
    return out


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_train_step_lowered_for_cpu_and_tpu_holds_the_sparsecore_calls(name):
    plan, _ = _plans(make_mesh(2), OPTIMIZERS[name], 2, 16, capacity=48)
    tables = se.init_tables(plan, jax.random.key(0))
    batch, stats = se.preprocess(plan, *_ids(plan.features, 0))
    limit = sc_kernel.max_ids(plan.stack("a_b"), jax.tree.map(lambda x: x[0], batch["a_b"].csr))
    assert stats.sparsecore_ids_per_partition["a_b"] <= limit < 48  # sized from the data, below the capacity

    def step(tables, batch, step):
        loss = lambda t: sum(jnp.sum(jnp.tanh(a)) for a in se.lookup(plan, batch, t, step).values())
        return jax.value_and_grad(loss)(tables)

    text = jax.jit(step).trace(tables, batch, 1).lower(lowering_platforms=("cpu", "tpu")).as_text()
    calls = dict(_custom_calls(text))
    assert len(_custom_calls(text)) == 2 * 2 and sorted(calls) == SPARSECORE_CALLS  # each of the two stacks
    configs = [c for t, c in _custom_calls(text)]
    assert all(c["max_ids_per_partition"] == c["max_unique_ids_per_partition"] for c in configs)
    assert limit in [c["max_ids_per_partition"] for c in configs]
    grad_op = calls["SparseDenseMatmulGradOpWithOptimizerUpdate"]
    assert grad_op["num_slot_variables"] == len(OPTIMIZERS[name].slots(8)) and grad_op["num_hyperparameters"] == 2
    assert f"called_computations = [@sparse_embed_{type(OPTIMIZERS[name]).__name__.lower()}_a_b]" in text
    assert "_platform_index" in text  # both branches: the CPU one runs here
    _, new = jax.jit(step)(tables, batch, 1)  # on CPU, the generic branch trains
    assert not np.array_equal(new["a_b"].table, tables["a_b"].table)


def test_two_plans_with_the_same_stack_names_lower_into_one_module():
    """Each fused update's per-row computation gets its own symbol (a second one is renamed)."""
    plans = [_plans(make_mesh(2), opt.SGD(0.1), 2, b)[0] for b in (16, 32)]
    tables = [se.init_tables(p, jax.random.key(0)) for p in plans]
    batches = [se.preprocess(p, *_ids(p.features, 0))[0] for p in plans]

    def step(tables, batches):
        return [jax.grad(lambda t, p=p, b=b: sum(jnp.sum(jnp.tanh(a)) for a in se.lookup(p, b, t, 0).values()))(t)
                for p, t, b in zip(plans, tables, batches)]

    text = jax.jit(step).trace(tables, batches).lower(lowering_platforms=("cpu", "tpu")).as_text()
    names = re.findall(r"called_computations = \[@(\w+)\]", text)
    assert len(names) == 4 and len(set(names)) == 4, names


def test_flax_linen_and_nnx_train_steps_lower_with_the_sparsecore_calls():
    import flax.nnx as nnx
    from sparse_embed.flax import linen as sel, nnx as sen

    plan, _ = _plans(make_mesh(2), opt.Adagrad(0.1), 2, 16)
    batch, _ = se.preprocess(plan, *_ids(plan.features, 0))
    model = sel.Embed(plan)
    params = model.init(jax.random.key(0), batch, 0)

    def linen_step(params, batch):
        return jax.grad(lambda p: sum(jnp.sum(jnp.tanh(a)) for a in model.apply(p, batch, 0).values()))(params)

    module = sen.Embed(plan, rngs=nnx.Rngs(0))

    @nnx.jit
    def nnx_step(module, batch):
        return nnx.grad(lambda m: sum(jnp.sum(jnp.tanh(a)) for a in m(batch, 0).values()))(module)

    texts = [jax.jit(linen_step).trace(params, batch).lower(lowering_platforms=("cpu", "tpu")).as_text(),
             nnx_step.trace(module, batch).lower(lowering_platforms=("cpu", "tpu")).as_text()]
    for text in texts:
        assert sorted(t for t, _ in _custom_calls(text)) == sorted(SPARSECORE_CALLS * 2)  # two stacks
    jax.block_until_ready(jax.jit(linen_step)(params, batch))  # the CPU branch runs


# ------------------------------------------------------------------ what falls back, and bad input
@pytest.mark.parametrize("table,why", [
    (se.TableSpec("t", 50, 8, optimizer=opt.RowwiseAdagrad(0.1)), "narrower than a row"),
    (se.TableSpec("t", 50, 8, max_norm=1.0), "max_norm"),
    (se.TableSpec("t", 50, 8, dtype=jnp.bfloat16), "float32"),
    (se.TableSpec("t", 50, 12), "not a multiple of 8"),
    (se.TableSpec("t", 50, 8, optimizer=opt.Custom(lambda r, s, g, t: (r - g, s))), "user rule"),
    (se.TableSpec("t", 50, 8, dynamic=se.Dynamic()), "raw ids"),
])
def test_what_the_primitives_cannot_run_falls_back_with_a_warning_naming_the_stack(table, why):
    with pytest.warns(UserWarning, match=rf"Stack 't' runs on the usual kernels.*{why}") as said:
        plan = se.plan([se.FeatureSpec("f", table, 8)], make_mesh(2), sparsecores=2)
    assert plan.stacks[0].sparsecores == 0 and plan.stacks[0].rows_per_shard == -(-50 // 2)
    fallbacks = [w for w in said if "runs on the usual kernels" in str(w.message)]
    assert len(fallbacks) == 1 and fallbacks[0].filename == __file__  # once, pointing at the plan() call


def test_a_plan_without_sparsecore_stacks_runs_no_sparsecore_code(monkeypatch):
    """`preprocess` and the lookup pick a backend's hook and kernel by the stack's backend: none here."""
    from sparse_embed.core.sparsecore import kernel, layout
    from sparse_embed.host import preprocessing, sparsecore_input

    def refuse(*args, **kw):
        raise AssertionError("SparseCore code ran")

    plan = _plans(make_mesh(2), opt.Adagrad(0.1), 2, 16)[1]  # no sparsecores
    for module, names in ((sparsecore_input, ("add_inputs", "needed", "from_coo", "pack_csr")),
                          (kernel, ("SparseCoreKernel", "forward", "backward")), (layout, ("unsupported",))):
        for name in names:
            monkeypatch.setattr(module, name, refuse)
    monkeypatch.setitem(se.core.kernels.BACKENDS, "sparsecore", refuse)
    monkeypatch.setitem(preprocessing.INPUT_HOOKS, "sparsecore", refuse)
    batch, stats = se.preprocess(plan, *_ids(plan.features, 0))
    assert all(type(b) is se.ShardedCooMatrix for b in batch.values()) and stats.sparsecore_ids_per_partition == {}
    tables = se.init_tables(plan, jax.random.key(0))
    jax.grad(lambda t: sum(jnp.sum(a) for a in se.lookup(plan, batch, t, 0).values()))(tables)


@pytest.mark.parametrize("batch,seq", [(6, 0), (2, 3)])  # 3 rows per device; 1 sample x 3 positions
def test_a_feature_that_does_not_split_over_the_sparsecores_falls_back(batch, seq):
    t = se.TableSpec("t", 50, 8)
    feats = [se.FeatureSpec("f", t, batch, max_sequence_length=seq), se.FeatureSpec("g", t, 8)]
    with pytest.warns(UserWarning, match=r"Stack 't'.*features \['f'\].*not a multiple of its 2 SparseCores"):
        plan = se.plan(feats, make_mesh(2), sparsecores=2)
    assert plan.stacks[0].sparsecores == 0 and all(lay.slices == 1 for lay in plan.stacks[0].features)


@pytest.mark.parametrize("devices,S", [(3, 2), (1, 3), (6, 4)])  # (a v5p-24 slice: 12 chips x 4 SparseCores)
def test_a_sparsecore_count_that_is_not_a_power_of_two_falls_back(devices, S):
    """jax-tpu-embedding's own input preprocessing aborts unless devices x SparseCores is a power of 2; such a
    plan ran its stacks on SparseCores all the same, in a layout and input jax-tpu-embedding never makes."""
    feats = [se.FeatureSpec("f", se.TableSpec("t", 50, 8), 24 * S)]
    with pytest.warns(UserWarning, match=rf"Stack 't'.*{devices} devices x {S} SparseCores = {devices * S} "
                                         "SparseCores are not a power of 2"):
        plan = se.plan(feats, make_mesh(devices), sparsecores=S)
    assert plan.stacks[0].sparsecores == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert se.plan(feats, make_mesh(4), sparsecores=S if S != 3 else 2).stacks[0].sparsecores


def test_a_column_placed_table_falls_back():
    with pytest.warns(UserWarning, match="Stack 't'.*placed 'column'"):
        plan = se.plan([se.FeatureSpec("f", se.TableSpec("t", 50, 16), 8)], make_mesh(2), sparsecores=2,
                       placement="column")
    assert plan.stacks[0].sparsecores == 0


@pytest.mark.parametrize("bad", [-1, True, 2.0, "2"])
def test_a_bad_sparsecore_count_is_an_error(bad):
    with pytest.raises(ValueError, match="sparsecores must be an int >= 0"):
        se.plan([se.FeatureSpec("f", se.TableSpec("t", 50, 8), 8)], make_mesh(2), sparsecores=bad)


def test_a_numpy_int_sparsecore_count_is_an_int():
    """np.int64(2) was refused: "sparsecores must be an int >= 0 ..., got np.int64(2)"."""
    feats = [se.FeatureSpec("f", se.TableSpec("t", 50, 8), 8)]
    plan = se.plan(feats, make_mesh(2), sparsecores=np.int64(2))
    assert plan == se.plan(feats, make_mesh(2), sparsecores=2) and type(plan.stacks[0].sparsecores) is int


def test_processes_whose_plans_differ_in_sparsecores_are_told():
    """The plans' fingerprint (compared at the processes' first exchange) and layout digest (which a checkpoint's
    capacity marks are restored by) left the SparseCores out: a process with sparsecores=2 and one with 4 (or none)
    passed the check, though their rows sit on other devices."""
    from sparse_embed.host import plan_state

    feats = [se.FeatureSpec("f", se.TableSpec("t", 1000, 8), 16)]
    plans = [se.plan(feats, make_mesh(2), sparsecores=s) for s in (0, 2, 4)]
    prints = [plan_state.fingerprint(p) for p in plans]
    assert prints[0] != prints[1] != prints[2] != prints[0]
    assert "('sparsecores', 2)" in prints[1][0]
    assert "sparsecores" not in prints[0][0]  # a plan without them keeps the digest its saved marks were stored by


def test_cpu_devices_have_no_sparsecores_by_default():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = se.plan([se.FeatureSpec("f", se.TableSpec("t", 50, 8), 8)], make_mesh(2))
    assert plan.stacks[0].sparsecores == 0 and plan.stacks[0].rows_per_shard == 25


@pytest.mark.parametrize("kind,want", [("TPU v5p", 4), ("TPU v5", 4), ("TPU v6 lite", 2), ("TPU v4", 0)])
def test_sparsecores_are_detected_from_the_tpu_kind(kind, want, monkeypatch):
    from types import SimpleNamespace

    from sparse_embed.core.sparsecore import layout as sparsecore

    tpu = [SimpleNamespace(platform="tpu", device_kind=kind)]
    assert sparsecore.detect(tpu) == want and sparsecore.count(None, tpu) == want
    monkeypatch.setattr(sparsecore, "available", lambda: False)
    if want:
        with pytest.warns(UserWarning, match=f"have {want} SparseCores per device, but jax-tpu-embedding is not"):
            assert sparsecore.count(None, tpu) == 0
    with pytest.raises(ImportError, match=r'pip install jax-tpu-embedding'):
        sparsecore.count(2, tpu)


def test_a_batch_without_its_csr_is_an_error():
    plan, _ = _plans(make_mesh(2), opt.SGD(0.1), 2, 16)
    batch, _ = se.preprocess(plan, *_ids(plan.features, 0))
    tables = se.init_tables(plan, jax.random.key(0))
    with pytest.raises(ValueError, match="Stack 'a_b' runs on SparseCores but its batch has no CSR"):
        se.lookup(plan, {**batch, "a_b": se.ShardedCooMatrix(*batch["a_b"][:5])}, tables)


def test_bad_ids_get_the_usual_errors():
    plan, _ = _plans(make_mesh(2), opt.SGD(0.1), 2, 16)
    ids, weights = _ids(plan.features, 0)
    ids["h"][0, 0] = 19  # the table has 19 rows
    with pytest.raises(ValueError, match="Feature 'h'"):
        se.preprocess(plan, ids, weights)
