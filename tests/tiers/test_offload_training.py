"""Offloaded tables (`TableSpec(storage=Offload(...))`, issue 42) train exactly as the same tables in memory.

Every test runs the same batches through two plans that differ only in `storage=`: the in-memory one (plain
`preprocess`) is the reference, the tiered one goes through `Tiers` (cache admissions, store reads, write-backs,
`flush`). The loss is linear in the activations (`sum(act * fixed cotangent)`), so a difference is a wrong row,
not amplified rounding. The caches are much smaller than the tables and the ids mix a hot Zipf head with a wide
uniform tail, so rows are evicted, written back, read again from the store, and re-admitted from evictions not
yet written back (`from_evicted`); `assert_churned` checks those counters, so no test passes on a cache that
holds everything. Under `prefetch` the writer thread's timing decides whether a re-admitted row comes from the
store or from an eviction not yet written, so the runs that assert both preprocess batches ahead by hand and
wait for the write-backs after each step (`settle`): a batch planned two swaps ahead takes the rows those swaps
evict from the device, and the rows evicted before from the store.

`test_numpy_reference` checks the tiered result against `tests/reference.py`'s numpy math, which shares no
code with sparse_embed; the other tests compare with in-memory training, itself checked against that
reference in tests/core.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference as ref
import sparse_embed as se
from conftest import assert_trained_equal, make_mesh

V, D, B, L = 2000, 8, 32, 4  # rows of each table, row width, batch, ids per sample
CACHE = 160  # cache rows: one batch reads ~100 distinct rows of a table, all batches ~1000
STEPS = 8


def _custom_rule(rows, slots, grads, step):
    count = slots["count"] + 1.0
    return rows - 0.05 * grads / count, {"count": count}


# Every public optimizer of sparse_embed.optimizers, with its table's combiner (sum and mean both covered).
OPTIMIZERS = {
    "sgd": (se.optimizers.SGD(0.1), "sum"),
    "adagrad": (se.optimizers.Adagrad(0.1), "mean"),
    "rowwise": (se.optimizers.RowwiseAdagrad(0.1), "sum"),
    "adam": (se.optimizers.Adam(0.01), "mean"),
    "adagrad_momentum": (se.optimizers.AdagradMomentum(0.05), "sum"),
    "ftrl": (se.optimizers.FTRL(0.1, l1=0.001, l2=0.01), "mean"),
    "laprop": (se.optimizers.LaProp(0.01), "sum"),
    "custom": (se.optimizers.Custom(_custom_rule, {"count": se.optimizers.SlotSpec(1, 0.0)}), "mean"),
}


@dataclasses.dataclass(frozen=True)
class Feat:
    """A feature of the test plans: the table it reads, and how its ids are drawn."""

    name: str
    table: str
    seq: int = 0  # max_sequence_length (0: pooled)
    weighted: bool = False


def make_specs(tables: dict[str, tuple], feats: list[Feat], root, cache_rows: int | dict = CACHE, *, tiered=None,
               dim: int = D) -> tuple[list[se.FeatureSpec], list[se.FeatureSpec]]:
    """`(in-memory features, tiered features)` of `tables = {name: (optimizer, combiner)}`: the second list's
    tables named in `tiered` (default: all) have `storage=Offload(root/name, cache_rows)` (`cache_rows`: one
    for all, or `{table: rows}` with a default under None)."""
    tiered = set(tables) if tiered is None else set(tiered)
    if not isinstance(cache_rows, dict):
        cache_rows = {None: cache_rows}
    out = []
    for store in (False, True):
        specs = {}
        for name, (opt, combiner) in tables.items():
            rows = cache_rows.get(name, cache_rows.get(None))
            storage = se.offload.Offload(os.path.join(root, name), rows) if store and name in tiered else None
            specs[name] = se.TableSpec(name, V, dim, optimizer=opt, combiner=combiner, storage=storage)
        out.append([se.FeatureSpec(f.name, specs[f.table], B, max_sequence_length=f.seq) for f in feats])
    return out[0], out[1]


def make_batches(feats: list[Feat], steps: int, seed: int = 1) -> list[dict]:
    """`[{"ids": {feature: [B, L]}, "weights": {feature: [B, L]}}]`: dense ids with -1 padding, from a Zipf head
    (hits) and a uniform tail (misses); weights for weighted features."""
    g = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ids, weights = {}, {}
        for f in feats:
            head = g.zipf(1.3, (B, L)) % V
            tail = g.integers(0, V, (B, L))
            x = np.where(g.random((B, L)) < 0.5, head, tail).astype(np.int64)
            x[:, 1:][g.random((B, L - 1)) < 0.2] = -1  # padding; every sample keeps its first id
            ids[f.name] = x
            if f.weighted:
                weights[f.name] = g.uniform(0.25, 2.0, (B, L)).astype(np.float32)
        out.append({"ids": ids, "weights": weights})
    return out


def inputs(b: dict):
    return b["ids"], b["weights"] or None


def cotangents(plan: se.EmbeddingPlan, seed: int = 2) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    out = {}
    for name, f in sorted(plan.features.items()):
        shape = (f.batch_size, f.max_sequence_length, f.table.embedding_dim) if f.max_sequence_length else \
            (f.batch_size, f.table.embedding_dim)
        out[name] = g.standard_normal(shape).astype(np.float32)
    return out


@functools.lru_cache(maxsize=None)
def train_step(plan: se.EmbeddingPlan):
    """`(tables, batch, step) -> (loss, tables')` for a loss linear in the activations (one per plan: tests with
    equal plans share its compilations)."""
    cts = {k: jnp.asarray(v) for k, v in cotangents(plan).items()}

    def loss(tables, batch, step):
        acts = se.lookup(plan, batch, tables, step)
        return sum(jnp.sum(acts[k] * cts[k]) for k in sorted(acts))

    return jax.jit(jax.value_and_grad(loss), donate_argnums=0)


def train_in_memory(features, mesh, batches, rng, *, snapshots=()):
    """Plain training: `(losses, {table: {"table": rows, slot: ...}})`, plus the states after the steps in
    `snapshots` (`{steps done: state}`) if asked."""
    plan = se.plan(features, mesh)
    tables = se.init_tables(plan, rng)
    step_fn = train_step(plan)
    losses, states = [], {}
    for i, b in enumerate(batches):
        batch, _ = se.preprocess(plan, *inputs(b))
        loss, tables = step_fn(tables, batch, i)
        losses.append(np.asarray(loss))
        if i + 1 in snapshots:
            states[i + 1] = se.unstack_state(plan, tables)
    state = se.unstack_state(plan, tables)
    return (losses, state, states) if snapshots else (losses, state)


def train_tiered(tiers, plan, tables, batches, *, start=0, buffer_size=None, ahead=0, step_fn=None,
                 on_step=None):
    """Trains `batches` (global steps `start`, ...) through `tiers`; returns `(losses, tables)`.

    `buffer_size`: through `tiers.prefetch(..., buffer_size)`; else `tiers.preprocess` by hand, `ahead` batches
    ahead of the swap. `on_step(tables, steps done) -> tables` runs after each step (e.g. a flush).
    """
    step_fn = step_fn or train_step(plan)
    losses = []

    def step(tables, i, batch, swap):
        tables = tiers.swap(tables, swap)
        loss, tables = step_fn(tables, batch, i)
        losses.append(np.asarray(loss))
        return on_step(tables, i + 1) if on_step else tables

    if buffer_size is not None:
        for i, item in enumerate(tiers.prefetch(batches, inputs=inputs, buffer_size=buffer_size), start):
            tables = step(tables, i, item.batch, item.swap)
        return losses, tables
    planned = collections.deque()
    for i, b in enumerate(batches, start):
        batch, _, swap = tiers.preprocess(*inputs(b))
        planned.append((i, batch, swap))
        if len(planned) > ahead:
            tables = step(tables, *planned.popleft())
    while planned:
        tables = step(tables, *planned.popleft())
    return losses, tables


def record_columns(table: se.TableSpec) -> list[str]:
    """A stored record's columns: the row, then the optimizer's slots in its order."""
    return ["table", *table.resolved_optimizer.slots(table.embedding_dim)]


def assert_equal(got, want, exact: bool = True, what: str = ""):
    """Bitwise (on CPUs: `assert_trained_equal`), or within float32 rounding of the values' magnitude."""
    got, want = np.asarray(got), np.asarray(want)
    if exact:
        assert_trained_equal(got, want, err_msg=what)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=what)


def assert_store_equals(tiers, state, touched, *, exact: bool = True):
    """The flushed store of every offloaded table holds `state` (`{table: {"table": rows, slot: ...}}`): it holds
    every row some batch `touched`, and every row it holds, read back with its checksum, equals `state`'s row
    and slots (a row it holds but no batch touched has its initial values)."""
    for name, t in tiers.tables.items():
        want = np.concatenate([state[name][k] for k in record_columns(t.spec)], axis=1)
        written = t.store.written.copy()
        missing = np.flatnonzero(touched[name] & ~written)
        assert missing.size == 0, f"table {name}: the store lacks touched rows {missing[:10]}"
        rows = np.flatnonzero(written)
        assert_equal(t.store.read(rows), want[rows], exact, f"table {name}: stored rows")


def assert_fresh_rows_equal(tiers, plan, tables, state, n: int = B * L):
    """Rows the store never wrote enter the cache (an eval batch of `n` of them per table, swapped in) with the
    values `state` has for them: the rows no batch touched, i.e. the initializer's rows and initial slots.
    Call after `flush`: nothing is written back. Returns the tables."""
    pick = {}
    for name, t in tiers.tables.items():
        never = np.flatnonzero(~t.store.written)
        pick[name] = never[np.linspace(0, never.size - 1, n).astype(np.int64)]
    ids = {f: pick[spec.table.name].reshape(B, -1) for f, spec in plan.features.items() if spec.table.name in pick}
    ids.update({f: np.zeros((B, 1), np.int64) for f in plan.features if f not in ids})
    written = {name: t.stats.rows_written for name, t in tiers.tables.items()}
    _, _, swap = tiers.preprocess(ids, train=False)
    tables = tiers.swap(tables, swap)
    cached = se.unstack_state(plan, tables)
    for name, t in tiers.tables.items():
        at = t.cache.map(pick[name])
        for k in record_columns(t.spec):
            assert_trained_equal(cached[name][k][at], state[name][k][pick[name]],
                                          err_msg=f"table {name}: never-written rows, {k}")
    tiers.wait()
    assert {name: t.stats.rows_written for name, t in tiers.tables.items()} == written
    return tables


def touched_rows(feats: list[Feat], batches) -> dict[str, np.ndarray]:
    """`{table: [V] bool}`: the rows some batch reads."""
    out = {}
    for f in feats:
        mask = out.setdefault(f.table, np.zeros(V, bool))
        for b in batches:
            x = b["ids"][f.name]
            mask[x[x >= 0]] = True
    return out


def assert_churned(tiers, *, settled: bool = True):
    """The caches were too small for the batches: rows were evicted (and written back), and evicted rows were
    needed again. `settled` (a run by hand, ahead of the swaps, that waits for the write-backs after each
    step): where those came from is then a function of the batches alone, and both sources occur - the store
    (`rows_read`), and evictions of swaps not yet run (`from_evicted`); else the writer's timing splits them."""
    for name, s in tiers.stats().items():
        assert s.hits > 0 and s.fresh > 0 and s.rows_written > 0 and s.rows_read + s.from_evicted > 0, (name, s)
        if settled:
            assert s.rows_read > 0 and s.from_evicted > 0, (name, s)
        assert s.misses == s.fresh + s.rows_read + s.from_evicted and 0 < s.hits < s.lookups, (name, s)


def settle(tiers):
    """An `on_step` that waits for the write-backs of the swaps run (see `assert_churned`)."""
    def on_step(tables, done):
        tiers.wait()
        return tables
    return on_step


def reset_stores(features):
    for f in features:
        if f.table.storage is not None:
            shutil.rmtree(f.table.storage.path, ignore_errors=True)


@pytest.fixture
def stores(tmp_path_factory):
    """`stores(name)`: an empty directory for the stores of one configuration, at the same path in every test
    of this process that names it, so their plans are equal and share compiled programs."""
    base = tmp_path_factory.getbasetemp() / "offload_stores"

    def root(name: str) -> str:
        path = base / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return str(path)

    return root


def data_file(t) -> bytes:
    """The raw bytes of a table's store records."""
    with open(os.path.join(t.store.path, "records", "c", "0", "0"), "rb") as f:
        return f.read()


# --------------------------------------------------------------------------------------------- the tests
# One offloaded table per public optimizer, and an ordinary table in memory. Three features share the Adagrad
# table (one weighted, one a sequence), two the SGD table (one weighted).
MAIN_TABLES = {**OPTIMIZERS, "plain": (se.optimizers.RowwiseAdagrad(0.1), "mean")}
MAIN_FEATS = [Feat(f"f_{n}", n) for n in OPTIMIZERS] + [
    Feat("w", "adagrad", weighted=True), Feat("seq", "adagrad", seq=L), Feat("weighted", "sgd", weighted=True),
    Feat("p", "plain")]
MAIN_CACHE = {None: CACHE, "adagrad": 3 * CACHE, "sgd": 2 * CACHE}


def test_every_public_optimizer_is_here():
    public = {getattr(se.optimizers, n) for n in se.optimizers.__all__}
    public = {o for o in public if isinstance(o, type) and issubclass(o, se.optimizers.Optimizer)}
    assert public - {se.optimizers.Optimizer} == {type(o) for o, _ in OPTIMIZERS.values()}


# The default kernel is native on CPU where it can (generic for Custom); generic everywhere on 2 devices.
@pytest.mark.parametrize("mesh, kernel", [(1, "auto"), (2, "generic"), (8, "auto")], indirect=["mesh"],
                         ids=["mesh1", "mesh2-generic", "mesh8"])
def test_every_optimizer(tmp_path, mesh, kernel, monkeypatch):
    """Each public optimizer's offloaded table, sum and mean combiners, weighted features, pooled and sequence
    features sharing an offloaded table, and an ordinary table in the same plan train as in memory on
    1, 2 and 8 devices: by hand two batches ahead, then under `prefetch` with look-ahead 1 and 3 (each from
    an empty store). Bitwise: every stored row and slot, the ordinary table, the rows never stored; the
    losses too on one device (on several, XLA may sum the batch in another order)."""
    if kernel == "auto":
        monkeypatch.delenv("SPARSE_EMBED_KERNEL", raising=False)
    else:
        monkeypatch.setenv("SPARSE_EMBED_KERNEL", kernel)
    batches = make_batches(MAIN_FEATS, STEPS)
    rng = jax.random.key(0)
    mem_f, tier_f = make_specs(MAIN_TABLES, MAIN_FEATS, str(tmp_path), MAIN_CACHE, tiered=OPTIMIZERS)
    mem_losses, state = train_in_memory(mem_f, mesh, batches, rng)
    touched = touched_rows(MAIN_FEATS, batches)
    exact = mesh.devices.size == 1
    plan = se.plan(tier_f, mesh)
    assert sorted(t.name for t in plan.tiered) == sorted(OPTIMIZERS)
    for run in [dict(ahead=2), dict(buffer_size=1), dict(buffer_size=3)]:
        reset_stores(tier_f)
        tiers = se.offload.Tiers(plan, rng)
        try:
            if "ahead" in run:
                run["on_step"] = settle(tiers)
            losses, tables = train_tiered(tiers, plan, se.init_tables(plan, rng), batches, **run)
            tables = tiers.flush(tables, len(batches))
            assert_churned(tiers, settled="ahead" in run)
            assert_equal(losses, mem_losses, exact, f"{run}: losses")
            assert_store_equals(tiers, state, touched)
            plain = se.unstack_state(plan, tables)["plain"]
            for k in ("table", "accumulator"):
                assert_trained_equal(plain[k], state["plain"][k], err_msg=f"the in-memory table: {k}")
            if "ahead" in run:
                assert_fresh_rows_equal(tiers, plan, tables, state)
        finally:
            tiers.close()


# A small configuration the remaining tests share (`stores("small")`: equal plans, compiled once): Adagrad,
# SGD read by two features (one weighted, sum) and Adam (its bias correction counts the global step).
SMALL_TABLES = {"adagrad": (se.optimizers.Adagrad(0.1), "mean"), "sgd": (se.optimizers.SGD(0.1), "sum"),
                "adam": (se.optimizers.Adam(0.01), "mean")}
SMALL_FEATS = [Feat("f", "adagrad"), Feat("g", "sgd", weighted=True), Feat("h", "sgd"), Feat("a", "adam")]
SMALL_CACHE = {None: CACHE, "sgd": 2 * CACHE}


def small(stores, steps: int = STEPS, seed: int = 8):
    """`(batches, in-memory features, tiered features, tiered plan)` of the small configuration on one device."""
    batches = make_batches(SMALL_FEATS, steps, seed=seed)
    mem_f, tier_f = make_specs(SMALL_TABLES, SMALL_FEATS, stores("small"), SMALL_CACHE)
    return batches, mem_f, tier_f, se.plan(tier_f, make_mesh(1))


def _samples(b: dict, feature: str) -> ref.Samples:
    ids, w = b["ids"][feature], b["weights"].get(feature)
    return [[(int(i), 1.0 if w is None else float(w[s, j])) for j, i in enumerate(row) if i >= 0]
            for s, row in enumerate(ids)]


def test_numpy_reference(stores):
    """The tiered result equals `tests/reference.py`'s dense numpy training (float64) of the same batches from
    the same initial rows: SGD (two features, one weighted, sum), Adagrad and Adam (mean)."""
    updates = {"sgd": (ref.sgd, 0.1), "adagrad": (ref.adagrad, 0.1), "adam": (ref.adam(0.9, 0.999, 1e-8), 0.01)}
    batches, mem_f, tier_f, plan = small(stores, steps=4)
    rng = jax.random.key(2)
    mem_plan = se.plan(mem_f, make_mesh(1))
    want = {n: {k: v.astype(np.float64) for k, v in s.items()}
            for n, s in se.unstack_state(mem_plan, se.init_tables(mem_plan, rng)).items()}
    cts = cotangents(mem_plan)
    for i, b in enumerate(batches):
        for name, (update, lr) in updates.items():
            grads = {}
            for f in SMALL_FEATS:
                if f.table == name:
                    combiner = SMALL_TABLES[name][1]
                    for r, g in ref.row_grads(want[name]["table"], _samples(b, f.name), cts[f.name],
                                              combiner=combiner).items():
                        grads[r] = grads.get(r, 0.0) + g
            ref.apply(update, want[name], grads, lr, step=i)

    tiers = se.offload.Tiers(plan, rng)
    try:
        _, out = train_tiered(tiers, plan, se.init_tables(plan, rng), batches, ahead=1)
        tiers.flush(out, len(batches))
        assert all(s.misses > 0 and s.rows_written > 0 for s in tiers.stats().values())
        assert_store_equals(tiers, want, touched_rows(SMALL_FEATS, batches), exact=False)
    finally:
        tiers.close()


def test_eval_batches_change_nothing(stores):
    """Eval batches (`train=False`, through `preprocess` and `prefetch`) look up the trained rows (equal
    activations), change no stored row and write nothing back (after a flush: the store's file is unchanged,
    and a second flush writes nothing), and training continues as if they had not run."""
    train, mem_f, tier_f, plan = small(stores, steps=6, seed=5)
    evals = make_batches(SMALL_FEATS, 4, seed=6)
    rng = jax.random.key(3)
    phases = [(0, 2), (2, 3), (3, 6)]  # train steps [lo, hi), two eval batches after each phase but the last

    def run(plan, tables, train_one, evaluate):
        step_fn = train_step(plan)
        look = jax.jit(lambda tables, batch: se.lookup(plan, batch, tables, 0))
        losses, acts = [], []
        for k, (lo, hi) in enumerate(phases):
            for i in range(lo, hi):
                tables, loss = train_one(tables, train[i], step_fn, i)
                losses.append(loss)
            if k < len(phases) - 1:
                tables, out = evaluate(tables, evals[2 * k: 2 * k + 2], look, k)
                acts.extend(out)
        return losses, acts, tables

    mem_plan = se.plan(mem_f, make_mesh(1))

    def mem_train(tables, b, fn, i):
        loss, tables = fn(tables, se.preprocess(mem_plan, *inputs(b))[0], i)
        return tables, np.asarray(loss)

    def mem_eval(tables, bs, fn, k):
        return tables, [jax.tree.map(np.asarray, fn(tables, se.preprocess(mem_plan, *inputs(b))[0])) for b in bs]

    mem_losses, mem_acts, mem_tables = run(mem_plan, se.init_tables(mem_plan, rng), mem_train, mem_eval)
    state = se.unstack_state(mem_plan, mem_tables)

    tiers = se.offload.Tiers(plan, rng)
    seen = {}

    def tier_train(tables, b, fn, i):
        batch, _, swap = tiers.preprocess(*inputs(b))
        tables = tiers.swap(tables, swap)
        loss, tables = fn(tables, batch, i)
        if i == 2:  # the store now holds the state after 3 steps; the evals after it must leave it so
            tables = tiers.flush(tables, 3)
            seen.update(data={n: data_file(t) for n, t in tiers.tables.items()},
                        written={n: t.store.written.copy() for n, t in tiers.tables.items()}, stats=tiers.stats())
        return tables, np.asarray(loss)

    def tier_eval(tables, bs, fn, k):
        out = []
        batch, _, swap = tiers.preprocess(*inputs(bs[0]), train=False)
        tables = tiers.swap(tables, swap)
        out.append(jax.tree.map(np.asarray, fn(tables, batch)))
        for item in tiers.prefetch(bs[1:], inputs=inputs, train=False, buffer_size=1):
            tables = tiers.swap(tables, item.swap)
            out.append(jax.tree.map(np.asarray, fn(tables, item.batch)))
        if k == 1:  # the evals after the flush
            tiers.wait()
            for n, t in tiers.tables.items():
                s, s0 = t.stats, seen["stats"][n]
                assert s.rows_written == s0.rows_written and s.misses > s0.misses, (n, s, s0)
                np.testing.assert_array_equal(t.store.written, seen["written"][n])
                assert data_file(t) == seen["data"][n], f"table {n}: an eval batch changed the store"
            tables = tiers.flush(tables, 3)  # nothing to write: the evals changed no cached row
            for n, t in tiers.tables.items():
                assert tiers.stats()[n].rows_written == seen["stats"][n].rows_written
                assert data_file(t) == seen["data"][n]
        return tables, out

    try:
        losses, acts, tables = run(plan, se.init_tables(plan, rng), tier_train, tier_eval)
        tiers.flush(tables, len(train))
        assert_equal(losses, mem_losses, what="losses")
        assert len(acts) == len(mem_acts) == 4
        for got, want in zip(acts, mem_acts):
            for k in want:
                assert_trained_equal(got[k], want[k], err_msg=f"eval activations of {k}")
        assert_store_equals(tiers, state, touched_rows(SMALL_FEATS, train))
    finally:
        tiers.close()


def test_reopen_continues(stores):
    """Train, flush, close; a new `Tiers` over the same stores (a new, empty cache) continues from the stored
    rows and slots (and Adam's step count), and the whole run equals in-memory training over all batches."""
    batches, mem_f, tier_f, plan = small(stores, seed=7)
    rng = jax.random.key(4)
    mem_losses, state = train_in_memory(mem_f, make_mesh(1), batches, rng)

    tiers = se.offload.Tiers(plan, rng)
    losses, out = train_tiered(tiers, plan, se.init_tables(plan, rng), batches[:4], ahead=1)
    tiers.flush(out, 4)
    tiers.close()

    tiers = se.offload.Tiers(plan, rng)
    try:
        assert all(t.store.step == 4 and t.store.written.any() for t in tiers.tables.values())
        more, out = train_tiered(tiers, plan, se.init_tables(plan, rng), batches[4:], start=4, buffer_size=2)
        out = tiers.flush(out, len(batches))
        assert all(s.rows_read > 0 for s in tiers.stats().values()), tiers.stats()
        assert_equal(losses + more, mem_losses, what="losses")
        assert_store_equals(tiers, state, touched_rows(SMALL_FEATS, batches))
        assert_fresh_rows_equal(tiers, plan, out, state)
    finally:
        tiers.close()


@pytest.mark.parametrize("run", [dict(ahead=2), dict(buffer_size=3)], ids=["ahead2", "prefetch3"])
def test_flush_with_batches_planned_ahead(stores, run):
    """`flush` in the loop (before a checkpoint) while later batches are already planned (by hand, or by
    `prefetch`'s worker): the store then holds exactly the state after the steps run so far, the loop goes
    on, and no later update is lost."""
    batches, mem_f, tier_f, plan = small(stores)
    rng = jax.random.key(5)
    mem_losses, state, states = train_in_memory(mem_f, make_mesh(1), batches, rng, snapshots=(2, 5))
    tiers = se.offload.Tiers(plan, rng)
    checked = []

    def on_step(tables, done):
        if done in states:
            tables = tiers.flush(tables, done)
            assert all(t.store.step == done for t in tiers.tables.values())
            assert_store_equals(tiers, states[done], touched_rows(SMALL_FEATS, batches[:done]))
            checked.append(done)
        return tables

    try:
        losses, out = train_tiered(tiers, plan, se.init_tables(plan, rng), batches, on_step=on_step, **run)
        tiers.flush(out, len(batches))
        assert checked == [2, 5]
        assert_equal(losses, mem_losses, what="losses")
        assert_store_equals(tiers, state, touched_rows(SMALL_FEATS, batches))
    finally:
        tiers.close()


def test_a_loop_that_stops_early(stores):
    """A prefetch loop left early (`break`, the prefetcher closed) drops the batches its worker had prepared:
    a flush then stores the state of the steps run, and training goes on with new batches exactly as in memory
    without the dropped ones."""
    batches, mem_f, tier_f, plan = small(stores)
    rng = jax.random.key(5)
    trained = batches[:3] + batches[6:]
    mem_losses, state, states = train_in_memory(mem_f, make_mesh(1), trained, rng, snapshots=(3,))
    step_fn = train_step(plan)
    tiers = se.offload.Tiers(plan, rng)
    try:
        out, losses = se.init_tables(plan, rng), []
        with tiers.prefetch(batches[:6], inputs=inputs, buffer_size=3) as items:
            for i, item in enumerate(items):
                out = tiers.swap(out, item.swap)
                loss, out = step_fn(out, item.batch, i)
                losses.append(np.asarray(loss))
                if i == 2:
                    break
        out = tiers.flush(out, 3)
        assert_store_equals(tiers, states[3], touched_rows(SMALL_FEATS, batches[:3]))
        more, out = train_tiered(tiers, plan, out, batches[6:], start=3, buffer_size=2)
        tiers.flush(out, len(trained))
        assert_equal(losses + more, mem_losses, what="losses")
        assert_store_equals(tiers, state, touched_rows(SMALL_FEATS, trained))
    finally:
        tiers.close()
