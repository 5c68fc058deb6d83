#!/usr/bin/env python
"""`benchmarks/e2e.py`'s DLRM over several processes on this machine: TorchRec's DMP over gloo against
sparse_embed (Flax linen) over `jax.distributed`.

Each of `--processes` workers takes its share of every global batch (the
same batches as `e2e.py`, rows split in order), holds its share of the
tables (TorchRec: whole tables, table-wise; sparse_embed: rows, MOD over
one device per process) and the whole dense part (TorchRec: DDP over
gloo; sparse_embed: replicated params, the gradient all-reduced inside the
step). Reported: examples/s of the whole batch (median and p10-p90 over
blocks, timed on process 0; the steps keep the processes in lockstep) and
the sum of the processes' peak RSS over the timed steps. Torch gets the
machine's cores split over the processes.

    python benchmarks/e2e_processes.py --model w1 --steps 30
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Sequence

import numpy as np

if __package__ in (None, ""):  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import e2e, environment  # noqa: E402
from benchmarks.e2e_data import MODELS, Data, HostBatch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def local_rows(hb: HostBatch, rank: int, n: int) -> HostBatch:
    """Process `rank`'s rows (the `rank`-th of `n` equal, contiguous parts) of a global batch."""
    b = hb.labels.size // n
    rows = slice(rank * b, (rank + 1) * b)
    ids, gains = {}, {}
    for f, (values, lengths) in hb.ids.items():
        starts = np.concatenate([[0], np.cumsum(lengths)])
        cut = slice(starts[rows.start], starts[rows.stop])
        ids[f], gains[f] = (values[cut], lengths[rows]), hb.gains[f][cut]
    return HostBatch(ids, gains, hb.dense[rows], hb.labels[rows])


class LocalData:
    """`Data` cut to this process's rows."""

    def __init__(self, data: Data, rank: int, n: int):
        self.data, self.rank, self.n = data, rank, n

    def batch(self, i: int) -> HostBatch:
        return local_rows(self.data.batch(i), self.rank, self.n)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One process of `args.system`: joins the group, builds the model, trains, times."""
    rank, n, coordinator = int(os.environ["E2E_RANK"]), args.processes, os.environ["E2E_COORDINATOR"]
    model = MODELS[args.model]
    threads = max(1, args.threads // n)
    if args.system == "torchrec":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{coordinator}", rank=rank, world_size=n)
    else:
        import jax

        import sparse_embed as se

        se.tuning.configure_xla_cpu()
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator, n, rank, initialization_timeout=120)
    system = e2e.build(args.system, model, threads)
    blocks, rss = e2e.train(system, LocalData(Data(model, args.seed), rank, n), args)
    eps = [args.block * model.batch / b for b in blocks]
    return {"system": args.system, "model": args.model, "processes": n, "rank": rank,
            "examples_per_s": float(np.median(eps)), "examples_per_s_p10": float(np.percentile(eps, 10)),
            "examples_per_s_p90": float(np.percentile(eps, 90)), **rss}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(system: str, args: argparse.Namespace) -> dict[str, Any]:
    """`args.processes` workers of `system`; rank 0's timing, the sum of their peak RSS."""
    missing = [m for m in e2e.SYSTEMS[system][1] if importlib.util.find_spec(m) is None]
    if missing:
        return {"system": system, "model": args.model, "status": f"not installed ({', '.join(missing)})"}
    coordinator = f"127.0.0.1:{_free_port()}"
    cmd = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--block", str(args.block), "--pool", str(args.pool),
           "--processes", str(args.processes), "--threads", str(args.threads), "--worker", system]
    procs = []
    for rank in range(args.processes):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
        env.update(E2E_RANK=str(rank), E2E_COORDINATOR=coordinator, JAX_PLATFORMS="cpu",
                   PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=args.timeout) for p in procs]
    results = [json.loads(line[len(e2e.RESULT):]) for out, _ in outs for line in out.splitlines()
               if line.startswith(e2e.RESULT)]
    if len(results) != args.processes or any(p.returncode for p in procs):
        return {"system": system, "model": args.model, "status": "failed: " + outs[0][1][-1500:]}
    first = min(results, key=lambda r: r["rank"])
    return {**first, "rss_peak_steps_bytes": sum(r["rss_peak_steps_bytes"] for r in results)}


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(prog="python benchmarks/e2e_processes.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="w1", help=f"one of {sorted(MODELS)}")
    p.add_argument("--systems", default="torchrec,linen")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--block", type=int, default=5)
    p.add_argument("--pool", type=int, default=16, help="distinct batches, made before the loop and cycled")
    p.add_argument("--threads", type=int, default=environment.cpu_threads())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.system = args.worker
        print(e2e.RESULT + json.dumps(worker(args)), flush=True)
        return []
    out = []
    for system in args.systems.split(","):
        t = time.perf_counter()
        r = run(system, args)
        out.append(r)
        print(f"{args.processes} processes, {system:<9}", r.get("status") or
              f"{r['examples_per_s']:,.0f} examples/s ({r['examples_per_s_p10']:,.0f}-{r['examples_per_s_p90']:,.0f}),"
              f" peak RSS {r['rss_peak_steps_bytes'] / 2**20:,.0f} MiB in all ({time.perf_counter() - t:.0f} s)",
              flush=True)
    return out


if __name__ == "__main__":
    main()
