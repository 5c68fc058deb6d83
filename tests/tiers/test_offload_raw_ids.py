"""Offloaded raw-id tables (`TableSpec(dynamic=..., storage=Offload(...))`, issue 42) train exactly as in memory.

The same batches of raw 64-bit ids train two plans that differ only in `storage=`: in memory (`preprocess`, then
`map_ids` and `lookup` in the train step) and offloaded (`Tiers` maps the ids with the same map ahead of the step,
caches and stores the rows it gives). The tables' maps fill up (capacity below the ids seen), so new ids evict
the least recently used, wait for admission or expire, as each table's policy says; the caches are much smaller
than the tables, so rows are evicted, written back and read again. Compared bitwise: each batch's
`IdMapStats`, the maps' arrays, and every row the store holds (a row's values are its last id's, as in memory);
the losses bitwise on one device, to float32 rounding on several (as for static tables).
The plans also hold an in-memory raw-id table, a static table in memory and a static table offloaded.
"""

from __future__ import annotations

import collections
import functools
import os
import shutil

import jax
import numpy as np
import pytest

import sparse_embed as se
from sparse_embed.core.id_maps import IdMapStats
from sparse_embed.io.id_tables import _live
from tests.conftest import assert_trained_equal, make_mesh
from tests.tiers.multiprocess.offload_scenario import linear_step

V, D, B, L = 240, 8, 16, 4  # a raw-id table's rows (its map's capacity), row width, batch, ids per sample
VS = 400  # rows of the static tables
CACHE = 128  # cache rows (spread over the shards)
SPACE = 1500  # distinct raw ids the batches draw from: a Zipf head, and a tail that widens step by step
STEPS = 10
IDS = np.random.default_rng(99).integers(0, 2**40, SPACE)

# name: (optimizer, combiner, Dynamic policy or None: static, offloaded, cache rows)
TABLES = {
    "adagrad": (se.optimizers.Adagrad(0.1), "mean", se.Dynamic(), True, 200),
    "sgd": (se.optimizers.SGD(0.1), "sum", se.Dynamic(admit_after=2, expire_after=3, default=0.25), True, CACHE),
    "adam": (se.optimizers.Adam(0.01), "mean", se.Dynamic(expire_after=4, id_bits=40), True, 160),
    "ftrl": (se.optimizers.FTRL(0.1, l1=0.001, l2=0.01), "sum", se.Dynamic(admit_after=2, pending_capacity=8),
             True, CACHE),
    "memraw": (se.optimizers.RowwiseAdagrad(0.1), "mean", se.Dynamic(), False, 0),
    "static": (se.optimizers.SGD(0.1), "sum", None, True, CACHE),
    "plain": (se.optimizers.RowwiseAdagrad(0.1), "mean", None, False, 0),
}
RAW = [n for n, t in TABLES.items() if t[2] is not None and t[3]]  # the offloaded raw-id tables
# (feature, table, max_sequence_length, weighted)
FEATS = [("a", "adagrad", 0, False), ("aw", "adagrad", 0, True), ("aseq", "adagrad", L, False),
         ("s", "sgd", 0, True), ("m", "adam", 0, False), ("f", "ftrl", 0, False), ("r", "memraw", 0, False),
         ("st", "static", 0, False), ("p", "plain", 0, False)]


def features(root: str | None, tables=TABLES, cache: dict | None = None) -> list[se.FeatureSpec]:
    """The features; with `root`, the tables marked offloaded keep their rows under `root/<table>`."""
    specs = {}
    for name, (opt, combiner, dyn, offloaded, rows) in tables.items():
        rows = (cache or {}).get(name, rows)
        storage = se.offload.Offload(os.path.join(root, name), rows) if root and offloaded else None
        specs[name] = se.TableSpec(name, V if dyn else VS, D, optimizer=opt, combiner=combiner, dynamic=dyn,
                                   storage=storage)
    return [se.FeatureSpec(f, specs[t], B, max_sequence_length=seq) for f, t, seq, _ in FEATS if t in tables]


def batches(steps: int = STEPS, seed: int = 1, tables=TABLES) -> list[tuple[dict, dict]]:
    """`(ids, weights)` per step: raw ids from a Zipf head and a tail of ever newer ids (static tables: rows),
    -1 padding."""
    g = np.random.default_rng(seed)
    out = []
    for i in range(steps):
        ids, weights = {}, {}
        for f, t, _, weighted in FEATS:
            if t not in tables:
                continue
            n = SPACE if tables[t][2] is not None else VS
            tail = g.integers(0, min(n, 120 * (i + 1)), (B, L))
            k = np.where(g.random((B, L)) < 0.5, g.zipf(1.3, (B, L)) % n, tail)
            x = (IDS[k] if tables[t][2] is not None else k).astype(np.int64)
            x[:, 1:][g.random((B, L - 1)) < 0.2] = -1
            ids[f] = x
            if weighted:
                weights[f] = g.uniform(0.25, 2.0, (B, L)).astype(np.float32)
        out.append((ids, weights))
    return out


@functools.lru_cache(maxsize=None)
def step_fn(plan: se.EmbeddingPlan):
    """`(tables, id_maps, batch, step) -> (loss, tables, id_maps, id_stats)`, one per plan."""
    return linear_step(plan, FEATS, B, D)


def host_stats(stats) -> dict:
    return {k: tuple(int(np.asarray(x)) for x in s) for k, s in stats.items()}


def train_in_memory(mesh, data, rng, snapshot: int | None = None):
    """`(losses, [{table: stats}], state, maps)` of plain training (`maps["memraw"]`: that table's `IdTable`);
    with `snapshot`, also `(state, maps)` after that many steps."""
    plan = se.plan(features(None), mesh)
    tables, maps, fn = se.init_tables(plan, rng), se.init_id_maps(plan, rng), step_fn(plan)
    losses, stats, snap = [], [], None
    for i, (ids, w) in enumerate(data):
        batch, _ = se.preprocess(plan, ids, w)
        loss, tables, maps, st = fn(tables, maps, batch, i)
        losses.append(np.asarray(loss))
        stats.append(host_stats(st))
        if i + 1 == snapshot:
            snap = (se.unstack_state(plan, tables), jax.tree.map(np.asarray, maps))
    contents = se.raw_ids.id_table_contents(plan, tables, maps)["memraw"]
    out = (losses, stats, se.unstack_state(plan, tables), {**jax.tree.map(np.asarray, maps), "memraw": contents})
    return out + (snap,) if snapshot else out


def train_tiered(tiers, plan, tables, maps, data, *, start=0, ahead=0, buffer_size=None, settle=False):
    """Trains `data` (steps `start`, ...) through `tiers`: `(losses, [{table: stats}], tables, maps)`, by hand
    `ahead` batches ahead of the swaps (waiting for the write-backs after each step when `settle`), or through
    `prefetch(buffer_size)`."""
    fn, losses, stats = step_fn(plan), [], []

    def step(tables, maps, i, batch, swap):
        loss, tables, maps, st = fn(tiers.swap(tables, swap), maps, batch, i)
        losses.append(np.asarray(loss))
        stats.append({**host_stats(st), **{k: tuple(v) for k, v in swap.id_stats.items()}})
        if settle:
            tiers.wait()
        return tables, maps

    if buffer_size is not None:
        for i, item in enumerate(tiers.prefetch(data, inputs=lambda b: b, buffer_size=buffer_size, step=start),
                                 start):
            tables, maps = step(tables, maps, i, item.batch, item.swap)
        return losses, stats, tables, maps
    planned = collections.deque()
    for i, (ids, w) in enumerate(data, start):
        batch, _, swap = tiers.preprocess(ids, w, step=i)
        planned.append((i, batch, swap))
        if len(planned) > ahead:
            tables, maps = step(tables, maps, *planned.popleft())
    while planned:
        tables, maps = step(tables, maps, *planned.popleft())
    return losses, stats, tables, maps


def table_rows(m) -> np.ndarray:
    """The table rows of a map's live ids (row `r` of shard `s`: `r * S + s`, the unstacked table's order)."""
    at, _ = _live(m.rows)
    S = m.seed.shape[0]
    R = m.rows.order.shape[0] // S
    return (at % R) * S + at // R


def assert_as_in_memory(tiers, state, maps, *, what=""):
    """After a flush: each offloaded raw-id table's map equals the in-memory one bitwise, the store holds every
    live id's row, and every stored row (and its slots) equals the in-memory table's row."""
    for name in RAW:
        t = tiers.tables[name]
        got, want = jax.tree.leaves(tiers._ids.swapped[name]), jax.tree.leaves(maps[name])
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{what}: table {name}: its map")
        live = table_rows(maps[name])
        assert live.size and t.store.written[live].all(), f"{what}: table {name}: live rows not stored"
        rows = np.flatnonzero(t.store.written)
        cols = ["table", *t.spec.resolved_optimizer.slots(D)]
        want = np.concatenate([state[name][k] for k in cols], 1)[rows]
        assert_trained_equal(t.store.read(rows), want, err_msg=f"{what}: table {name}: stored rows")
    for name in ("static",):
        t = tiers.tables[name]
        rows = np.flatnonzero(t.store.written)
        assert_trained_equal(t.store.read(rows)[:, :D], state[name]["table"][rows], err_msg=name)


def assert_losses(got, want, mesh, what=""):
    """Bitwise on one device; on several, XLA may add the batch's losses up in another order (the plans' stacks
    differ in size): to float32 rounding. The rows, slots and maps are bitwise on any mesh of CPUs."""
    if mesh.devices.size == 1:
        assert_trained_equal(got, want, err_msg=what)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=what)


def assert_policies_applied(stats):
    """The maps filled up and their policies applied (summed over the steps)."""
    total = {n: dict(zip(IdMapStats._fields, np.sum([s[n] for s in stats], 0))) for n in stats[0]}
    for n in ("adagrad", "adam", "memraw"):  # full: new ids evict the least recently used
        assert total[n]["admitted"] > V and total[n]["evicted"] > 0, (n, total[n])
    assert total["sgd"]["expired"] > 0 and total["adam"]["expired"] > 0, total
    assert total["sgd"]["waiting"] > 0 and total["ftrl"]["forgotten"] > 0, total


def fresh_tiers(plan, rng):
    """A Tiers over empty stores (what a run before left is removed)."""
    for spec in plan.tiered:
        shutil.rmtree(spec.storage.path, ignore_errors=True)
    return se.offload.Tiers(plan, rng)


def assert_churned(tiers):
    """Rows were evicted, written back and brought in again (the tables whose maps fill up: the others, whose
    ids mostly wait for admission, hold fewer rows than their caches)."""
    for name, s in tiers.stats().items():
        assert s.hits > 0 and s.fresh > 0 and s.rows_written > 0, (name, s)
        assert s.misses == s.fresh + s.rows_read + s.from_evicted and 0 < s.hits < s.lookups, (name, s)
        assert name in ("sgd", "ftrl") or s.rows_read + s.from_evicted > 0, (name, s)


@pytest.mark.parametrize("mesh, kernel", [(1, "auto"), (2, "generic"), (8, "auto")], indirect=["mesh"],
                         ids=["mesh1", "mesh2-generic", "mesh8"])
def test_raw_id_tables_train_as_in_memory(tmp_path, mesh, kernel, monkeypatch):
    """Offloaded raw-id tables (Adagrad with a weighted and a sequence feature, SGD waiting for two occurrences
    with expiry and a default vector, Adam with expiry and 4-byte keys, FTRL with a small pending set) beside an
    in-memory raw-id table and static tables (one offloaded) train as in memory on 1, 2 and 8 devices, by hand
    two batches ahead (and on one device under `prefetch`): bitwise id stats, maps and stored rows (losses: see `assert_losses`)."""
    if kernel == "auto":
        monkeypatch.delenv("SPARSE_EMBED_KERNEL", raising=False)
    else:
        monkeypatch.setenv("SPARSE_EMBED_KERNEL", kernel)
    data, rng = batches(), jax.random.key(0)
    losses, stats, state, maps = train_in_memory(mesh, data, rng)
    assert_policies_applied(stats)
    plan = se.plan(features(str(tmp_path)), mesh)
    runs = [dict(ahead=2, settle=True)] + [dict(buffer_size=2)] * (mesh.devices.size == 1)  # (threads: any mesh)
    for run in runs:
        tiers = fresh_tiers(plan, rng)
        try:
            got, got_stats, tables, _ = train_tiered(tiers, plan, se.init_tables(plan, rng),
                                                     se.init_id_maps(plan, rng), data, **run)
            tables = tiers.flush(tables, STEPS)
            assert_churned(tiers)
            assert_losses(got, losses, mesh, what=f"{run}: losses")
            assert got_stats == stats, run
            assert_as_in_memory(tiers, state, maps, what=str(run))
            out = se.unstack_state(plan, tables)
            for name in ("plain", "memraw"):
                for k, v in out[name].items():
                    assert_trained_equal(v, state[name][k], err_msg=f"{run}: {name}/{k}")
        finally:
            tiers.close()


def test_checkpoint_restored_mid_run_trains_on_as_in_memory(tmp_path):
    """Flushed and saved at step 4 (`CheckpointManager.save(..., tiers=, id_maps=)`), trained on and committed
    past it, then restored at 4 (each store, and so its id map, a commit back) and trained to the end through a
    new Tiers: the same maps, rows and id stats as an uninterrupted in-memory run (2 devices; the losses to
    float32 rounding)."""
    mesh, data, rng, at = make_mesh(2), batches(seed=3), jax.random.key(5), 4
    losses, stats, state, maps, (state4, maps4) = train_in_memory(mesh, data, rng, snapshot=at)
    plan, ckpt = se.plan(features(str(tmp_path / "stores")), mesh), str(tmp_path / "ckpt")
    tiers = se.offload.Tiers(plan, rng)
    with se.CheckpointManager(ckpt) as m:
        _, _, tables, id_maps = train_tiered(tiers, plan, se.init_tables(plan, rng), se.init_id_maps(plan, rng),
                                             data[:at], ahead=1)
        tables = tiers.flush(tables, at)
        assert_as_in_memory(tiers, state4, maps4, what="at the save")
        assert m.save(at, plan, tables, tiers=tiers, id_maps=id_maps)
        _, _, tables, id_maps = train_tiered(tiers, plan, tables, id_maps, data[at:at + 3], start=at, ahead=1)
        tiers.flush(tables, at + 3)
    tiers.close()

    with se.CheckpointManager(ckpt) as m:
        r = m.restore(plan, step=at)
    tiers = se.offload.Tiers(plan, rng)
    try:
        assert all(t.store.step == at for t in tiers.tables.values())
        for name in RAW:  # the map the store's commit holds
            for g, w in zip(jax.tree.leaves(tiers._ids.swapped[name]), jax.tree.leaves(maps4[name])):
                np.testing.assert_array_equal(np.asarray(g), w, err_msg=name)
        got, got_stats, tables, id_maps = train_tiered(tiers, plan, r.tables, r.id_maps, data[at:], start=at,
                                                       buffer_size=2)
        tables = tiers.flush(tables, STEPS)
        assert_losses(got, losses[at:], mesh)
        assert got_stats == stats[at:]
        assert all(s.rows_read > 0 for n, s in tiers.stats().items()), tiers.stats()
        assert_as_in_memory(tiers, state, maps, what="restored")
        got = se.raw_ids.id_table_contents(plan, tables, id_maps)["memraw"]  # (restored: its rows renumbered)
        for k in ("ids", "vectors", "last"):
            np.testing.assert_array_equal(getattr(got, k), getattr(maps["memraw"], k), err_msg=f"memraw: {k}")
    finally:
        tiers.close()


SMALL = {"adagrad": TABLES["adagrad"]}


def small_run(root: str, mesh, steps: int = 3, **kw):
    """`(plan, tiers)` of the Adagrad table alone, trained `steps` steps and flushed (the Tiers still open)."""
    plan = se.plan(features(root, SMALL, **kw), mesh)
    rng = jax.random.key(0)
    tiers = se.offload.Tiers(plan, rng)
    _, _, tables, _ = train_tiered(tiers, plan, se.init_tables(plan, rng), {}, batches(steps, tables=SMALL))
    tiers.flush(tables, steps)
    return plan, tiers


def test_bad_input(tmp_path):
    """Clear errors naming the table: a batch without its step; a shard's cache smaller than the rows a batch
    reads there (nothing changes: the next batch trains as if it had not come); a cache with fewer rows than
    shards; a damaged or missing id map; a store reopened on another mesh; the store-to-memory conversions and
    the store server, which do not carry the id map."""
    root = str(tmp_path / "s")
    plan, tiers = small_run(root, make_mesh(1))
    try:
        with pytest.raises(ValueError, match=r"Tables \['adagrad'\] are keyed by raw ids .*step=step"):
            tiers.preprocess(batches(1, tables=SMALL)[0][0])
        with pytest.raises(ValueError, match=r"Feature 'a' \(table 'adagrad'\): id -5 .*out of range"):
            tiers.preprocess({**batches(1, tables=SMALL)[0][0], "a": np.full((B, L), -5, np.int64)}, step=3)
        # a step before the stores' commit (a resume handed step 0): the map's last uses would lie ahead of it
        with pytest.raises(ValueError, match=r"Tables \['adagrad'\]: a training batch at step 0 comes after step 3 "
                                             r"\(the stores' last commit"):
            tiers.preprocess(batches(1, tables=SMALL)[0][0], step=0)
        tiers.preprocess(batches(1, tables=SMALL)[0][0], step=0, train=False)  # evaluation: any step
        tiers.preprocess(batches(1, tables=SMALL)[0][0], step=5)
        with pytest.raises(ValueError, match=r"a training batch at step 4 comes after step 5"):
            tiers.preprocess(batches(1, tables=SMALL)[0][0], step=4)
    finally:
        tiers.close()
    spec = plan.tiered_tables["adagrad"]
    for call in (lambda: se.offload.store_state(spec, jax.random.key(0)), lambda: se.offload.write_store(spec, {}),
                 lambda: se.offload.StoreServer(spec.storage.path)):
        with pytest.raises(ValueError, match=r"Table 'adagrad'.* is keyed by raw ids"):
            call()
    with pytest.raises(ValueError, match=r"Table 'adagrad': its store's id map was saved on 1 shards .* this plan "
                                         r"has 2 shards"):
        se.offload.Tiers(se.plan(features(root, SMALL), make_mesh(2)), jax.random.key(0))
    path = os.path.join(spec.storage.path, "idmap.1.npz")
    with open(path, "r+b") as f:
        f.seek(-200, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-200, os.SEEK_END)
        f.write(bytes([byte ^ 0x10]))
    with pytest.raises(se.offload.CorruptStoreError, match=r"Table 'adagrad': the id map .*idmap\.1\.npz"):
        se.offload.Tiers(plan, jax.random.key(0))
    os.remove(path)
    with pytest.raises(se.offload.CorruptStoreError, match=r"Table 'adagrad': the store .* has no id map"):
        se.offload.Tiers(plan, jax.random.key(0))
    tiny = se.plan(features(str(tmp_path / "t"), SMALL, cache={"adagrad": 4}), make_mesh(8))
    with pytest.raises(ValueError, match=r"Table 'adagrad': its cache is spread over its 8 shards"):
        se.offload.Tiers(tiny, jax.random.key(0))


def test_a_full_disk_writing_the_id_map_names_the_table_and_the_flush_is_tried_again(tmp_path, monkeypatch):
    """A flush writes a raw-id table's map before its commit: a full disk there was a bare "[Errno 28] No space
    left on device"; it names the table now, and the flush tried again commits the map the swaps ran."""
    from sparse_embed.tiers.id_map import IdMaps
    root = str(tmp_path / "s")
    plan, tiers = small_run(root, make_mesh(1))
    save, calls = IdMaps.save, []

    def full(self, *args):
        calls.append(args)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return save(self, *args)

    monkeypatch.setattr(IdMaps, "save", full)
    try:
        _, _, tables, _ = train_tiered(tiers, plan, se.init_tables(plan, jax.random.key(0)), {},
                                       batches(2, seed=4, tables=SMALL), start=3)
        with pytest.raises(OSError, match=r"Table 'adagrad': the store at .* cannot take the rows written since its "
                                          r"last commit \(No space left on device\); it keeps its last commit "
                                          r"\(step 3\)\. Free space on its disk and flush again"):
            tiers.flush(tables, 5)
        tiers.flush(tables, 5)
        want = [np.asarray(x) for x in jax.tree.leaves(tiers._ids.swapped["adagrad"])]
    finally:
        tiers.close()
    tiers = se.offload.Tiers(plan, jax.random.key(0))
    try:
        assert tiers.tables["adagrad"].store.step == 5
        for g, w in zip(jax.tree.leaves(tiers._ids.swapped["adagrad"]), want):
            np.testing.assert_array_equal(np.asarray(g), w)
    finally:
        tiers.close()


def test_a_shard_cache_too_small_is_refused_and_changes_nothing(tmp_path):
    """A batch whose ids read more rows on one shard than that shard's share of the cache raises naming the
    table, the shard and the rows needed; the map and cache are unchanged: training goes on as in memory
    without it."""
    mesh, rng = make_mesh(2), jax.random.key(0)
    plan = se.plan(features(str(tmp_path), SMALL, cache={"adagrad": 160}), mesh)
    data = batches(4, tables=SMALL)
    big = {k: IDS[np.arange(i * B * L, (i + 1) * B * L)].reshape(B, L) for i, k in enumerate(data[1][0])}
    mem = se.plan(features(None, SMALL), mesh)
    tables, maps, fn = se.init_tables(mem, rng), se.init_id_maps(mem, rng), step_fn(mem)
    want = []
    for i, (ids, w) in enumerate(data):
        loss, tables, maps, _ = fn(tables, maps, se.preprocess(mem, ids, w)[0], i)
        want.append(np.asarray(loss))
    tiers = se.offload.Tiers(plan, rng)
    try:
        out, losses = se.init_tables(plan, rng), []
        for i, (ids, w) in enumerate(data):
            if i == 1:
                with pytest.raises(ValueError, match=r"Table 'adagrad': a batch reads \d+ distinct rows on shard \d of "
                                                     r"2, more than that shard's 80 cache rows .*at least \d+ rows"):
                    tiers.preprocess(big, data[1][1], step=1)
            batch, _, swap = tiers.preprocess(ids, w, step=i)
            loss, out, _, _ = step_fn(plan)(tiers.swap(out, swap), {}, batch, i)
            losses.append(np.asarray(loss))
        assert_trained_equal(losses, want)
    finally:
        tiers.close()
