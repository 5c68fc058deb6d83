"""Placements on the simulated 8-device mesh: the planner's "auto" plan against the all-row-wise plan.

The mixed workload (issue 15): 40 tables of 10 to 10^4 rows (log-spaced,
dim 16) read by one 4-hot feature each, and 4 tables of 10^6 rows (dim 64)
read by one 20-hot feature each; batch 4096, Adagrad. `--wide` adds one
table of 10^5 rows and dim 256 (20-hot) and a third plan, "auto" with that
table kept row-wise, to show what column placement changes. The plans
train side by side in one process, steps interleaved; the table prints the median step time, the
bytes one device receives through collectives per step (the plan's
estimate and the count read from the compiled step's HLO), the memory per
device, and the planner's printed plan. `--out` records it as JSON.

    python benchmarks/placement.py [--wide] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "jax" not in sys.modules:  # the simulated mesh must exist before JAX starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import sparse_embed as se  # noqa: E402
from benchmarks import measuring  # noqa: E402
from benchmarks.measuring import hlo_collective_bytes  # noqa: E402


def features(args) -> list[se.FeatureSpec]:
    o = se.optimizers.Adagrad(0.05)
    out = []
    for i in range(args.small):
        rows = int(round(10 * 10 ** (3 * i / max(args.small - 1, 1))))
        out.append(se.FeatureSpec(f"small{i:02d}", se.TableSpec(f"s{i:02d}", rows, 16, optimizer=o), args.batch))
    for i in range(args.large):
        out.append(se.FeatureSpec(f"large{i}", se.TableSpec(f"l{i}", args.large_rows, 64, optimizer=o), args.batch))
    if args.wide:
        out.append(se.FeatureSpec("wide", se.TableSpec("w", args.wide_rows, 256, optimizer=o), args.batch))
    return out


def ids_per_sample(args, feats) -> dict[str, int]:
    return {f.name: args.small_ids if f.name.startswith("small") else args.large_ids for f in feats}


def _batches(args, feats, n: int, rng) -> list[dict[str, np.ndarray]]:
    hot = ids_per_sample(args, feats)
    return [{f.name: rng.integers(0, f.table.vocabulary_size, (args.batch, hot[f.name])) for f in feats}
            for _ in range(n)]


def _step_fn(plan):
    def loss(tables, batch, step):
        acts = se.lookup(plan, batch, tables, step)
        return sum(jnp.sum(a * a) for a in acts.values())

    return jax.jit(jax.grad(loss), donate_argnums=0)


def _hlo_bytes(plan, tables, batch) -> float:
    """Bytes through collectives in the compiled forward + backward of `lookup` (the step's own HLO)."""
    cts = {f: jnp.ones(x.output_shape) for f, x in plan.features.items()}

    def step(tables, batch, cts):
        acts, vjp = jax.vjp(lambda t: se.lookup(plan, batch, t, 0), tables)
        return acts, vjp(cts)[0]

    return hlo_collective_bytes(jax.jit(step).lower(tables, batch, cts).compile().as_text(), plan.num_shards)


def run(args) -> dict:
    se.tuning.configure_xla_cpu()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[: args.devices]), ("d",))
    feats = features(args)
    hot = ids_per_sample(args, feats)
    plans = {"row": se.plan(feats, mesh), "auto": se.plan(feats, mesh, placement="auto", ids_per_sample=hot)}
    if args.wide:
        plans["auto, w row"] = se.plan(feats, mesh, placement={"w": "row"}, ids_per_sample=hot)
    rng = np.random.default_rng(0)
    host = _batches(args, feats, 4, rng)
    batches = {k: [se.preprocess(p, b)[0] for b in host] for k, p in plans.items()}
    caps = {k: se.preprocess(p, host[0], device_put=False)[1].capacity for k, p in plans.items()}
    state = {k: se.init_tables(p, jax.random.key(0)) for k, p in plans.items()}
    hlo = {k: _hlo_bytes(p, state[k], batches[k][0]) for k, p in plans.items()}
    fns = {k: _step_fn(p) for k, p in plans.items()}
    times = {k: [] for k in plans}
    for i in range(args.warmup + args.steps):
        for k in plans:  # interleaved
            t0 = time.perf_counter()
            state[k] = fns[k](state[k], batches[k][i % len(batches[k])], jnp.int32(i))
            jax.block_until_ready(state[k])
            if i >= args.warmup:
                times[k].append(time.perf_counter() - t0)
    step_ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return dict(workload=vars(args), step_ms=step_ms, step_ratio=step_ms["auto"] / step_ms["row"],
                estimated_bytes={k: p.collective_bytes(caps[k]) for k, p in plans.items()}, hlo_bytes=hlo,
                bytes_ratio=hlo["auto"] / hlo["row"], memory_per_device={k: p.memory_per_device() for k, p in plans.items()},
                plan=plans["auto"].describe(caps["auto"]), jax=jax.__version__, date=time.strftime("%Y-%m-%d %H:%M"))


def report(r: dict) -> str:
    mib = 2.0**20
    s, e, h, m = r["step_ms"], r["estimated_bytes"], r["hlo_bytes"], r["memory_per_device"]
    keys = [k for k in s if k != "row"]

    def line(what, d, fmt, rfmt, goal):
        cells = [format(d["row"] * 1.0, fmt)] + [f"{format(d[k] * 1.0, fmt)} ({format(d[k] / d['row'], rfmt)}x)"
                                                 for k in keys]
        return f"| {what} | {' | '.join(cells)} | {goal} |"

    in_mib = lambda d: {k: v / mib for k, v in d.items()}  # noqa: E731
    return "\n".join([
        "| measure | all row-wise | " + " | ".join(f'placement="{k}" (/ row)' for k in keys) + " | goal (auto / row) |",
        "|---|---|" + "---|" * len(keys) + "---|",
        line("train step, ms (median)", s, ".1f", ".2f", "<= 0.7"),
        line("MiB through collectives per device and step (compiled HLO)", in_mib(h), ".2f", ".3f", "<= 0.25"),
        line("the same, the plan's estimate", in_mib(e), ".2f", ".3f", "-"),
        line("MiB of tables and slots per device", in_mib(m), ".1f", ".2f", "-"),
        "", "The auto plan:", "```", r["plan"], "```",
    ])


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("small", 40), ("large", 4), ("large_rows", 1_000_000), ("wide_rows", 100_000),
                          ("batch", 4096), ("small_ids", 4), ("large_ids", 20), ("devices", 8), ("steps", 20),
                          ("warmup", 3)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--wide", action="store_true", help="add one table of dim 256")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    r = run(args)
    out = report(r)
    print(out)
    if args.out:
        measuring.write_json(args.out, r)
    return out


if __name__ == "__main__":
    main()
