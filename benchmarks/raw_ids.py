"""Raw 64-bit ids against static ids, side by side in one process: train step, preprocess, map memory.

W1 by default (8 tables x 1M rows x 64, batch 4096, 20 ids per sample, 1
device, SGD). The raw-id runs draw ids from a pool of `occupancy x rows`
ids per table spread over [0, 2**40), with the map's 8-byte keys
(`Dynamic()`) and its 4-byte ones (`Dynamic(id_bits=40)`); the map starts
filled with the whole pool (loaded with `load_id_tables`), so every step
looks ids up in a table at that occupancy. The static run draws uniform
ids in [0, rows). `--new F` replaces a fraction F of each raw batch's ids
by ids never seen (every step's batch drawn afresh): the step then admits
them, and with `--occupancy 1` evicts as many.
The systems take turns, `--block` steps each, the first of each turn not
timed (see `_time_steps`); the table prints medians and ratios (of wall
time, and of the process's CPU time per step: every thread's, which other
processes' load stretches far less), with the load average at the end,
and `--out` records them as JSON.

`--malloc tuned` (the default) first calls `se.tuning.configure_cpu_allocator()`,
as docs/raw_ids.md recommends for CPU training: glibc then reuses XLA's
per-step block of temporaries instead of mapping fresh pages for it on
every step; `--malloc glibc` keeps glibc's defaults. Both systems run in
the same process, under the same setting.

    python benchmarks/raw_ids.py [--tables 8 --rows 1000000 --steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import sparse_embed as se


KINDS = {"static": None, "raw": se.Dynamic(), "raw40": se.Dynamic(id_bits=40)}  # raw40: the map's 4-byte keys


def _plans(args, mesh):
    opt = se.optimizers.SGD(0.01)
    out = {}
    for kind, dyn in KINDS.items():
        feats = [se.FeatureSpec(f"f{i}", se.TableSpec(f"t{i}", args.rows, args.dim, optimizer=opt, dynamic=dyn),
                                args.batch) for i in range(args.tables)]
        out[kind] = se.plan(feats, mesh, stacking=None)
    return out


def _pools(args, rng) -> list[np.ndarray]:
    n = int(args.occupancy * args.rows)
    return [np.unique(rng.integers(0, 2**40, int(n * 1.01), dtype=np.int64))[:n] for _ in range(args.tables)]


def _batches(args, rng, pools, kind: str, n: int) -> list[dict[str, np.ndarray]]:
    shape = (args.batch, args.ids)
    if kind == "static":
        return [{f"f{i}": rng.integers(0, args.rows, shape) for i in range(args.tables)} for _ in range(n)]

    def raw(p):  # pool ids, a fraction `--new` of them replaced by ids never seen (admitted, or evicting)
        ids = p[rng.integers(0, p.size, shape)]
        fresh = rng.random(shape) < args.new
        ids[fresh] = rng.integers(0, 2**40, int(fresh.sum()))
        return ids

    return [{f"f{i}": raw(p) for i, p in enumerate(pools)} for _ in range(n)]


def _filled_maps(plan, pools, rng_key):
    """The raw-id tables with every pool id already admitted (vectors: the table's initial values)."""
    contents = {}
    for i, p in enumerate(pools):
        s = plan.stack(f"t{i}")
        contents[f"t{i}"] = se.raw_ids.IdTable(p, np.zeros((p.size, s.embedding_dim), np.float32), {},
                                       np.zeros(p.size, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int32),
                                       np.zeros(0, np.int32), np.zeros(2, np.uint32))
    return se.raw_ids.load_id_tables(plan, contents)


def _step_fn(plan, raw: bool):
    def loss(tables, batch, step):
        acts = se.lookup(plan, batch, tables, step)
        return sum(jnp.sum(a * a) for a in acts.values())

    def step_fn(tables, maps, batch, step):
        if raw:
            batch, tables, maps, _ = se.map_ids(plan, batch, tables, maps, step)
        return jax.grad(loss)(tables, batch, step), maps

    return jax.jit(step_fn, donate_argnums=(0, 1))


def _turns(args) -> int:
    """Turns of `--block` steps per system: the warmup's, then enough for `--steps` timed ones."""
    return -(-args.warmup // args.block) + -(-args.steps // (args.block - 1))


def _time_steps(args, plans, batches, state):
    """Median step of each system, in blocks of `--block` steps per system, the blocks interleaved; a block's
    first step is not timed: the first step after another system's pays for the switch (W1: up to ~3 ms, in
    whichever system comes right after the static one), which a training loop never does."""
    fns = {k: _step_fn(p, k != "static") for k, p in plans.items()}
    times = {k: [] for k in plans}
    cpu = {k: [] for k in plans}
    i = {k: 0 for k in plans}  # each system's step count (its batches and step numbers)
    for _ in range(_turns(args)):
        for k in plans:  # interleaved blocks
            tables, maps = state[k]
            for j in range(args.block):
                b = batches[k][i[k] % len(batches[k])]
                t0, c0 = time.perf_counter(), time.process_time()
                tables, maps = fns[k](tables, maps, b, i[k])
                jax.block_until_ready(tables)
                if i[k] >= args.warmup and j > 0:
                    times[k].append(time.perf_counter() - t0)
                    cpu[k].append(time.process_time() - c0)
                i[k] += 1
            state[k] = (tables, maps)
    median_ms = lambda d: {k: statistics.median(v) * 1e3 for k, v in d.items()}
    return median_ms(times), median_ms(cpu)


def _time_preprocess(args, plans, batches):
    times = {k: [] for k in plans}
    for i in range(args.preprocess_reps):
        for k, p in plans.items():
            t0 = time.perf_counter()
            se.preprocess(p, batches[k][i % len(batches[k])], device_put=False)
            times[k].append(time.perf_counter() - t0)
    ids = args.batch * args.ids * args.tables
    return {k: ids / statistics.median(v) / 1e6 for k, v in times.items()}  # M ids/s


def run(args) -> dict:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[: args.devices]), ("d",))
    plans, rng = _plans(args, mesh), np.random.default_rng(0)
    pools = _pools(args, rng)
    batches = {k: _batches(args, rng, pools, k, 4 if k == "static" or not args.new else _turns(args) * args.block)
               for k in plans}
    for k, p in plans.items():  # sizes every capacity first (no recompiles while timing)
        for b in batches[k]:
            se.preprocess(p, b, device_put=False)
    key = jax.random.key(0)
    state = {k: _filled_maps(p, pools, key) if k != "static" else (se.init_tables(p, key), {})
             for k, p in plans.items()}
    step_ms, cpu_ms = _time_steps(args, plans, {k: [se.preprocess(plans[k], b)[0] for b in v]
                                                for k, v in batches.items()}, state)
    mids = _time_preprocess(args, plans, batches)
    raw = [k for k in plans if k != "static"]
    map_bytes = {k: sum(x.nbytes for x in state[k][1]["t0"].rows) / args.rows for k in raw}  # every array of it
    return dict(workload=vars(args), step_ms=step_ms, step_cpu_ms=cpu_ms, preprocess_mids=mids,
                map_bytes_per_row=map_bytes, step_ratio={k: step_ms[k] / step_ms["static"] for k in raw},
                step_cpu_ratio={k: cpu_ms[k] / cpu_ms["static"] for k in raw}, load_average=os.getloadavg()[0],
                preprocess_ratio={k: mids[k] / mids["static"] for k in raw},
                occupancy=args.occupancy, new_ids=args.new, malloc=args.malloc, jax=jax.__version__,
                date=time.strftime("%Y-%m-%d %H:%M"))


def report(r: dict) -> str:
    s, c, p, b = r["step_ms"], r["step_cpu_ms"], r["preprocess_mids"], r["map_bytes_per_row"]
    sr, cr, pr = r["step_ratio"], r["step_cpu_ratio"], r["preprocess_ratio"]
    return "\n".join([
        f"malloc: {r['malloc']}; occupancy {r['occupancy']}, new ids per step {r.get('new_ids', 0)}; "
        "raw ids from a 2**40 space, their map with 8-byte keys (Dynamic()) and 4-byte ones (Dynamic(id_bits=40))",
        "| measure | static ids | raw ids | raw, id_bits=40 | raw / static | raw, id_bits=40 / static | goal |",
        "|---|---|---|---|---|---|---|",
        f"| train step (SGD), ms | {s['static']:.1f} | {s['raw']:.1f} | {s['raw40']:.1f} | {sr['raw']:.2f} | "
        f"{sr['raw40']:.2f} | <= 1.2 |",
        f"| train step, process CPU ms | {c['static']:.1f} | {c['raw']:.1f} | {c['raw40']:.1f} | {cr['raw']:.2f} | "
        f"{cr['raw40']:.2f} | - |",
        f"| preprocess, M ids/s | {p['static']:.2f} | {p['raw']:.2f} | {p['raw40']:.2f} | {pr['raw']:.2f} | "
        f"{pr['raw40']:.2f} | >= 0.6 |",
        f"| map bytes per row | - | {b['raw']:.2f} | {b['raw40']:.2f} | - | - | <= 16.25, 12.25 |",
        f"load average (1 min) at the end: {r['load_average']:.2f}",
    ])


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("tables", 8), ("rows", 1_000_000), ("dim", 64), ("batch", 4096), ("ids", 20),
                          ("devices", 1), ("steps", 20), ("warmup", 3), ("preprocess_reps", 5), ("block", 5)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--occupancy", type=float, default=0.8)
    ap.add_argument("--new", type=float, default=0.0,
                    help="fraction of each step's raw ids never seen before (each batch drawn afresh): the cost of "
                         "admission, and of eviction with --occupancy 1")
    ap.add_argument("--malloc", choices=("tuned", "glibc"), default="tuned",
                    help="tuned: se.tuning.configure_cpu_allocator() first (see the module docstring); "
                         "glibc: its defaults")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.block < 2:
        ap.error("--block must be at least 2 (a turn's first step is not timed)")
    if args.malloc == "tuned" and not se.tuning.configure_cpu_allocator():
        args.malloc = "glibc (configure_cpu_allocator: not glibc here)"
    r = run(args)
    out = report(r)
    print(out)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)
    return out


if __name__ == "__main__":
    main()
