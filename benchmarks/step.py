#!/usr/bin/env python
"""Benchmark of a sparse_embed training step, side by side with FBGEMM, torch and naive Flax.

Workloads (`--preset`): W1 (default), 8 tables x 1,000,000 rows x 64 f32,
global batch 4096, 20 ids per sample per table; `small`, 2 x 10,000 rows,
batch 256 (fixed per-step costs); `quick`, a smoke run. Ids are uniform, or
Zipf with `--zipf`; sum combiner. Measured per run, for sparse_embed with
each lookup kernel (`--kernels`, default generic and native) on each
`--devices` count (more than 1: simulated host devices) and, once, for each
peer in `--peers` (single-process CPU; see `peers.py`), all on the very same
ids and loss cotangents:

- the train step for each optimizer asked for (`--optimizer`, default SGD,
  Adagrad, RowwiseAdagrad and Adam). sparse_embed's is
  `jax.jit(jax.value_and_grad(loss), donate_argnums=0)` with a loss linear
  in the activations (a fixed random cotangent); the peers run forward +
  `out.backward(cotangent)` (+ `optimizer.step()` where it is not fused);
- the forward-only (inference) lookup;
- the memory-traffic lower bound of each measurement (`peers.lower_bound`);
- vocabulary independence: one 64-dim table of 10^7 vs 10^5 rows, SGD, in
  alternating blocks of steps, on the same batches (goal: ratio <= 1.3),
  and with ids spread over each whole vocabulary.

Measurements run one after the other, all systems in turn within each, and
the whole sequence `--rounds` times over (W1 and small: 3), each round timing a
share of the steps on fresh tables: medians are over all rounds, so a slow
stretch of a shared machine falls on every system alike instead of on the
one that happened to run then. Each system's tables are freed before the
next builds its own. Preprocessing is
not timed. Reported: median / p10 / p90 wall time per step, its ratio to
FBGEMM's, to the same system's SGD step and to the lower bound, CPU time,
lookups/s, state bytes, peak RSS, page faults and table-shaped `copy` ops in
the compiled HLO; then the native-kernel issue's targets for the workload
(`report.TARGETS`), judged on the native kernel, 1 device. `--quick` (or
`--check`) first checks that both kernels and all peers agree on the
forward output and the tables after one SGD step.

`--hugepages` restarts the script with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`:
glibc then backs large blocks with transparent huge pages, for every system
alike. The MALLOC_*/GLIBC_TUNABLES in effect are recorded.

    python benchmarks/step.py                       # W1: both kernels and every installed peer
    python benchmarks/step.py --json benchmarks/results/results_step_w1.json --plot benchmarks/results/step.png
    python benchmarks/step.py --quick               # smoke run, seconds
    python benchmarks/step.py --preset small --peers none   # the small model, every optimizer
    python benchmarks/step.py --devices 1,8 --zipf 1.05 --peers fbgemm
    python benchmarks/step.py --hugepages           # glibc malloc on transparent huge pages
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
from typing import Any, Callable, Sequence

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import measuring, ours, peers, report, systems  # noqa: E402
from benchmarks.environment import configure_devices, cpu_threads, environment, make_mesh  # noqa: E402
from benchmarks.measuring import RSS, free_memory  # noqa: E402
from benchmarks.peers import FORWARD  # noqa: E402
from benchmarks.workload import DEFAULT_OPTIMIZERS, OPTIMIZERS, PRESETS, Workload, make_problem  # noqa: E402


def _names(choices: Sequence[str], every: Sequence[str] = ()) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: comma-separated names from `choices`; "all" = `every` (or all), "none" = ()."""

    def parse(text: str) -> tuple[str, ...]:
        if text in ("all", "none"):
            return tuple(every or choices) if text == "all" else ()
        names = tuple(n.strip() for n in text.split(","))
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(choices)}, all")
        return names

    return parse


def _device_counts(text: str) -> tuple[int, ...]:
    counts = tuple(int(n) for n in text.split(","))
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("device counts must be >= 1")
    return counts


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parses flags; workload flags left unset take the W1 (or --quick) preset."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=tuple(PRESETS), default="W1",
                   help="workload: W1 (8 x 1M x 64, batch 4096), small (2 x 10k, batch 256), quick (smoke run)")
    p.add_argument("--quick", action="store_true", help="the same as --preset quick: a smoke run in seconds")
    p.add_argument("--hugepages", action="store_true",
                   help="restart with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (huge pages for every system)")
    p.add_argument("--tables", type=int, help="number of tables (W1: 8)")
    p.add_argument("--rows", type=int, help="rows per table (W1: 1,000,000)")
    p.add_argument("--dim", type=int, help="embedding dim (W1: 64)")
    p.add_argument("--batch", type=int, help="global batch size (W1: 4096)")
    p.add_argument("--ids-per-sample", type=int, help="ids per sample per table (W1: 20)")
    p.add_argument("--devices", type=_device_counts, default=(1,),
                   help="sparse_embed's device counts, e.g. 1,8 (>1 on CPU: simulated host devices)")
    p.add_argument("--steps", type=int, help="timed steps per measurement (W1: 50)")
    p.add_argument("--warmup", type=int, help="untimed steps before each measurement (W1: 5)")
    p.add_argument("--rounds", type=int,
                   help="run the measurements this many times over, each a share of the steps (W1: 3)")
    p.add_argument("--slow-steps", type=int, default=5,
                   help="at most this many timed steps (after 1 warmup) for the naive Flax train steps")
    p.add_argument("--zipf", type=float, default=None, help="Zipf exponent of the ids (default: uniform)")
    p.add_argument("--optimizer", type=_names(tuple(OPTIMIZERS)), default=None,
                   help="comma-separated table optimizers, or 'all' (default: sgd,adagrad,rowwise_adagrad,adam; "
                        "the small preset: all)")
    p.add_argument("--kernels", type=_names(systems.KERNELS), default=systems.KERNELS,
                   help="sparse_embed's lookup kernels to time, each its own rows (default: generic,native)")
    p.add_argument("--peers", type=_names(tuple(peers.PEERS)), default=tuple(peers.PEERS),
                   help="comma-separated peers to run side by side (fbgemm,torch,flax), 'all' or 'none'")
    p.add_argument("--vocab-sizes", type=int, nargs=2, metavar=("LARGE", "SMALL"),
                   help="rows of the vocabulary-independence tables (W1: 1e7 1e5; --quick: 1e5 1e3)")
    p.add_argument("--vocab-rounds", type=int, default=5, help="alternating blocks per vocabulary size")
    p.add_argument("--no-forward", action="store_true", help="skip the forward-only measurement")
    p.add_argument("--no-vocab", action="store_true", help="skip the vocabulary-independence test")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="check that all systems agree on the forward and one SGD step (default: with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a bar chart (PNG) of the step times")
    args = p.parse_args(argv)
    preset = "quick" if args.quick else args.preset
    for key, value in PRESETS[preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.preset = preset
    if args.optimizer is None:
        args.optimizer = tuple(OPTIMIZERS) if preset == "small" else DEFAULT_OPTIMIZERS
    if args.check is None:
        args.check = args.quick
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.zipf is not None and args.zipf <= 1.0:
        p.error("--zipf must be > 1")
    if args.vocab_sizes[0] == args.vocab_sizes[1]:
        p.error("--vocab-sizes needs two different sizes")
    args.vocab_sizes = tuple(args.vocab_sizes)
    return args


def workload_of(args: argparse.Namespace) -> Workload:
    """The workload the flags describe (on the first device count); named after the preset if no flag changed it."""
    fields = ("tables", "rows", "dim", "batch", "ids_per_sample")
    is_preset = all(getattr(args, k) == PRESETS[args.preset][k] for k in fields)
    return Workload(args.preset if is_preset else "custom", *(getattr(args, k) for k in fields),
                    args.devices[0], args.zipf)


def measurements_of(args: argparse.Namespace) -> list[str]:
    return ([] if args.no_forward else [FORWARD]) + [f"train_{o}" for o in args.optimizer]


def run(args: argparse.Namespace, argv: Sequence[str] | None) -> dict[str, Any]:
    """All measurements, in order: agreement check, bandwidths, systems side by side, vocabulary, targets."""
    threads = cpu_threads()
    w = workload_of(args)
    problem = make_problem(w, args.seed)
    measurements = measurements_of(args)
    primary = systems.primary_kernel(args.kernels)
    results: dict[str, Any] = {"env": environment(argv, threads), "workload": dataclasses.asdict(w),
                               "workload_key": w.key, "ids_per_step": w.ids_per_step,
                               "target_system": systems.sparse_embed_key(primary), "rounds": args.rounds}
    if args.check:
        results["agreement"] = systems.check_agreement(w, problem, args, threads)
        free_memory()
    results["lower_bound"] = report.lower_bounds(w, problem, measurements, threads)
    free_memory()
    every = systems.make_systems(args, w, problem, threads, tuple(measurements))
    results["systems"] = systems.run_systems(every, measurements, args, w.ids_per_step)
    results["comparison"] = report.comparison(results["systems"], results["lower_bound"], measurements)
    if not args.no_vocab:
        results["vocab"] = ours.bench_vocab(w, make_mesh(args.devices[0]), args, primary)
    results["targets"] = report.targets(results["comparison"], results.get("vocab"), results["target_system"],
                                        w.key if 1 in args.devices else "none")
    results["rss_process_peak_bytes"] = RSS.final_process_peak()
    results["env"]["loadavg_end"] = os.getloadavg()
    return results


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; prints a table, optionally writes JSON and a plot, returns the results dict."""
    args = parse_args(argv)
    configure_devices(max(args.devices))
    import sparse_embed

    sparse_embed.tuning.configure_xla_cpu()  # before the backend starts: no whole-table copies in the generic kernel

    try:
        results = run(args, argv)
    finally:
        gc.unfreeze()
    print(report.format_report(results))
    if args.json:
        measuring.write_json(args.json, results)
    if args.plot:
        from benchmarks import plot

        plot.plot_steps(results, args.plot)
    return results


HUGETLB = "glibc.malloc.hugetlb=1"


def restart_with_hugepages(argv: Sequence[str]) -> None:
    """Re-executes this script with glibc's malloc on transparent huge pages (read only at start-up)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if HUGETLB not in tunables.split(":"):
        env = dict(os.environ, GLIBC_TUNABLES=":".join(filter(None, (tunables, HUGETLB))))
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *argv], env)


if __name__ == "__main__":
    if "--hugepages" in sys.argv[1:]:
        restart_with_hugepages(sys.argv[1:])
    main()
