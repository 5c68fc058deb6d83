"""Quantized serving tables and live updates, side by side in one run: the demo's model and a W1-sized table.

W1-sized: 8 tables x 1M rows x 64, one device, batches of 4096 samples x 20
ids per table (Zipf 1.05 ids for training, uniform for lookups). The demo:
`sparse_embed.examples.dlrm` trained `--demo-steps` steps. For each served
dtype (float32, bfloat16, int8, int4):

- memory: bytes of the served arrays (`load_serving`);
- lookups/s: samples a second of `serving_lookup` jitted over every table
  (median of `--reps` rounds that take the four dtypes in turn), and the
  process CPU time of one lookup (steadier on a shared machine);
- eval AUC of the demo served from each: its served tables, dequantized as
  `serving_lookup` reads them, put back into the model (AUC on the demo's
  held-out batches).

Live updates (int8): after the export, training goes on (SGD on Zipf ids
for W1, the demo's own loop), tracked by `sparse_embed.serving.Changes`; after
each of `--delta-steps` (1, 10, 100) steps a delta of every step since the
export is written, and its bytes (and what they were in format 1, ids
stored raw) and apply time (`apply_delta`, median of 3) are set against
the full export's bytes and a full re-export + reload of the last step.
Under load: `--threads` threads look up the W1-sized int8
tables while `--deltas` deltas apply, spread over `--load-seconds`; each
delta sets 1% of the rows (the ones looked up) to its version number, exact
in int8 (a constant row), so a lookup whose values are not all its
snapshot's version is a torn read.

    python benchmarks/serving_quant.py [--rows 1000000 --demo-steps 1000] [--out benchmarks/results/serving_quant.json]
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import sparse_embed as se  # noqa: E402
import sparse_embed.serving as ss  # noqa: E402
from benchmarks import measuring  # noqa: E402
from benchmarks.workload import id_sampler  # noqa: E402
from sparse_embed.io import delta_file  # noqa: E402
from sparse_embed.io.restoring import static_part  # noqa: E402

DTYPES = ("float32", "bfloat16", "int8", "int4")


def _disk_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _timed(fn, *args, **kw):
    t = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t


def _floats(a, dim: int) -> np.ndarray:
    """A served table as float32 rows, as `serving_lookup` reads it."""
    a = np.asarray(a)
    return ss.dequantize(a, dim) if a.dtype == np.uint8 else a.astype(np.float32)


def _served_features(features: dict, specs: dict) -> dict:
    return {n: se.FeatureSpec(n, specs[f.table.name], f.batch_size, max_sequence_length=f.max_sequence_length)
            for n, f in features.items()}


def _lookup_rates(features: dict, served: dict, ids: dict, reps: int) -> tuple[dict, dict]:
    """`({dtype: samples/s}, {dtype: CPU ms per lookup})` of `serving_lookup` on each dtype's tables, medians of
    `reps` rounds that take the dtypes in turn (so that the load of a shared machine falls on all alike)."""
    fn = jax.jit(lambda t, i: se.serving_lookup(features, t, i))
    for tables in served.values():
        jax.block_until_ready(fn(tables, ids))
    wall, cpu = {d: [] for d in served}, {d: [] for d in served}
    for _ in range(reps):
        for d, tables in served.items():
            w, c = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(tables, ids))
            wall[d].append(time.perf_counter() - w)
            cpu[d].append(time.process_time() - c)
    batch = next(iter(ids.values())).shape[0]
    return ({d: batch / statistics.median(t) for d, t in wall.items()},
            {d: statistics.median(t) * 1e3 for d, t in cpu.items()})


def _format1_bytes(delta: str) -> int:
    """The bytes the same delta took in format 1, which stored its ids raw (a static table's rows as int32), to
    within a few bytes of header."""
    header, arrays = delta_file.read(delta)
    out = _disk_bytes(delta)
    for name, a in arrays.items():
        if a.dtype == np.int64:  # the ids, stored as gaps now
            raw = a.size * (4 if header["tables"][name.split("/")[0]] == "rows" else 8)
            out += raw - len(delta_file.encode_ids(a))
    return out


def _delta_vs_full(base: str, delta: str, full: str, export_s: float) -> dict:
    """Bytes and seconds of applying `delta` to `base`'s snapshot, against the full export `full`."""
    snap = ss.load_snapshot(base)
    applies = [_timed(ss.apply_delta, snap, delta)[1] for _ in range(3)]
    _, reload_s = _timed(se.load_serving, full)
    out = {"delta_bytes": _disk_bytes(delta), "full_bytes": _disk_bytes(full), "apply_s": statistics.median(applies),
           "export_s": export_s, "reload_s": reload_s, "format1_bytes": _format1_bytes(delta)}
    out["bytes_ratio"] = out["delta_bytes"] / out["full_bytes"]
    out["time_ratio"] = out["apply_s"] / (export_s + reload_s)
    return out


def _horizons(args) -> list[int]:
    return sorted({int(h) for h in args.delta_steps.split(",")})


def _w1_plan(args) -> se.EmbeddingPlan:
    opt = se.optimizers.SGD(0.05)
    tables = [se.TableSpec(f"t{i}", args.rows, args.dim, optimizer=opt, combiner="sum") for i in range(args.tables)]
    feats = [se.FeatureSpec(f"f{i}", t, args.batch) for i, t in enumerate(tables)]
    return se.plan(feats, Mesh(np.array(jax.devices()[:1]), ("x",)), stacking=None)


def _fraction(plan, changes) -> float:
    """Rows (raw ids) touched, over the rows of every table."""
    return sum(changes.rows(t).size for t in plan.tables) / sum(t.vocabulary_size for t in plan.tables.values())


def _deltas(args, plan, base: str, where: str, segments):
    """Trains in `segments` (`(steps, run)` pairs: `run(steps)` trains and returns `(tables, id_maps, ids of each
    step)`); after each, writes the delta of every step since `base` (one tracker per horizon)."""
    trackers, out, done = {h: ss.Changes.since(base) for h in _horizons(args)}, {}, 0
    for h in _horizons(args):
        tables, id_maps, batches = segments(h - done)
        for ids in batches:
            trackers = {g: c.touched_ids(plan, ids) for g, c in trackers.items()}
        c, done = trackers.pop(h), h
        out[h] = (ss.export_delta(f"{where}_{h}", plan, tables, c, id_maps=id_maps or None)[0], _fraction(plan, c))
    return tables, id_maps, out


def _compare(base: str, full: str, export_s: float, deltas: dict) -> dict:
    return {str(h): {**_delta_vs_full(base, path, full, export_s), "touched_fraction": fraction}
            for h, (path, fraction) in deltas.items()}


def _w1_segments(args, plan, tables):
    """`run(steps)` for `_deltas`: SGD steps of the W1 plan on Zipf ids."""
    @functools.partial(jax.jit, donate_argnums=0)  # the tables are updated in place
    def step(tables, batch, step):
        return jax.grad(lambda t: sum(jnp.sum(jnp.sin(x)) for x in se.lookup(plan, batch, t, step).values()))(tables)

    rng, sample, state = np.random.default_rng(1), id_sampler(args.rows, 1.05), {"tables": tables, "step": 0}

    def run(steps: int):
        batches = [{f"f{i}": sample(rng, (args.batch, args.ids)) for i in range(args.tables)} for _ in range(steps)]
        for ids in batches:
            state["tables"] = step(state["tables"], se.preprocess(plan, ids)[0], state["step"])
            state["step"] += 1
        return state["tables"], {}, batches

    return run


def w1(args, work: str) -> dict:
    """The W1-sized table: memory and lookups/s of each dtype; int8 deltas after `--delta-steps` steps."""
    plan = _w1_plan(args)
    tables = se.init_tables(plan, jax.random.key(0))
    rng = np.random.default_rng(0)
    ids = {f"f{i}": rng.integers(0, args.rows, (args.batch, args.ids), dtype=np.int32) for i in range(args.tables)}
    out: dict = {"export_s": {}}
    for dtype in DTYPES:
        _, out["export_s"][dtype] = _timed(se.export_serving, os.path.join(work, f"w1_{dtype}"), plan, tables,
                                           dtype=dtype)
    del tables  # the four served copies next, side by side
    served = {d: se.load_serving(os.path.join(work, f"w1_{d}")) for d in DTYPES}
    out["memory"] = {d: sum(a.nbytes for a in t.values()) for d, (t, _) in served.items()}
    features = _served_features(plan.features, served["float32"][1])
    out["lookups_per_s"], out["lookup_cpu_ms"] = _lookup_rates(features, {d: t for d, (t, _) in served.items()}, ids,
                                                                args.reps)
    del served
    tables = se.init_tables(plan, jax.random.key(0))  # as exported
    base, full = os.path.join(work, "w1_int8"), os.path.join(work, "w1_int8_full")
    tables, _, deltas = _deltas(args, plan, base, os.path.join(work, "w1_deltas"), _w1_segments(args, plan, tables))
    _, export_s = _timed(se.export_serving, full, plan, tables, dtype="int8")
    out["delta"] = _compare(base, full, export_s, deltas)
    return out


def _served_params(plan, params, id_maps, served: dict):
    """The demo's params and id maps with its tables replaced by the served ones, dequantized."""
    tables = dict(params["embed"]["tables"])
    static = static_part(plan)
    floats = {n: _floats(a, plan.tables[n].embedding_dim) for n, a in served.items() if not isinstance(a, tuple)}
    tables.update(se.stack_tables(static, floats))
    maps = dict(id_maps)
    for name, (ids, a) in ((n, a) for n, a in served.items() if isinstance(a, tuple)):
        contents = se.raw_ids.id_table_contents(plan, params["embed"]["tables"], id_maps)[name]
        assert np.array_equal(contents.ids, ids), name
        contents = contents._replace(vectors=_floats(a, plan.tables[name].embedding_dim)[: ids.size])
        raw_tables, raw_maps = se.raw_ids.load_id_tables(plan, {name: contents})
        tables.update(raw_tables)
        maps.update(raw_maps)
    return {**params, "embed": {**params["embed"], "tables": tables}}, maps


def _demo_trainer(dlrm, dargs, built):
    """`run(steps)` for `_deltas`, and its state: the demo's train step (compiled once), on the batches
    `dlrm.train` would draw (step i from seed [seed, 1, i]), steps counted on across calls."""
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    teacher, plan, model, params, id_maps, layout, _ = built
    tx = se.optax_tx(optax.adam(dargs.dense_lr))
    opt_sharding = layout.shardings(jax.eval_shape(tx.init, params))
    shardings = dlrm.Shardings(layout.shardings(params), opt_sharding, plan.batch_sharding(),
                               NamedSharding(plan.mesh, PartitionSpec()))
    train_step = dlrm.make_train_step(model, tx, shardings)
    state = {"params": params, "opt": jax.jit(tx.init, out_shardings=opt_sharding)(params), "maps": id_maps,
             "step": 0}

    def run(steps: int):
        seen = []
        for _ in range(steps):
            ex = teacher.sample(np.random.default_rng([dargs.seed, 1, state["step"]]), dargs.batch_size)
            b = dlrm.to_batch(plan, ex, *se.preprocess(plan, ex.ids, ex.weights))
            state["params"], state["opt"], state["maps"], _ = train_step(
                state["params"], state["opt"], state["maps"], b.sparse, b.inputs, jnp.asarray(state["step"], jnp.int32))
            state["step"] += 1
            seen.append(ex.ids)
        return state["params"]["embed"]["tables"], state["maps"], seen

    return run, state


def demo(args, work: str) -> dict:
    """The demo: eval AUC served from each dtype; int8 deltas after `--delta-steps` more training steps."""
    from sparse_embed.examples import dlrm

    dargs = dlrm.parse_args(["--steps", str(args.demo_steps), "--batch-size", str(args.demo_batch), "--no-progress",
                             *args.demo_args.split()])
    built = dlrm.build(dargs)
    plan, model, eval_batches = built[1], built[2], built[6]
    run, state = _demo_trainer(dlrm, dargs, built)
    embed, maps, _ = run(args.demo_steps)
    predict = dlrm.make_predict(model)
    out: dict = {"steps": args.demo_steps, "memory": {},
                 "auc": {"trained": dlrm.score(predict, state["params"], maps, eval_batches)[0]}}
    for dtype in DTYPES:
        path = os.path.join(work, f"demo_{dtype}")
        se.export_serving(path, plan, embed, id_maps=maps or None, dtype=dtype)
        served, _ = se.load_serving(path)
        out["memory"][dtype] = sum((a[1] if isinstance(a, tuple) else a).nbytes for a in served.values())
        p, m = _served_params(plan, state["params"], maps, served)
        out["auc"][dtype] = dlrm.score(predict, p, m, eval_batches)[0]
    base, full = os.path.join(work, "demo_int8"), os.path.join(work, "demo_int8_full")
    embed, maps, deltas = _deltas(args, plan, base, os.path.join(work, "demo_deltas"), run)
    _, export_s = _timed(se.export_serving, full, plan, embed, id_maps=maps or None, dtype="int8")
    out["delta"] = _compare(base, full, export_s, deltas)
    return out


def _reader(live, fn, ids, per_sample: int, done, record):
    """Looks up until `done`; records (seconds, torn?) of each lookup: torn if its values are not all its version."""
    while not done.is_set():
        t = time.perf_counter()
        s = live.snapshot
        out = jax.device_get(fn(s.tables, ids))
        seconds = time.perf_counter() - t
        record.append((seconds, any(not np.all(x == per_sample * s.seq) for x in out.values())))


def load(args, work: str) -> dict:
    """Lookups from `--threads` threads while `--deltas` deltas apply to the W1-sized int8 tables."""
    base = os.path.join(work, "w1_int8")
    changes, hot = ss.Changes.since(base), np.arange(0, args.rows, 100)
    deltas = os.path.join(work, "load_deltas")
    for v in range(1, args.deltas + 1):  # version v: every hot row is v (a constant row is exact in int8)
        rows = {f"t{i}": (hot, np.full((hot.size, args.dim), v, np.float32)) for i in range(args.tables)}
        _, changes = ss.write_delta(deltas, changes, rows)
    live = ss.LiveTables(base)
    live.apply(os.path.join(deltas, ss.delta_name(changes.base, 1)))
    features = _served_features(_w1_plan(args).features, live.snapshot.specs)
    features = {n: se.FeatureSpec(n, f.table, args.load_batch) for n, f in features.items()}
    fn = jax.jit(lambda t, i: se.serving_lookup(features, t, i))
    rng = np.random.default_rng(2)
    ids = {n: hot[rng.integers(0, hot.size, (args.load_batch, args.ids))].astype(np.int32) for n in features}
    jax.block_until_ready(fn(live.snapshot.tables, ids))
    done, records = threading.Event(), [[] for _ in range(args.threads)]
    threads = [threading.Thread(target=_reader, args=(live, fn, ids, args.ids, done, r)) for r in records]
    start = time.perf_counter()
    for t in threads:
        t.start()
    applies = []
    for v in range(2, args.deltas + 1):  # spread over --load-seconds, so that lookups run before, during, after
        time.sleep(args.load_seconds / args.deltas)
        applies.append(_timed(live.apply, os.path.join(deltas, ss.delta_name(changes.base, v)))[1])
    time.sleep(args.load_seconds / args.deltas)
    done.set()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    lat = np.array([s for r in records for s, _ in r])
    return {"threads": args.threads, "deltas": args.deltas - 1, "seconds": seconds, "apply_s": sum(applies),
            "lookups": int(lat.size), "lookups_per_s": lat.size * args.load_batch / seconds,
            "p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3),
            "torn": int(sum(torn for r in records for _, torn in r)), "final_seq": live.snapshot.seq}


def report(r: dict) -> str:
    w, d, ld = r["w1"], r["demo"], r["load"]
    f32, auc32 = w["lookups_per_s"]["float32"], d["auc"]["float32"]
    goals = {"int8": (">= 1.0x", "<= 0.001"), "int4": ("-", "<= 0.003")}
    lines = [f"W1-sized: {r['tables']} tables x {r['rows']} rows x {r['dim']}, lookups of {r['batch']} samples x "
             f"{r['ids']} ids per table; demo: {d['steps']} steps (eval AUC as trained {d['auc']['trained']:.4f})",
             "", "| served as | W1 MiB | W1 lookups (samples/s) | vs float32 (goal) | CPU ms a lookup | demo MiB | "
             "demo eval AUC | AUC - float32 (goal) |", "|---|---|---|---|---|---|---|---|"]
    for t in DTYPES:
        speed, acc = goals.get(t, ("-", "-"))
        lines.append(f"| {t} | {w['memory'][t] / 2**20:,.0f} | {w['lookups_per_s'][t]:,.0f} | "
                     f"{w['lookups_per_s'][t] / f32:.2f}x ({speed}) | {w['lookup_cpu_ms'][t]:.0f} | "
                     f"{d['memory'][t] / 2**20:,.2f} | {d['auc'][t]:.4f} | {d['auc'][t] - auc32:+.4f} ({acc}) |")
    lines += ["", "A delta (int8) after N more training steps, against a full re-export and reload "
              "(goal after 100 steps: <= 0.1x both):", "",
              "| model | steps | rows touched | delta MiB | full MiB | bytes ratio | ratio in format 1 | apply s | "
              "re-export + reload s | time ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, x in (("W1-sized", w), ("demo", d)):
        for h, dl in x["delta"].items():
            lines.append(f"| {name} | {h} | {dl['touched_fraction']:.1%} | {dl['delta_bytes'] / 2**20:,.2f} | "
                         f"{dl['full_bytes'] / 2**20:,.2f} | {dl['bytes_ratio']:.3f} | "
                         f"{dl['format1_bytes'] / dl['full_bytes']:.3f} | {dl['apply_s']:.3f} | "
                         f"{dl['export_s']:.2f} + {dl['reload_s']:.2f} | {dl['time_ratio']:.3f} |")
    lines += ["", f"Lookups under load: {ld['threads']} threads, batches of {r['load_batch']} samples, while "
              f"{ld['deltas']} deltas (1% of the rows each) apply to the W1-sized int8 tables "
              f"over {ld['seconds']:.1f} s (applying took {ld['apply_s']:.2f} s):",
              "", "| lookups | samples/s | p50 ms | p99 ms | torn reads (goal 0) |", "|---|---|---|---|---|",
              f"| {ld['lookups']} | {ld['lookups_per_s']:,.0f} | {ld['p50_ms']:.1f} | {ld['p99_ms']:.1f} | "
              f"{ld['torn']} |"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("tables", 8), ("rows", 1_000_000), ("dim", 64), ("batch", 4096), ("ids", 20),
                          ("reps", 10), ("demo-steps", 1000), ("demo-batch", 1024),
                          ("threads", 4), ("deltas", 8), ("load-batch", 512)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--delta-steps", default="1,10,100", help="training steps after the export of each delta")
    ap.add_argument("--load-seconds", type=float, default=10.0, help="the deltas under load are spread over this")
    ap.add_argument("--demo-args", default="", help="more flags of sparse_embed.examples.dlrm, one string "
                    "(--demo-args='--items 1000')")
    ap.add_argument("--dir", default=None, help="where the exports go (default: a temporary directory, removed)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    work = args.dir or tempfile.mkdtemp(prefix="serving_quant_")
    try:
        r = {**{k: getattr(args, k) for k in ("tables", "rows", "dim", "batch", "ids", "load_batch")},
             "w1": w1(args, work), "demo": demo(args, work)}
        r["load"] = load(args, work)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    r["date"] = time.strftime("%Y-%m-%d %H:%M")
    out = report(r)
    print(out)
    if args.out:
        measuring.write_json(args.out, r)
    return out


if __name__ == "__main__":
    se.tuning.configure_xla_cpu()  # before the first JAX computation: no whole-table copies on CPU
    main()
