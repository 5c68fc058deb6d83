#!/usr/bin/env python
"""End-to-end training loop (preprocess + train step): serial vs `sparse_embed.prefetch`, side by side.

Default workload W1 (as `benchmarks/step.py`): 8 tables x 1,000,000 rows x
64 f32, global batch 4096, 20 uniform ids per sample per table, sum
combiner, SGD, 1 device. Four loops over the same raw id batches (a few,
cycled), each step blocked on, as a loop that reads its loss every step is:

  (a) preprocess alone: `preprocess(plan, ids)` incl. the copy to the device;
  (b) train step alone, on batches preprocessed up front;
  (c) serial loop: (a) then (b), one batch after the other;
  (d) prefetched loop: (b) on the batches of `se.prefetch` (a background
      thread preprocesses batch k+1 while the device runs step k).

The goal: (d) runs at the speed of the slower of (a) and (b), not their sum,
i.e. (d) / max(a, b) near 1, where (c) / (a + b) is 1. On XLA:CPU the step
runs on the same cores as preprocessing, so the overlap is bounded by the
cores: the table also prints each loop's process CPU time per step and the
floor `(cpu a + cpu b) / cores`. Loops run in alternating rounds against
drift in background load; ms/step = total wall time / steps, over rounds.

    python benchmarks/pipeline.py                    # W1
    python benchmarks/pipeline.py --quick            # smoke run, a few seconds
    python benchmarks/pipeline.py --json benchmarks/results/results_pipeline.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

if __package__ in (None, ""):  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import environment, measuring, ours, workload  # noqa: E402

LOOPS = {
    "preprocess": "(a) preprocess alone",
    "step": "(b) train step alone",
    "serial": "(c) serial: (a) then (b)",
    "prefetched": "(d) prefetched",
}
SHAPE = ("tables", "rows", "dim", "batch", "ids_per_sample")  # the preset keys that define the workload
PRESETS: dict[str, dict[str, Any]] = {
    "W1": dict(tables=8, rows=1_000_000, dim=64, batch=4096, ids_per_sample=20, steps=30, warmup=3, rounds=3),
    "quick": dict(tables=2, rows=10_000, dim=16, batch=256, ids_per_sample=5, steps=4, warmup=1, rounds=1),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """What to run: the workload, timed steps per loop (split over `rounds`), and the prefetch depth."""

    workload: workload.Workload
    steps: int
    warmup: int  # untimed steps before each loop's timed steps, in every round
    rounds: int
    buffer_size: int
    seed: int


def parse_args(argv: Sequence[str] | None) -> tuple[Config, str | None]:
    """Flags -> (Config, --json path); flags left unset take the W1 (or --quick) preset."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny workload for a smoke run")
    for flag, what in (("tables", "number of tables"), ("rows", "rows per table"), ("dim", "embedding dim"),
                       ("batch", "global batch size"), ("ids-per-sample", "ids per sample per table"),
                       ("steps", "timed steps per loop, over all rounds"),
                       ("warmup", "untimed steps per loop and round"), ("rounds", "alternating rounds")):
        p.add_argument(f"--{flag}", type=int, help=f"{what} (W1: {PRESETS['W1'][flag.replace('-', '_')]:,})")
    p.add_argument("--devices", type=int, default=1, help="devices (>1 on CPU: simulated host devices)")
    p.add_argument("--buffer-size", type=int, default=2, help="prefetch buffer_size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    preset = "quick" if args.quick else "W1"
    values = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in PRESETS[preset].items()}
    if min(values["steps"], values["rounds"]) < 1 or values["warmup"] < 0 or args.buffer_size < 1:
        p.error("--steps, --rounds and --buffer-size must be >= 1, --warmup >= 0")
    is_preset = args.devices == 1 and all(values[k] == PRESETS[preset][k] for k in SHAPE)
    w = workload.Workload(preset if is_preset else "custom", *(values[k] for k in SHAPE), args.devices, zipf=None)
    cfg = Config(w, values["steps"], values["warmup"], values["rounds"], args.buffer_size, args.seed)
    return cfg, args.json


# ---------------------------------------------------------------- the loops


@dataclasses.dataclass
class Pipeline:
    """A plan, a few raw id batches, and the compiled train step (with those batches preprocessed) over its tables."""

    plan: Any
    raw: list[dict[str, np.ndarray]]  # a few batches of {feature: [batch, ids_per_sample] int32}, cycled
    train: measuring.Runner  # the train step; its state is the (donated) tables

    @classmethod
    def create(cls, w: workload.Workload, mesh, seed: int) -> "Pipeline":
        import jax
        import sparse_embed as se

        problem = workload.make_problem(w, seed)
        plan = ours.build_plan(w, "sgd", mesh)
        batches, _ = ours.make_batches(plan, problem)  # also settles the plan's auto capacity
        tables = jax.block_until_ready(se.init_tables(plan, jax.random.key(seed)))
        cotangents = ours.make_cotangents(plan, problem)
        compiled = ours.compile_train(plan, tables, batches[0], cotangents)
        raw = [workload.feature_ids(ids) for ids in problem.ids]
        return cls(plan, raw, ours.train_runner(compiled, tables, batches, cotangents))

    def preprocess(self, i: int):
        """Batch i (of the cycled raw batches), preprocessed and on the devices."""
        import jax
        import sparse_embed as se

        return jax.block_until_ready(se.preprocess(self.plan, self.raw[i % len(self.raw)])[0])

    def step(self, batch) -> None:
        """One train step on `batch`, waited for."""
        import jax

        self.train.state, out = self.train.call(self.train.state, batch)
        jax.block_until_ready(out)


def timed(body: Callable[[int], Any], warmup: int, steps: int) -> tuple[float, float]:
    """(wall, process CPU) seconds of `body(i)` for i in [warmup, warmup + steps), after `warmup` untimed calls."""
    for i in range(warmup):
        body(i)
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(warmup, warmup + steps):
        body(i)
    return time.perf_counter() - wall, time.process_time() - cpu


def run_loop(p: Pipeline, loop: str, warmup: int, steps: int, buffer_size: int) -> tuple[float, float]:
    """Times one of LOOPS for `steps` steps; returns (wall, CPU) seconds."""
    import sparse_embed as se

    if loop == "preprocess":
        return timed(p.preprocess, warmup, steps)
    if loop == "step":
        return timed(lambda i: p.step(p.train.batches[i % len(p.train.batches)]), warmup, steps)
    if loop == "serial":
        return timed(lambda i: p.step(p.preprocess(i)), warmup, steps)
    with se.prefetch(p.plan, itertools.cycle(p.raw), buffer_size=buffer_size) as batches:
        return timed(lambda i: p.step(next(batches).batch), warmup, steps)


def measure(p: Pipeline, cfg: Config) -> dict[str, dict[str, float]]:
    """ms/step and CPU ms/step of every loop, the steps split over `cfg.rounds` alternating rounds."""
    totals = {loop: np.zeros(3) for loop in LOOPS}  # wall s, cpu s, steps
    per_round = [cfg.steps // cfg.rounds + (r < cfg.steps % cfg.rounds) for r in range(cfg.rounds)]
    for r, steps in enumerate(per_round):
        for loop in (LOOPS if r % 2 == 0 else reversed(LOOPS)):  # ABBA against drift
            if steps:
                totals[loop] += (*run_loop(p, loop, cfg.warmup, steps, cfg.buffer_size), steps)
    return {loop: {"ms_per_step": 1e3 * wall / n, "cpu_ms_per_step": 1e3 * cpu / n, "steps": int(n)}
            for loop, (wall, cpu, n) in totals.items()}


def overlap(loops: dict[str, dict[str, float]], cores: int) -> dict[str, float]:
    """The ratios that judge the overlap, and the CPU-bound floor of a perfectly overlapped loop."""
    a, b = loops["preprocess"]["ms_per_step"], loops["step"]["ms_per_step"]
    cpu_floor = (loops["preprocess"]["cpu_ms_per_step"] + loops["step"]["cpu_ms_per_step"]) / cores
    return {
        "prefetched_over_max": loops["prefetched"]["ms_per_step"] / max(a, b),
        "prefetched_over_sum": loops["prefetched"]["ms_per_step"] / (a + b),
        "serial_over_sum": loops["serial"]["ms_per_step"] / (a + b),
        "cpu_floor_ms": cpu_floor,
        "prefetched_over_floor": loops["prefetched"]["ms_per_step"] / max(a, b, cpu_floor),
    }


# ---------------------------------------------------------------- report


def format_report(results: dict[str, Any]) -> str:
    env, w, cfg, o = results["env"], results["workload"], results["config"], results["overlap"]
    lib = env["sparse_embed"]
    lines = [
        f"sparse_embed pipeline benchmark  ({env['date']}, sparse_embed {lib['commit']}{'+dirty' * lib['dirty']}, "
        f"jax {env['jax']}, {env['backend']}, {env['cpu_count']} cpus, {w['devices']} device(s))",
        f"workload {w['name']}: {w['tables']} tables x {w['rows']:,} rows x {w['dim']}, batch {w['batch']}, "
        f"{w['ids_per_sample']} ids/sample/table, SGD; {cfg['steps']} timed steps per loop in {cfg['rounds']} "
        f"round(s), prefetch buffer_size {cfg['buffer_size']}",
        "",
        f"{'loop':<28}{'ms/step':>9}{'cpu ms/step':>13}",
    ]
    lines += [f"{LOOPS[k]:<28}{r['ms_per_step']:9.1f}{r['cpu_ms_per_step']:13.1f}" for k, r in results["loops"].items()]
    lines += [
        "",
        f"(d) / max(a, b) = {o['prefetched_over_max']:.2f}   (1.0: the loop runs at the speed of the slower part)",
        f"(d) / (a + b)   = {o['prefetched_over_sum']:.2f}   (1.0: no overlap)",
        f"(c) / (a + b)   = {o['serial_over_sum']:.2f}   (the serial loop is the sum)",
        f"cpu floor (cpu a + cpu b) / {env['threads']} cores = {o['cpu_floor_ms']:.1f} ms; "
        f"(d) / max(a, b, floor) = {o['prefetched_over_floor']:.2f}",
        "cpu: process CPU time per step, all threads (XLA's step uses several; preprocess mostly one).",
        f"load average (1 min) before / after the loops: {env['load_average_1min'][0]:.2f} / "
        f"{env['load_average_1min'][1]:.2f} on {env['threads']} cores (this run adds ~1-2; more: other work competes)",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; prints a table, optionally writes JSON, returns the results dict."""
    cfg, json_path = parse_args(argv)
    environment.configure_devices(cfg.workload.devices)
    import sparse_embed

    sparse_embed.tuning.configure_xla_cpu()  # before the backend starts: no whole-table copies in the generic kernel

    pipeline = Pipeline.create(cfg.workload, environment.make_mesh(cfg.workload.devices), cfg.seed)
    load_before = os.getloadavg()[0]
    loops = measure(pipeline, cfg)
    cores = environment.cpu_threads()
    env = environment.environment(argv, cores, script="benchmarks/pipeline.py")
    env["load_average_1min"] = [load_before, os.getloadavg()[0]]  # other work on the machine, before and after
    results = {"env": env, "workload": dataclasses.asdict(cfg.workload),
               "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "workload"},
               "loops": loops, "overlap": overlap(loops, cores)}
    print(format_report(results))
    if json_path:
        measuring.write_json(json_path, results)
    return results


if __name__ == "__main__":
    main()
