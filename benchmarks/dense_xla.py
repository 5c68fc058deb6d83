#!/usr/bin/env python
"""XLA:CPU's dense layers against torch's, side by side: which XLA flags and dtypes make the MLPs fast.

Timed in jax and in torch, alternately, in one process: the dense part of
`benchmarks/e2e.py`'s DLRM (`--model`; w1: bottom 13-512-256-64, dot
interaction, top 512-256-1, Adagrad, batch 4096, on fixed embedding
activations), and one layer's three GEMMs (forward, input gradient, weight
gradient of `[B, 512] x [512, 256]`), in float32 and with bfloat16
operands (float32 accumulation). XLA reads `XLA_FLAGS` once, so each flag set
(`--variants`: VARIANTS, and ENVS for other environment variables) runs in
a process of its own, the variants in
turn, `--rounds` times, the order rotated every round. Torch in the same
process is the yardstick: its time moves with the machine's load as much as
XLA's, so the ratio jax/torch compares across processes better than the
milliseconds do. Each process also checks its dense step against the
default flags' (loss, activation gradients, updated parameters: float32
tolerance) and counts the library fusions in the compiled step (so a flag
that does nothing is seen to).

    python benchmarks/dense_xla.py                                # every variant, 3 rounds
    python benchmarks/dense_xla.py --variants default,ynn_dot --rounds 5 --out dense.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

if __package__ in (None, ""):  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import environment  # noqa: E402
from benchmarks.e2e_data import MODELS, Model  # noqa: E402

VARIANTS = {  # name: XLA_FLAGS. jaxlib 0.10.2's default sends single dots and reductions to YNNPACK; its XNNPACK
    # and oneDNN fusion flags are accepted but emit no fusion in the DLRM's step
    "default": "",
    "eigen_dots": "--xla_cpu_experimental_ynn_fusion_type=-individual_dot",
    "ynn_no_reduce": "--xla_cpu_experimental_ynn_fusion_type=-reduce",
    "ynn_dot_eltwise": "--xla_cpu_experimental_ynn_fusion_type=+dot,+eltwise",
    "eigen_1_thread": "--xla_cpu_multi_thread_eigen=false",
    "vector512": "--xla_cpu_prefer_vector_width=512",
}
ENVS = {"torch_passive": {"OMP_WAIT_POLICY": "PASSIVE"}}  # default XLA flags; torch's OpenMP workers sleep when idle
RESULT = "DENSE_RESULT "
FUSIONS = ("__ynn_fusion", "__xnn_fusion", "__onednn_fusion")


def _inputs(model: Model, seed: int = 0) -> dict[str, np.ndarray]:
    """Fixed pooled activations `[F][B, dim]` (about a 20-id sum of 0.02-std rows), dense features, labels."""
    rng = np.random.default_rng(seed)
    f, b = len(model.features), model.batch
    return {"acts": (0.09 * rng.standard_normal((f, b, model.dim))).astype(np.float32),
            "dense": rng.standard_normal((b, model.num_dense)).astype(np.float32),
            "labels": (rng.random(b) < 0.3).astype(np.float32),
            "x": rng.standard_normal((b, 512)).astype(np.float32),
            "w": (rng.standard_normal((512, 256)) / 512 ** 0.5).astype(np.float32),
            "g": rng.standard_normal((b, 256)).astype(np.float32),
            "v": (0.1 * rng.standard_normal((b, f + 1, model.dim))).astype(np.float32),
            "dots": rng.standard_normal((b, (f + 1) * f // 2)).astype(np.float32)}


def jax_parts(model: Model, data: dict[str, np.ndarray]) -> tuple[dict[str, Callable[[], Any]], dict[str, Any]]:
    """The timed jax callables (each blocks until done), and the dense step's check values and fusion counts."""
    import jax
    import jax.numpy as jnp

    from benchmarks.e2e_jax import dense_trainer

    step, state = dense_trainer(model)
    acts, dense, labels = list(jnp.asarray(data["acts"])), jnp.asarray(data["dense"]), jnp.asarray(data["labels"])
    hlo = step.lower(*state, acts, dense, labels).compile().as_text()
    params, opt_state, loss, d_acts = step(*state, acts, dense, labels)
    check = {"loss": float(loss), "d_acts": np.asarray(jnp.stack(d_acts)).ravel()[:4096].tolist(),
             "params": np.concatenate([np.asarray(x).ravel()[:512] for x in jax.tree.leaves(params)]).tolist()}
    info = {"check": check, "hlo": {k: len(re.findall(k, hlo)) for k in FUSIONS if k in hlo}}
    info["hlo"].update({op: len(re.findall(rf"= \S+ {op}\(", hlo)) for op in ("dot", "transpose", "copy")})
    held = {"state": (params, opt_state)}

    def dense_step():
        p, s, loss, _ = step(*held["state"], acts, dense, labels)
        held["state"] = (p, s)
        float(loss)

    def gemms(dtype):
        mm = lambda a, b: jnp.matmul(a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)  # noqa
        f = jax.jit(lambda x, w, g: (mm(x, w), mm(g, w.T), mm(x.T, g)))
        x, w, g = (jnp.asarray(data[k]) for k in "xwg")
        return lambda: jax.block_until_ready(f(x, w, g))

    i, j = np.triu_indices(data["v"].shape[1], k=1)
    forms = {"interaction (batched dot)": lambda v: jnp.einsum("bid,bjd->bij", v, v)[:, i, j],
             "interaction (multiply, sum)": lambda v: (v[:, i, :] * v[:, j, :]).sum(-1)}
    v, cot = jnp.asarray(data["v"]), jnp.asarray(data["dots"])
    grads = {k: jax.jit(jax.grad(lambda v, f=f: (f(v) * cot).sum())) for k, f in forms.items()}
    return {"dense step": dense_step, "3 GEMMs f32": gemms(jnp.float32), "3 GEMMs bf16": gemms(jnp.bfloat16),
            **{k: (lambda g=g: jax.block_until_ready(g(v))) for k, g in grads.items()}}, info


def torch_parts(model: Model, data: dict[str, np.ndarray], threads: int) -> dict[str, Callable[[], Any]]:
    """The same callables in torch (`threads` threads)."""
    import torch

    from benchmarks.e2e_torchrec import dense_trainer

    torch.set_num_threads(threads)
    step = dense_trainer(torch, model)
    acts = [torch.from_numpy(a) for a in data["acts"]]
    x = (None, torch.from_numpy(data["dense"]), torch.from_numpy(data["labels"]))

    def gemms(dtype):
        a, w, g = (torch.from_numpy(data[k]).to(dtype) for k in "xwg")
        return lambda: (torch.mm(a, w), torch.mm(g, w.t()), torch.mm(a.t(), g))

    n = data["v"].shape[1]
    pairs, cot = torch.triu_indices(n, n, 1), torch.from_numpy(data["dots"])

    def interaction():
        v = torch.from_numpy(data["v"]).requires_grad_()
        torch.bmm(v, v.transpose(1, 2))[:, pairs[0], pairs[1]].backward(cot)
        return v.grad

    return {"dense step": lambda: float(step(acts, x)), "3 GEMMs f32": gemms(torch.float32),
            "3 GEMMs bf16": gemms(torch.bfloat16), "interaction (batched dot)": interaction,
            "interaction (multiply, sum)": interaction}


def _time(fn: Callable[[], Any]) -> tuple[float, float]:
    """Milliseconds of one call: wall, and CPU time of all this process's threads (robust to others' load for XLA,
    whose idle workers sleep; not for torch, whose OpenMP workers spin while they wait)."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return 1e3 * (time.perf_counter() - t), 1e3 * (time.process_time() - c)


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    """Both systems' parts, alternating call by call: median milliseconds of each."""
    model, data = MODELS[args.model], _inputs(MODELS[args.model])
    mine, info = jax_parts(model, data)
    theirs = torch_parts(model, data, args.threads)
    out = {"variant": args.child, "flags": os.environ.get("XLA_FLAGS", ""), **info, "ms": {}}
    for name in mine:
        for _ in range(2):  # compiles, warms caches
            mine[name](), theirs[name]()
        pairs = np.array([(*_time(mine[name]), *_time(theirs[name])) for _ in range(args.reps)])
        med = np.median(pairs, axis=0)
        out["ms"][name] = {"jax": med[0], "jax_cpu": med[1], "torch": med[2], "torch_cpu": med[3],
                           "jax_min": pairs[:, 0].min(), "torch_min": pairs[:, 2].min()}
    return out


def run_variant(name: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "XLA_FLAGS": VARIANTS.get(name, ""), "JAX_PLATFORMS": "cpu", **ENVS.get(name, {})}
    cmd = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--reps", str(args.reps),
           "--threads", str(args.threads), "--child", name]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(RESULT)]
    if done.returncode or not lines:
        return {"variant": name, "status": f"failed ({done.returncode}): {done.stderr[-600:]}"}
    return {**json.loads(lines[-1][len(RESULT):]), "loadavg": os.getloadavg()[0]}


def _differs(r: dict[str, Any], ref: dict[str, Any]) -> float:
    """The largest relative difference of `r`'s check values from `ref`'s."""
    a, b = (np.array([c["check"]["loss"], *c["check"]["d_acts"], *c["check"]["params"]]) for c in (r, ref))
    return float(np.max(np.abs(a - b) / (np.abs(b) + 1e-6)))


def report(runs: list[dict[str, Any]], env: dict[str, Any]) -> str:
    """Per variant and part: jax and torch milliseconds (the median over a process's calls, then the median and range
    over rounds), their ratio, and the best call of each over all rounds (the least disturbed by others' load)."""
    lines = ["# XLA:CPU's dense layers against torch's", "",
             f"{env.get('date', '')}; {env.get('cpu', '?')}, {env.get('threads', '?')} threads; jax {env.get('jax')}, "
             f"torch {env.get('peers', {}).get('torch')}; `{env.get('command', '')}`", "",
             "| variant | part | jax ms | jax CPU ms | torch ms | torch CPU ms | jax / torch | best jax / torch (ms) | "
             "library fusions, dots, transposes, copies in the step | max rel. diff vs default | load (1 min) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    ref = next((r for r in runs if r["variant"] == "default" and "status" not in r), None)
    span = lambda v, f=".1f": f"{np.median(v):{f}} ({min(v):{f}}-{max(v):{f}})"  # noqa: E731
    for name in dict.fromkeys(r["variant"] for r in runs):
        rs = [r for r in runs if r["variant"] == name and "status" not in r]
        if not rs:
            lines.append(f"| {name} | {next(r for r in runs if r['variant'] == name)['status'][:300]} |||||||")
            continue
        diff = f"{max(_differs(r, ref) for r in rs):.1e}" if ref else "-"
        hlo = ", ".join(f"{k} {v}" for k, v in rs[0]["hlo"].items())
        for part in rs[0]["ms"]:
            keys = ("jax", "jax_cpu", "torch", "torch_cpu")
            j, c, t, tc = ([r["ms"][part].get(k, np.nan) for r in rs] for k in keys)
            best = [min(r["ms"][part][k] for r in rs) for k in ("jax_min", "torch_min")]
            ratio = span([a / b for a, b in zip(j, t)], ".2f")
            lines.append(f"| {name} | {part} | {span(j)} | {span(c)} | {span(t)} | {span(tc)} | {ratio} | "
                         f"{best[0] / best[1]:.2f} ({best[0]:.1f} / {best[1]:.1f}) | {hlo} | {diff} | "
                         f"{span([r['loadavg'] for r in rs])} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(prog="python benchmarks/dense_xla.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="w1", help=f"one of {sorted(MODELS)}")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {[*VARIANTS, *ENVS]}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=15, help="timed calls of each part per process")
    p.add_argument("--threads", type=int, default=environment.cpu_threads(), help="torch's threads")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", help="write the markdown report here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(RESULT + json.dumps(run_child(args)), flush=True)
        return []
    names, runs = args.variants.split(","), []
    for k in range(args.rounds):
        for name in names[k % len(names):] + names[:k % len(names)]:
            runs.append({**run_variant(name, args), "round": k + 1})
            r = runs[-1]
            print(name, r.get("status") or {part: f"{v['jax']:.1f} (CPU {v['jax_cpu']:.1f}) vs {v['torch']:.1f} ms"
                                            for part, v in r["ms"].items()}, flush=True)
    env = environment.environment(argv, args.threads, "benchmarks/dense_xla.py")
    text = report(runs, env)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return runs


if __name__ == "__main__":
    main()
