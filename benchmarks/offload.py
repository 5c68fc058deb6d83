#!/usr/bin/env python
"""An offloaded table (a store on disk under a device cache) beside the same table in memory, side by side.

Default (issue 42): one table of 2*10^7 x 64 f32 with RowwiseAdagrad,
batch 4096 x 20 ids per sample, Zipf(1.05) ids (ranks scattered over the
rows), a cache of 10% of the rows. Both systems run the same loop on the
same ids (drawn before timing): `prefetch` (preprocessed in its worker, two batches
ahead) and a jitted train step whose loss is linear in the activations; the
offloaded table also swaps its misses in before each step. Blocks of steps
alternate between the two systems, `--rounds` times, so a slow stretch of
this shared machine falls on both. A step's time is the loop's wall time
from taking the batch to the step's result being ready (`swap` included,
and any wait for the store). Reported: median / p10 / p90 ms per step, the
ratio (goal <= 1.2x), the hit rate, rows read / written and bytes per
step, the loop's wait, and each system's process CPU time per step (every
thread; the offloaded one's write-backs waited for at the end of each of
its blocks), which other processes' load does not stretch, the
write-backs' CPU time, and the load average. After the timed blocks the
offloaded table is flushed with `--flush` (a commit: the cache's changed
rows and the store's write log merged into its records), timed.
`--uniform` adds the same with uniform ids.

`--huge` trains a 10^8 x 64 table (25.6 GB with its slots: more than this
machine's memory) for `--huge-steps` (1000) Zipf steps in a fresh process
and reports steps/s, peak RSS (goal <= 8 GiB), the hit rate and disk bytes
per step. The in-memory table is not built there.

    python benchmarks/offload.py                          # 2*10^7 rows, Zipf, side by side
    python benchmarks/offload.py --uniform --json benchmarks/results/results_offload.json
    python benchmarks/offload.py --huge                   # 10^8 rows, 1000 steps, peak RSS
    python benchmarks/offload.py --quick                  # smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks import measuring  # noqa: E402
from benchmarks.measuring import RSS  # noqa: E402
from benchmarks.workload import id_sampler  # noqa: E402

GIB = 2**30


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=20_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--ids-per-sample", type=int, default=20)
    p.add_argument("--cache-fraction", type=float, default=0.1)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--uniform", action="store_true", help="also measure uniform ids")
    p.add_argument("--steps", type=int, default=40, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=100, help="offloaded steps before timing (fills the cache)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--buffer", type=int, default=2, help="prefetch buffer_size (look-ahead in batches)")
    p.add_argument("--flush", action="store_true", help="flush (commit) the offloaded table after the blocks, timed")
    p.add_argument("--huge", action="store_true", help="the 10^8-row run (its own process)")
    p.add_argument("--huge-rows", type=int, default=100_000_000)
    p.add_argument("--huge-steps", type=int, default=1000)
    p.add_argument("--dir", default=None, help="where the stores go (default: a temporary directory)")
    p.add_argument("--quick", action="store_true", help="a smoke run: small table, few steps")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--phase", choices=("side_by_side", "huge"), default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.rows, a.batch, a.ids_per_sample, a.steps, a.warmup, a.rounds = 200_000, 256, 5, 5, 5, 1
        a.huge_rows, a.huge_steps = 1_000_000, 20
    return a


def draw_batches(rows: int, shape: tuple[int, int], zipf: float | None, count: int, seed: int = 2) -> list:
    """`count` batches `{"f": ids [batch, ids_per_sample]}`, drawn before any timing (drawing Zipf ids by
    inverse CDF takes longer than a step); each system iterates the same list."""
    sample, rng = id_sampler(rows, zipf), np.random.default_rng(seed)
    return [{"f": sample(rng, shape)} for _ in range(count)]


class System:
    """One table (in memory, or offloaded) with its plan, state, prefetcher and jitted step."""

    def __init__(self, args: argparse.Namespace, rows: int, batches: list, store: str | None) -> None:
        import jax
        import jax.numpy as jnp
        import sparse_embed as se

        storage = None if store is None else se.offload.Offload(store, cache_rows=int(rows * args.cache_fraction))
        table = se.TableSpec("t", rows, args.dim, optimizer=se.optimizers.RowwiseAdagrad(0.05), combiner="sum",
                             storage=storage)
        self.plan = plan = se.plan([se.FeatureSpec("f", table, args.batch)])
        rng = jax.random.key(0)
        self.tables = se.init_tables(plan, rng)
        cot = jnp.asarray(np.random.default_rng(1).standard_normal((args.batch, args.dim), np.float32))

        def loss(tables, batch, step):
            return jnp.sum(se.lookup(plan, batch, tables, step)["f"] * cot)

        self.step_fn = jax.jit(jax.grad(loss), donate_argnums=0)
        self.tiers = None if store is None else se.offload.Tiers(plan, rng)
        self.items = (se.prefetch(plan, batches, buffer_size=args.buffer) if store is None
                      else self.tiers.prefetch(batches, buffer_size=args.buffer))
        self.step = 0
        self.block_until_ready = jax.block_until_ready

    def run(self, n: int) -> list[float]:
        """n steps; the wall time of each."""
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            item = next(self.items)
            if self.tiers is not None:
                self.tables = self.tiers.swap(self.tables, item.swap)
            self.tables = self.step_fn(self.tables, item.batch, self.step)
            self.block_until_ready(self.tables)
            times.append(time.perf_counter() - t0)
            self.step += 1
        return times

    def settle(self) -> None:
        """Waits for the write-backs so far (after a block: they count in its CPU time, not the next block's)."""
        if self.tiers is not None:
            self.tiers.wait()

    def flush(self) -> None:
        """Commits the store (the cache's changed rows written back, the write log merged)."""
        self.tables = self.tiers.flush(self.tables, self.step)
        self.block_until_ready(self.tables)

    def close(self) -> None:
        self.items.close()
        if self.tiers is not None:
            self.tiers.close()


def _ms(times: list[float]) -> dict[str, float]:
    t = np.asarray(times) * 1e3
    return {"median": float(np.median(t)), "p10": float(np.percentile(t, 10)), "p90": float(np.percentile(t, 90))}


def _tier_numbers(before: Any, after: Any, steps: int) -> dict[str, float]:
    d = {k: getattr(after, k) - getattr(before, k) for k in ("lookups", "hits", "misses", "fresh", "rows_read",
                                                            "from_evicted", "rows_written", "bytes_read",
                                                            "bytes_written", "read_seconds", "wait_seconds",
                                                            "write_seconds")}
    return {"hit_rate": d["hits"] / max(d["lookups"], 1),
            **{f"{k}_per_step": d[k] / steps for k in ("misses", "fresh", "rows_read", "from_evicted",
                                                          "rows_written", "bytes_read", "bytes_written")},
            "read_ms_per_step": 1e3 * d["read_seconds"] / steps, "wait_ms_per_step": 1e3 * d["wait_seconds"] / steps,
            "write_cpu_ms_per_step": 1e3 * d["write_seconds"] / steps}


def side_by_side(args: argparse.Namespace, zipf: float | None, where: str) -> dict[str, Any]:
    """In memory vs offloaded, alternating blocks of steps."""
    batches = draw_batches(args.rows, (args.batch, args.ids_per_sample), zipf,
                           args.warmup + args.rounds * args.steps + args.buffer + 4)
    load = os.getloadavg()
    memory = System(args, args.rows, batches, None)
    tiered = System(args, args.rows, batches, os.path.join(where, f"store_{zipf}"))
    memory.run(3)  # compile
    tiered.run(args.warmup)  # compile, and fill the cache
    times: dict[str, list[float]] = {"memory": [], "offloaded": []}
    cpu = {"memory": 0.0, "offloaded": 0.0}
    before = tiered.tiers.stats()["t"]
    for _ in range(args.rounds):
        for name, system in (("memory", memory), ("offloaded", tiered)):
            c0 = time.process_time()
            times[name] += system.run(args.steps)
            system.settle()
            cpu[name] += time.process_time() - c0
    numbers = _tier_numbers(before, tiered.tiers.stats()["t"], len(times["offloaded"]))
    flush = {}
    if args.flush:
        t0, c0 = time.perf_counter(), time.process_time()
        tiered.flush()
        flush = {"flush_seconds": time.perf_counter() - t0, "flush_cpu_seconds": time.process_time() - c0}
    memory.close()
    tiered.close()
    out = {k: _ms(v) for k, v in times.items()}
    out["load_average"] = [load, os.getloadavg()]
    out["ratio"] = out["offloaded"]["median"] / out["memory"]["median"]
    for k, v in cpu.items():
        out[k]["cpu_ms_per_step"] = 1e3 * v / len(times[k])
    out["cpu_ratio"] = out["offloaded"]["cpu_ms_per_step"] / out["memory"]["cpu_ms_per_step"]
    out["offloaded"].update(numbers, **flush)
    return out


def huge(args: argparse.Namespace, where: str) -> dict[str, Any]:
    """The 10^8-row table alone: steps/s, peak RSS, hit rate, disk bytes per step."""
    batches = draw_batches(args.huge_rows, (args.batch, args.ids_per_sample), args.zipf,
                           args.huge_steps + args.buffer + 4)
    tiered = System(args, args.huge_rows, batches, os.path.join(where, "store_huge"))
    tiered.run(3)  # compile
    before = tiered.tiers.stats()["t"]
    t0 = time.perf_counter()
    times = tiered.run(args.huge_steps)
    seconds = time.perf_counter() - t0
    out = {"rows": args.huge_rows, "steps": args.huge_steps, "steps_per_s": args.huge_steps / seconds,
           "step_ms": _ms(times), **_tier_numbers(before, tiered.tiers.stats()["t"], args.huge_steps)}
    tiered.close()
    out["peak_rss_gib"] = RSS.final_process_peak() / GIB
    du = subprocess.run(["du", "-sb", os.path.join(where, "store_huge")], capture_output=True, text=True)
    out["store_disk_gib"] = int(du.stdout.split()[0]) / GIB if du.returncode == 0 else None
    return out


def _phase(args: argparse.Namespace, argv: Sequence[str], phase: str, where: str) -> dict[str, Any]:
    """Runs one phase in a fresh process (its own peak RSS and page faults); its JSON result."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--phase", phase, "--dir", where, "--json", f.name]
        subprocess.run(cmd, check=True)
        with open(f.name) as g:
            return json.load(g)


def report(results: dict[str, Any]) -> None:
    for key, r in results.items():
        if key.startswith("side_by_side"):
            m, o = r["memory"], r["offloaded"]
            print(f"\n{key}: ms per step, median (p10-p90)")
            print(f"  in memory   {m['median']:8.2f} ({m['p10']:.2f}-{m['p90']:.2f})")
            print(f"  offloaded   {o['median']:8.2f} ({o['p10']:.2f}-{o['p90']:.2f})   ratio {r['ratio']:.2f}x "
                  f"(goal <= 1.2x: {'met' if r['ratio'] <= 1.2 else 'MISSED'})")
            print(f"  hit rate {o['hit_rate']:.3f}; per step: misses {o['misses_per_step']:.0f} (fresh "
                  f"{o['fresh_per_step']:.0f}, read {o['rows_read_per_step']:.0f}, from evicted "
                  f"{o['from_evicted_per_step']:.0f}), written back {o['rows_written_per_step']:.0f}, "
                  f"{o['bytes_read_per_step'] / 2**20:.2f} MiB read, {o['bytes_written_per_step'] / 2**20:.2f} MiB "
                  f"written; store reads {o['read_ms_per_step']:.2f} ms (worker), loop's wait "
                  f"{o['wait_ms_per_step']:.2f} ms; write-backs' CPU {o['write_cpu_ms_per_step']:.2f} ms (writer)")
            if "flush_seconds" in o:
                print(f"  then a flush (commit: the cache's changed rows and the write log into the store): "
                      f"{o['flush_seconds']:.2f} s ({o['flush_cpu_seconds']:.2f} s CPU)")
            print(f"  load average (1/5/15 min) before, after: "
                  f"{', '.join('/'.join(f'{x:.1f}' for x in la) for la in r['load_average'])}")
            print(f"  process CPU per step (every thread; other processes' load stretches wall time, not this): in "
                  f"memory {m['cpu_ms_per_step']:.2f} ms, offloaded {o['cpu_ms_per_step']:.2f} ms, ratio "
                  f"{r['cpu_ratio']:.2f}x")
        elif key == "huge":
            print(f"\nhuge: {r['rows']:.2e} rows, {r['steps']} steps: {r['steps_per_s']:.1f} steps/s, median "
                  f"{r['step_ms']['median']:.1f} ms; peak RSS {r['peak_rss_gib']:.2f} GiB (goal <= 8: "
                  f"{'met' if r['peak_rss_gib'] <= 8 else 'MISSED'}); hit rate {r['hit_rate']:.3f}; per step "
                  f"{r['bytes_read_per_step'] / 2**20:.2f} MiB read, {r['bytes_written_per_step'] / 2**20:.2f} MiB "
                  f"written; store on disk {r['store_disk_gib']:.1f} GiB; loop's wait {r['wait_ms_per_step']:.2f} ms")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    where = args.dir or tempfile.mkdtemp(prefix="sparse_embed_offload_")
    try:
        if args.phase:  # in a fresh process, started below
            import sparse_embed

            sparse_embed.tuning.configure_xla_cpu()
            results = (side_by_side(args, None if args.uniform else args.zipf, where) if args.phase == "side_by_side"
                       else huge(args, where))
        else:
            keep = [a for a in argv if a not in ("--uniform", "--huge")]
            results = {f"side_by_side zipf {args.zipf}": _phase(args, keep, "side_by_side", where)}
            if args.uniform:
                results["side_by_side uniform"] = _phase(args, keep + ["--uniform"], "side_by_side", where)
            if args.huge:
                results["huge"] = _phase(args, keep, "huge", where)
            report(results)
    finally:
        if not args.dir:
            shutil.rmtree(where, ignore_errors=True)
    if args.json:
        measuring.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
