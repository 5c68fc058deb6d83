"""Timing and memory of any system's step (jax or torch): runners, samples, peak RSS."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import os
import resource
import sys
import time
from typing import Any, Callable

import numpy as np


class RssTracker:
    """Peak RSS per window (Linux: resettable via /proc/self/clear_refs) and of the whole process."""

    def __init__(self) -> None:
        self.process_peak = self.peak()

    @staticmethod
    def peak() -> int:
        """Peak RSS in bytes since the last reset (or process start)."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    @staticmethod
    def current() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def reset(self) -> None:
        """Starts a new peak window (the process peak keeps the maximum)."""
        self.process_peak = max(self.process_peak, self.peak())
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass  # not resettable: peaks are then process-wide

    def final_process_peak(self) -> int:
        self.process_peak = max(self.process_peak, self.peak())
        return self.process_peak


RSS = RssTracker()


def state_bytes(tree: Any) -> int:
    """Bytes of all arrays in a pytree (tables + slots)."""
    import jax

    return sum(x.nbytes for x in jax.tree.leaves(tree))


@dataclasses.dataclass
class Samples:
    """Per-step wall and process CPU seconds, and the minor page faults of those steps."""

    wall: list[float] = dataclasses.field(default_factory=list)
    cpu: list[float] = dataclasses.field(default_factory=list)
    minor_faults: int = 0


@dataclasses.dataclass
class Runner:
    """A step, the state it threads through, and the batches it cycles (any system: jax or torch)."""

    call: Callable[[Any, Any], tuple[Any, Any]]  # (state, batch) -> (state, output)
    state: Any
    batches: list[Any]
    index: int = 0

    def run(self, n: int, into: Samples | None = None) -> Samples:
        """Runs n steps, blocking on each, and appends their timings to `into`."""
        import jax

        samples = Samples() if into is None else into
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(n):
            batch = self.batches[self.index % len(self.batches)]
            self.index += 1
            wall, cpu = time.perf_counter(), time.process_time()
            self.state, out = self.call(self.state, batch)
            jax.block_until_ready(out)  # torch outputs pass through: torch on CPU is synchronous
            samples.wall.append(time.perf_counter() - wall)
            samples.cpu.append(time.process_time() - cpu)
        samples.minor_faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        return samples


def timing_summary(samples: Samples, ids_per_step: int) -> dict[str, float]:
    """Median / p10 / p90 wall ms, median CPU ms, page faults per step and lookups/s."""
    wall, n = np.asarray(samples.wall), len(samples.wall)
    median = float(np.median(wall))
    return {
        "median_ms": 1e3 * median,
        "p10_ms": 1e3 * float(np.percentile(wall, 10)),
        "p90_ms": 1e3 * float(np.percentile(wall, 90)),
        "mean_ms": 1e3 * float(wall.mean()),
        "cpu_median_ms": 1e3 * float(np.median(samples.cpu)),
        "minor_faults_per_step": samples.minor_faults / n,
        "steps": n,
        "lookups_per_s": ids_per_step / median,
    }


def free_memory() -> None:
    """Collects what the last system left in reference cycles (its tables with them), then freezes the survivors;
    then gives the C heap's free pages back to the OS.

    With torch and jax loaded a full collection takes ~0.2 s; frozen objects
    are not scanned again, so each later call only looks at new objects.
    `main` unfreezes them at the end. Without the trim, what one system freed
    but glibc kept stays resident and is reused by the next one, whose peak
    RSS then depends on what ran before it (FBGEMM's peak above its base was
    ~190 MiB less than its own state in a W1 run).
    """
    gc.collect()
    gc.freeze()
    trim_heap()


def trim_heap() -> bool:
    """glibc's `malloc_trim(0)`: the free memory of every arena back to the OS. False (nothing done) without glibc."""
    libc = ctypes.CDLL(None) if sys.platform.startswith("linux") else None
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True


def measure(prepare: Callable[[], tuple[Runner, dict[str, Any]]], steps: int, warmup: int,
            ids_per_step: int, earlier: tuple[Samples, dict[str, Any]] | None = None) -> tuple[Samples, dict[str, Any]]:
    """Builds a runner, warms up, then times `steps` steps; the runner (and its tables) is dropped on return.

    Returns the samples and their summary. With `earlier` (an earlier round's
    return value) the steps add to its samples, the summary covers all of
    them, and the peak RSS is the highest of the rounds'. The peak RSS is the
    steady state's: the heap is trimmed after the warmup, so what building
    the system freed (XLA's compiler works in tens of MiB of heap) but glibc
    kept does not count in the steps' peak.
    """
    base = RSS.current()
    runner, info = prepare()
    runner.run(warmup)
    trim_heap()
    RSS.reset()
    samples = runner.run(steps, None if earlier is None else earlier[0])
    rss = {"rss_base_bytes": base, "rss_peak_steps_bytes": RSS.peak(), "rss_now_bytes": RSS.current()}
    if earlier is not None and earlier[1]["rss_peak_steps_bytes"] > rss["rss_peak_steps_bytes"]:
        rss = {k: earlier[1][k] for k in rss}
    return samples, {**info, **timing_summary(samples, ids_per_step), **rss, "loadavg_1min": os.getloadavg()[0]}


_HLO_ITEMSIZE = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8,
                 "u64": 8}


def hlo_collective_bytes(text: str, devices: int) -> float:
    """Bytes one device receives through the collectives of a compiled HLO module (`compile().as_text()`).

    `(D-1)/D` of each all-to-all's and all-gather's result, twice that for an
    all-reduce (a ring); read from the program itself, independently of any
    estimate.
    """
    import re

    total = 0.0
    ops = r"all-to-all|all-gather|all-reduce|reduce-scatter|collective-permute"
    for shape, op in re.findall(rf"=\s+(\(.*?\)|\S+)\s+({ops})(?:-start)?\(", text):
        size = sum(_HLO_ITEMSIZE[t] * int(np.prod([int(x) for x in dims.split(",") if x], dtype=np.int64))
                   for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape))
        total += (2 if op == "all-reduce" else 1) * size * (devices - 1) / devices
    return total


def write_json(path: str, results: Any) -> None:
    """Writes a benchmark's results as JSON (its folder made if missing): one format for every script's record."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
