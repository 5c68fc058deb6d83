#!/usr/bin/env python
"""The same DLRM end to end: TorchRec against sparse_embed (Flax linen and nnx) and `flax.linen.Embed`.

Model, data and optimizers: `benchmarks/e2e_data.py` (the demo's sparse
features, and w1: 8 tables of 10^6 x 64, 20 ids per sample; bottom MLP
13-512-256-64, dot interaction, top MLP 512-256-1, batch 4096; row-wise
Adagrad tables, Adagrad dense, the same learning rates and eps, the same
initial dense weights, the demo's teacher). Every system trains on the
same batches (a pool of `--pool` made before the timed loop and cycled, so
that the benchmark's synthetic teacher does not compete with the systems
for the cores), in a process of its own (so that each one's peak RSS is its
own), `--rounds` times in alternating order, its input pipeline on a
background thread (sparse_embed's: `se.prefetch`, which preprocesses; TorchRec's builds the KeyedJaggedTensor;
`flax.linen.Embed`'s pads the ids), and reports:

- examples/s: median and p10-p90 over blocks of `--block` steps (each
  block ends on the loss, so it holds the whole pipeline's time);
- eval AUC on held-out batches after the same steps;
- peak RSS: over the timed steps (the window starts after the warmup) and
  of the whole process;
- a profile: the input's host part and host->device copy, the train step
  alone on a ready input, the dense part alone (bottom, interaction, top,
  their backward and optimizer, on fixed embedding activations); the
  embedding part is the step minus the dense part, and the part of a step
  outside the embeddings is the loop's time per step minus the embedding
  part (the input left unhidden, the dense part, dispatch). (The embedding
  part timed alone, as a jit of the lookup's gradient for fixed activation
  gradients, copies the tables on XLA:CPU, which the train step does not:
  not a measure of the step's embedding part.)

    python benchmarks/e2e.py                              # demo and w1, full size (tens of minutes)
    python benchmarks/e2e.py --model demo_tiny --steps 4  # a smoke run
    python benchmarks/e2e.py --model w1 --rounds 3 --out e2e.md --json e2e.json
    OMP_WAIT_POLICY=PASSIVE python benchmarks/e2e.py ...  # torch's OpenMP workers sleep: fairer on a loaded machine
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Any, Sequence

import numpy as np

if __package__ in (None, ""):  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import environment, measuring  # noqa: E402
from benchmarks.e2e_data import MODELS, Data, HostBatch, auc  # noqa: E402

SYSTEMS = {  # name: (label, the modules it needs)
    "torchrec": ("TorchRec EBC, fused FBGEMM optimizer (DMP, gloo)", ("torch", "torchrec", "fbgemm_gpu")),
    "linen": ("sparse_embed, Flax linen", ()),
    "nnx": ("sparse_embed, Flax nnx", ()),
    "flax_embed": ("flax.linen.Embed, dense gradients", ()),
}
RESULT = "E2E_RESULT "  # the child's line of JSON on stdout


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/e2e.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo,w1", help=f"comma-separated, of {sorted(MODELS)}")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {list(SYSTEMS)}")
    p.add_argument("--steps", type=int, default=60, help="timed train steps (after the warmup)")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed steps first: the first two compile (the second for the first's output placement)")
    p.add_argument("--block", type=int, default=5, help="steps per timed block")
    p.add_argument("--pool", type=int, default=16,
                   help="distinct training batches, made before the loop and cycled (w1: ~8 MiB each)")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches for the eval AUC")
    p.add_argument("--profile-steps", type=int, default=5, help="repetitions of each profiled part")
    p.add_argument("--threads", type=int, default=environment.cpu_threads(), help="torch's threads")
    p.add_argument("--rounds", type=int, default=1, help="every system on every model this many times, the order "
                   "of the systems reversed every other round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per system")
    p.add_argument("--out", help="write the markdown report here")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", help=argparse.SUPPRESS)  # run one system in this process
    args = p.parse_args(argv)
    if args.steps < args.block or args.steps % args.block:
        p.error("--steps must be a positive multiple of --block")
    return args


def build(system: str, model, threads: int):
    if system == "torchrec":
        from benchmarks.e2e_torchrec import TorchRec

        return TorchRec(model, threads)
    from benchmarks import e2e_jax

    return e2e_jax.FlaxEmbed(model) if system == "flax_embed" else e2e_jax.SparseEmbed(model, system)


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def profile(system, data: Data, first: int, reps: int) -> dict[str, float]:
    """Milliseconds of the input's host part, its host->device copy, the step alone and the dense part alone."""
    hbs = [data.batch(first + k) for k in range(reps)]
    host = getattr(system, "host_part", system.prepare)
    it = iter(hbs)
    out = {"input_host_ms": _median_ms(lambda: host(next(it)), reps)}
    if hasattr(system, "device_part"):
        hosts = iter([system.host_part(hb) for hb in hbs])
        out["input_h2d_ms"] = _median_ms(lambda: system.device_part(next(hosts)), reps)
    xs = [system.prepare(hb) for hb in hbs]
    float(system.step(xs[-1]))  # compiles, where these inputs are placed otherwise than the loop's
    it = iter(xs)
    out["step_ms"] = _median_ms(lambda: float(system.step(next(it))), reps)
    if hasattr(system, "dense_step"):
        acts = system.activations(xs[0])
        float(system.dense_step(acts, xs[0]))  # compiles
        out["dense_ms"] = _median_ms(lambda: float(system.dense_step(acts, xs[0])), reps)
    return out


def batch_pool(data: Data, n: int, size: int) -> tuple[list[HostBatch], int]:
    """The first `min(n, size)` batches, made now (the synthetic teacher is the benchmark's, not the systems',
    input cost: made in the loop, it would compete with both for the cores), and their bytes."""
    pool = [data.batch(i) for i in range(min(n, size))]
    return pool, sum(hb.nbytes() for hb in pool)


def train(system, data: Data, args: argparse.Namespace) -> tuple[list[float], dict[str, Any]]:
    """Warmup, then `steps` steps in blocks, step i on batch `i % pool` of a pool made before the loop; returns
    each block's seconds, the RSS of the timed window (the pool included: `pool_bytes`) and the CPU time per
    timed step of all the process's threads (XLA's idle workers sleep; torch's OpenMP workers spin a while)."""
    blocks, n, loss, t, cpu = [], args.warmup + args.steps, None, 0.0, 0.0
    pool, pool_bytes = batch_pool(data, n, args.pool)
    with system.loop(pool[i % len(pool)] for i in range(n)) as inputs:
        for i, x in enumerate(inputs):
            if i == args.warmup:
                float(loss) if loss is not None else None
                measuring.trim_heap()
                measuring.RSS.reset()
                t, cpu = time.perf_counter(), time.process_time()
            loss = system.step(x)
            if i >= args.warmup and (i - args.warmup + 1) % args.block == 0:
                float(loss)  # the block ends when its last step has
                now = time.perf_counter()
                blocks.append(now - t)
                t = now
    return blocks, {"rss_peak_steps_bytes": measuring.RSS.peak(), "pool_bytes": pool_bytes, "pool": len(pool),
                    "loop_cpu_ms": 1e3 * (time.process_time() - cpu) / args.steps}


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    """One system on one model, in this process."""
    model = MODELS[args.model]
    data = Data(model, args.seed)
    t = time.perf_counter()
    system = build(args.child, model, args.threads)
    built = time.perf_counter() - t
    blocks, rss = train(system, data, args)
    xs = [system.prepare(data.eval_batch(i)) for i in range(args.eval_batches)]
    logits = np.concatenate([system.predict(x) for x in xs])
    labels = np.concatenate([data.eval_batch(i).labels for i in range(args.eval_batches)])
    eps = [args.block * model.batch / b for b in blocks]
    out = {"system": args.child, "model": args.model, "build_s": built, "blocks": blocks,
           "examples_per_s": float(np.median(eps)), "examples_per_s_p10": float(np.percentile(eps, 10)),
           "examples_per_s_p90": float(np.percentile(eps, 90)),
           "loop_ms": 1e3 * float(np.median(blocks)) / args.block, "eval_auc": auc(labels, logits), **rss}
    out.update(profile(system, data, args.warmup + args.steps, args.profile_steps))
    out["rss_peak_process_bytes"] = measuring.RSS.final_process_peak()
    return out


def run_system(system: str, model: str, args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """The system in a fresh process (its own peak RSS); a missing package or a failure becomes a status."""
    missing = [m for m in SYSTEMS[system][1] if importlib.util.find_spec(m) is None]
    if missing:
        return {"system": system, "model": model, "status": f"not installed ({', '.join(missing)})"}
    keep = [a for a in argv if not a.startswith(("--model", "--systems", "--out", "--json", "--rounds"))]
    cmd = [sys.executable, os.path.abspath(__file__), *keep, "--model", model, "--child", system]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"system": system, "model": model, "status": f"timed out after {args.timeout:.0f} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(RESULT)]
    if done.returncode or not lines:
        return {"system": system, "model": model, "status": f"failed ({done.returncode}): {done.stderr[-2000:]}"}
    return json.loads(lines[-1][len(RESULT):])


def _argv_pairs(argv: Sequence[str]) -> list[str]:
    """`argv` with each `--flag value` joined as `--flag=value`, so that flags can be filtered one item each."""
    out, it = [], iter(argv)
    for a in it:
        out.append(f"{a}={next(it)}" if a.startswith("--") and "=" not in a and a != "--child" else a)
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        import sparse_embed as se

        se.tuning.configure_xla_cpu()  # before JAX starts: no whole-table copies on CPU
        print(RESULT + json.dumps(run_child(args)), flush=True)
        return {}
    from benchmarks import e2e_report

    results = {"environment": environment.environment(argv, args.threads, "benchmarks/e2e.py"), "runs": []}
    results["environment"]["peers"].update(environment.package_versions(("torchrec",)))
    systems = args.systems.split(",")
    for k in range(args.rounds):
        for model in args.model.split(","):
            for system in systems[::-1] if k % 2 else systems:  # each order in turn: load drift falls on all
                r = {**run_system(system, model, args, _argv_pairs(argv)), "round": k + 1, "loadavg": os.getloadavg()}
                print(e2e_report.line(r), flush=True)
                results["runs"].append(r)
                if args.json:  # so far: a long run stopped early keeps what it measured
                    measuring.write_json(args.json, results)
    text = e2e_report.format_report(results)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        measuring.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
