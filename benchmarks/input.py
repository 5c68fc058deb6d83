#!/usr/bin/env python
"""Input pipelines: the grain loader vs `se.prefetch` feeding the W1 step, and the Criteo reader's lines/s.

1. The W1 train step (as `benchmarks/pipeline.py`: 8 tables x 1M rows x 64
   f32, batch 4096, 20 uniform ids per sample per table, SGD, 1 device) fed
   by two loops over the same raw id batches (a few, cycled), in
   alternating rounds, each step blocked on:

   - prefetch: `se.prefetch` over a Python iterator of the batches;
   - grain: `se.data.Loader` over a grain `MapDataset` of the same batches
     (its iterator state kept for every batch, as a resumable run keeps it);
   - grain's thread: grain's own `ThreadPrefetchIterDataset` over
     `.map(se.data.Preprocess(plan))` (for comparison: its state would not
     hold the capacity marks as of the batch the loop took).

   Reported: examples/s of the whole loop (global batch / wall time per step).
2. The Criteo reader on a generated file of `--lines` lines (default
   10^6, `examples/criteo_data.py`): `parse_lines` over 16 MiB blocks (one
   core: numpy), and `CriteoSource` end to end (opening, which reads and
   checks every line once, then every batch read back), lines/s and
   process CPU time.

    python benchmarks/input.py                 # W1 and 10^6 lines
    python benchmarks/input.py --quick         # smoke run
    python benchmarks/input.py --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import tempfile
import time
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import measuring  # noqa: E402
from benchmarks import environment, pipeline, workload  # noqa: E402

LOOPS = {"prefetch": "se.prefetch (thread)", "grain": "se.data.Loader (grain)",
         "grain_thread": "grain's thread + Preprocess"}
SOURCE_BATCH = 1024  # CriteoSource's batch (lines per record)


@dataclasses.dataclass(frozen=True)
class Config:
    workload: workload.Workload
    steps: int
    warmup: int
    rounds: int
    lines: int  # Criteo lines to generate and parse
    seed: int


def parse_args(argv: Sequence[str] | None) -> tuple[Config, str | None]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    p.add_argument("--steps", type=int, help="timed steps per loop over all rounds (W1: 30)")
    p.add_argument("--lines", type=int, help="Criteo lines to parse (default 10^6)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    preset = pipeline.PRESETS["quick" if args.quick else "W1"]
    w = workload.Workload("quick" if args.quick else "W1", *(preset[k] for k in pipeline.SHAPE), 1, zipf=None)
    steps = args.steps or preset["steps"]
    lines = args.lines or (20_000 if args.quick else 1_000_000)
    return Config(w, steps, preset["warmup"], preset["rounds"], lines, args.seed), args.json


class _Batches:
    """The cycled raw batches as a grain random-access source."""

    def __init__(self, raw: list) -> None:
        self.raw = raw

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, i: int):
        return self.raw[i]


def run_loop(p: pipeline.Pipeline, loop: str, warmup: int, steps: int) -> tuple[float, float]:
    """(wall, CPU) seconds of `steps` steps of one loop, after `warmup`."""
    import grain
    import sparse_embed as se
    from sparse_embed import data as sed

    if loop == "prefetch":
        feed = se.prefetch(p.plan, itertools.cycle(p.raw))
        with feed:
            return pipeline.timed(lambda i: p.step(next(feed).batch), warmup, steps)
    dataset = grain.MapDataset.source(_Batches(p.raw)).repeat(None).to_iter_dataset()
    if loop == "grain":
        with sed.Loader(p.plan, dataset) as feed:
            return pipeline.timed(lambda i: p.step(next(feed).batch), warmup, steps)
    threaded = grain.experimental.ThreadPrefetchIterDataset(dataset.map(sed.Preprocess(p.plan)), prefetch_buffer_size=2)
    feed = iter(threaded)
    try:
        return pipeline.timed(lambda i: p.step(next(feed).batch), warmup, steps)
    finally:
        feed.close()


def measure_loops(p: pipeline.Pipeline, cfg: Config) -> dict[str, dict[str, float]]:
    totals = {loop: [0.0, 0.0, 0] for loop in LOOPS}
    per_round = [cfg.steps // cfg.rounds + (r < cfg.steps % cfg.rounds) for r in range(cfg.rounds)]
    for r, steps in enumerate(per_round):
        for loop in (LOOPS if r % 2 == 0 else reversed(LOOPS)):  # ABBA against drift
            wall, cpu = run_loop(p, loop, cfg.warmup, steps)
            totals[loop] = [totals[loop][0] + wall, totals[loop][1] + cpu, totals[loop][2] + steps]
    batch = cfg.workload.batch
    return {loop: {"ms_per_step": 1e3 * wall / n, "cpu_ms_per_step": 1e3 * cpu / n,
                   "examples_per_s": batch * n / wall, "steps": n} for loop, (wall, cpu, n) in totals.items()}


def measure_criteo(cfg: Config, directory: str) -> dict[str, float]:
    """lines/s of `parse_lines` over blocks, and of `CriteoSource` (open + read every batch)."""
    from sparse_embed import data as sed
    from sparse_embed.examples.criteo_data import write_criteo
    from sparse_embed.host.criteo_files import BLOCK_BYTES

    path = write_criteo(os.path.join(directory, "day.txt"), cfg.lines, seed=cfg.seed)
    with open(path, "rb") as f:
        data = f.read()
    blocks, start = [], 0
    while start < len(data):
        cut = data.rfind(b"\n", start, start + BLOCK_BYTES) + 1 if start + BLOCK_BYTES < len(data) else len(data)
        blocks.append(data[start:cut])
        start = cut
    wall, cpu = time.perf_counter(), time.process_time()
    parsed = sum(sed.parse_lines(b).labels.size for b in blocks)
    parse_wall, parse_cpu = time.perf_counter() - wall, time.process_time() - cpu
    wall, cpu = time.perf_counter(), time.process_time()
    source = sed.CriteoSource(path, SOURCE_BATCH, process_index=0, process_count=1)
    open_wall = time.perf_counter() - wall
    read = sum(source[i].labels.size for i in range(len(source)))
    source_wall, source_cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"lines": parsed, "bytes": len(data), "parse_lines_per_s": parsed / parse_wall,
            "parse_lines_per_cpu_s": parsed / parse_cpu, "source_open_s": open_wall,
            "source_lines_per_s": (parsed + read) / source_wall, "source_lines_read": read,
            "source_lines_per_cpu_s": (parsed + read) / source_cpu}


def format_report(results: dict[str, Any]) -> str:
    env, w, loops, c = results["env"], results["workload"], results["loops"], results["criteo"]
    lib = env["sparse_embed"]
    lines = [
        f"sparse_embed input benchmark  ({env['date']}, sparse_embed {lib['commit']}{'+dirty' * lib['dirty']}, "
        f"jax {env['jax']}, {env['backend']}, {env['cpu_count']} cpus)",
        f"workload {w['name']}: {w['tables']} tables x {w['rows']:,} rows x {w['dim']}, batch {w['batch']}, "
        f"{w['ids_per_sample']} ids/sample/table, SGD, 1 device; {results['config']['steps']} timed steps per "
        f"loop in {results['config']['rounds']} alternating round(s)",
        "",
        f"{'loop':<28}{'ms/step':>9}{'cpu ms/step':>13}{'examples/s':>12}",
    ]
    lines += [f"{LOOPS[k]:<28}{r['ms_per_step']:9.1f}{r['cpu_ms_per_step']:13.1f}{r['examples_per_s']:12,.0f}"
              for k, r in loops.items()]
    ratio = loops["grain"]["examples_per_s"] / loops["prefetch"]["examples_per_s"]
    lines += [f"se.data.Loader / se.prefetch examples/s: {ratio:.2f}",
              "",
              f"Criteo reader, {c['lines']:,} generated lines ({c['bytes'] / 2**20:.0f} MiB):",
              f"  parse_lines over 16 MiB blocks: {c['parse_lines_per_s'] / 1e6:.2f} M lines/s "
              f"({c['parse_lines_per_cpu_s'] / 1e6:.2f} M lines per CPU second)",
              f"  CriteoSource: open (reads and checks every line) {c['source_open_s']:.2f} s, then every batch read: "
              f"{c['source_lines_per_s'] / 1e6:.2f} M lines/s over both passes "
              f"({c['source_lines_per_cpu_s'] / 1e6:.2f} M per CPU second)"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    cfg, json_path = parse_args(argv)
    environment.configure_devices(1)
    import sparse_embed

    sparse_embed.tuning.configure_xla_cpu()
    with tempfile.TemporaryDirectory() as d:
        criteo = measure_criteo(cfg, d)
    p = pipeline.Pipeline.create(cfg.workload, environment.make_mesh(1), cfg.seed)
    loops = measure_loops(p, cfg)
    env = environment.environment(argv, environment.cpu_threads(), script="benchmarks/input.py")
    results = {"env": env, "workload": dataclasses.asdict(cfg.workload),
               "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "workload"},
               "loops": loops, "criteo": criteo}
    print(format_report(results))
    if json_path:
        measuring.write_json(json_path, results)
    return results


if __name__ == "__main__":
    main()
