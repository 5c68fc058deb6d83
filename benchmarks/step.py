#!/usr/bin/env python
"""Benchmark of a sparse_embed training step: forward + backward-with-update, tables donated.

Default workload W1: 8 tables x 1,000,000 rows x 64 f32, global batch 4096,
20 ids per sample per table (uniform random), sum combiner, 1 device, SGD.
Measured per run:

- the train step, `jax.jit(jax.value_and_grad(loss), donate_argnums=0)`
  with a loss linear in the activations (a fixed random cotangent), for
  each optimizer asked for (`--optimizer sgd|adagrad|all`);
- the forward-only (inference) lookup;
- vocabulary independence: one 64-dim table of 10^7 vs 10^5 rows, SGD,
  measured in alternating blocks of steps: on the same batches (goal: ratio
  <= 1.3), and with ids spread over each whole vocabulary (cache effects).

Preprocessing is not timed: a few batches are preprocessed up front and
cycled. Reported: median / p10 / p90 wall time per step, median process
CPU time per step, lookups/s (ids per step / median), table+slot bytes, the
compiled step's temp bytes, peak RSS, minor page faults per step, and the
number of table-shaped `copy` ops in the compiled HLO.

Reading the numbers on XLA:CPU: temp buffers above glibc's mmap threshold
are mapped fresh on every execution, so a step page-faults its whole temp
allocation (the `faults` column; the kernel's page zeroing is counted in
the `cpu` column). Running with `MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0
MALLOC_TRIM_THRESHOLD_=100000000000` keeps freed memory for reuse (at the
cost of RSS never shrinking); the MALLOC_* variables in effect are recorded.

    python benchmarks/step.py                       # W1, SGD
    python benchmarks/step.py --optimizer all --json benchmarks/results_step.json
    python benchmarks/step.py --small               # smoke run, a few seconds
    python benchmarks/step.py --devices 2 --zipf 1.05
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import platform
import re
import resource
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

if TYPE_CHECKING:  # jax is imported in main(), after XLA_FLAGS is set
    import jax

# --optimizer name -> sparse_embed.optimizers class (all built with LEARNING_RATE, defaults otherwise)
OPTIMIZERS = {
    "sgd": "SGD", "adagrad": "Adagrad", "rowwise_adagrad": "RowwiseAdagrad", "adam": "Adam",
    "adagrad_momentum": "AdagradMomentum", "ftrl": "FTRL", "laprop": "LaProp",
}
LEARNING_RATE = 0.01
NUM_BATCHES = 4
MIB = 2**20
HASH_PRIME = 2_654_435_761  # scatters Zipf ranks over the vocabulary (a bijection mod rows)

# Workload presets; explicit flags override them.
PRESETS: dict[str, dict[str, Any]] = {
    "W1": dict(tables=8, rows=1_000_000, dim=64, batch=4096, ids_per_sample=20,
               steps=50, warmup=5, vocab_sizes=(10**7, 10**5)),
    "small": dict(tables=2, rows=10_000, dim=64, batch=512, ids_per_sample=10,
                  steps=10, warmup=2, vocab_sizes=(10**6, 10**4)),
}


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one step looks up: `tables` tables, each read by one pooled feature."""

    name: str
    tables: int
    rows: int
    dim: int
    batch: int
    ids_per_sample: int
    devices: int
    zipf: float | None  # None = uniform ids
    id_range: int | None = None  # ids drawn from [0, id_range) instead of [0, rows)

    @property
    def ids_per_step(self) -> int:
        return self.tables * self.batch * self.ids_per_sample

    def with_single_table(self, rows: int, id_range: int | None = None) -> "Workload":
        """The same batch shape on one table of `rows` rows (the vocabulary test)."""
        return dataclasses.replace(self, name=f"1x{rows}", tables=1, rows=rows, id_range=id_range)


# ---------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parses flags; workload flags left unset take the W1 (or --small) preset."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny workload for smoke runs")
    p.add_argument("--tables", type=int, help="number of tables (W1: 8)")
    p.add_argument("--rows", type=int, help="rows per table (W1: 1,000,000)")
    p.add_argument("--dim", type=int, help="embedding dim (W1: 64)")
    p.add_argument("--batch", type=int, help="global batch size (W1: 4096)")
    p.add_argument("--ids-per-sample", type=int, help="ids per sample per table (W1: 20)")
    p.add_argument("--devices", type=int, default=1, help="devices (>1 on CPU: simulated host devices)")
    p.add_argument("--steps", type=int, help="timed steps per measurement (W1: 50)")
    p.add_argument("--warmup", type=int, help="untimed steps before each measurement (W1: 5)")
    p.add_argument("--zipf", type=float, default=None, help="Zipf exponent of the ids (default: uniform)")
    p.add_argument("--optimizer", choices=(*OPTIMIZERS, "all"), default="sgd",
                   help="table optimizer; 'all' times every one side by side")
    p.add_argument("--vocab-sizes", type=int, nargs=2, metavar=("LARGE", "SMALL"),
                   help="rows of the vocabulary-independence tables (W1: 1e7 1e5; --small: 1e6 1e4)")
    p.add_argument("--vocab-rounds", type=int, default=5, help="alternating blocks per vocabulary size")
    p.add_argument("--no-forward", action="store_true", help="skip the forward-only measurement")
    p.add_argument("--no-vocab", action="store_true", help="skip the vocabulary-independence test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    preset = "small" if args.small else "W1"
    for key, value in PRESETS[preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.preset = preset
    if args.zipf is not None and args.zipf <= 1.0:
        p.error("--zipf must be > 1")
    if args.vocab_sizes[0] == args.vocab_sizes[1]:
        p.error("--vocab-sizes needs two different sizes")
    args.vocab_sizes = tuple(args.vocab_sizes)
    return args


def workload_of(args: argparse.Namespace) -> Workload:
    """The workload the flags describe; named after the preset only if no flag changed it."""
    fields = ("tables", "rows", "dim", "batch", "ids_per_sample")
    is_preset = args.devices == 1 and args.zipf is None and all(
        getattr(args, k) == PRESETS[args.preset][k] for k in fields)
    return Workload(args.preset if is_preset else "custom", *(getattr(args, k) for k in fields),
                    args.devices, args.zipf)


def configure_devices(n: int) -> None:
    """Asks XLA:CPU for at least `n` host devices (only effective before JAX starts a backend).

    A larger count already in XLA_FLAGS (e.g. a test's simulated mesh) is kept.
    """
    flag = "--xla_force_host_platform_device_count"
    flags = os.environ.get("XLA_FLAGS", "")
    current = re.search(rf"{flag}=(\d+)", flags)
    if n > 1 and (current is None or int(current.group(1)) < n):
        flags = re.sub(rf"{flag}=\d+", "", flags)
        os.environ["XLA_FLAGS"] = f"{flags} {flag}={n}".strip()


def make_mesh(n: int) -> "jax.sharding.Mesh":
    """A 1-D mesh ("x") over the first n devices."""
    import jax

    devices = jax.devices()
    if len(devices) < n:
        raise SystemExit(f"--devices {n}: JAX has only {len(devices)} devices (was it initialised before main?).")
    return jax.sharding.Mesh(np.array(devices[:n]), ("x",))


# ---------------------------------------------------------------- memory


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


# ---------------------------------------------------------------- data


def id_sampler(rows: int, zipf: float | None) -> Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]:
    """Draws int32 ids in [0, rows): uniform, or Zipf(zipf) ranks scattered over the rows."""
    if zipf is None:
        return lambda rng, shape: rng.integers(0, rows, shape, dtype=np.int32)
    cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -zipf)
    cdf /= cdf[-1]

    def sample(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        rank = np.minimum(np.searchsorted(cdf, rng.random(shape), side="right"), rows - 1)
        return (rank.astype(np.int64) * HASH_PRIME % rows).astype(np.int32)

    return sample


def build_plan(w: Workload, optimizer: str, mesh: "jax.sharding.Mesh"):
    """Features f0..f{n-1}, feature i reading table t{i}; default ("auto") stacking."""
    import sparse_embed as se

    opt = getattr(se.optimizers, OPTIMIZERS[optimizer])(LEARNING_RATE)
    features = {}
    for i in range(w.tables):
        table = se.TableSpec(f"t{i}", w.rows, w.dim, optimizer=opt, combiner="sum")
        features[f"f{i}"] = se.FeatureSpec(f"f{i}", table, batch_size=w.batch)
    return se.plan(features, mesh)


def make_batches(plan, w: Workload, rng: np.random.Generator) -> tuple[list[Any], Any]:
    """NUM_BATCHES preprocessed batches with one shared capacity, and their merged Stats."""
    import sparse_embed as se

    sample = id_sampler(w.id_range or w.rows, w.zipf)
    raw = [{name: sample(rng, (w.batch, w.ids_per_sample)) for name in plan.features} for _ in range(NUM_BATCHES)]
    for _ in range(2):  # if auto capacity grew on a later batch, redo the earlier ones at the final size
        done = [se.preprocess(plan, ids) for ids in raw]
        if len({tuple(sorted(stats.capacity.items())) for _, stats in done}) == 1:
            break
    return [b for b, _ in done], functools.reduce(se.Stats.merge, [s for _, s in done])


def make_cotangents(plan, rng: np.random.Generator) -> dict[str, "jax.Array"]:
    """A fixed random loss cotangent per feature, sharded like its activations."""
    import jax

    return {
        name: jax.device_put(rng.standard_normal(f.output_shape, np.float32), plan.batch_sharding())
        for name, f in plan.features.items()
    }


# ---------------------------------------------------------------- steps


def compile_train(plan, tables, batch, cotangents):
    """The train step `(loss, tables) = value_and_grad(<lookup, cotangent>)(tables)`, tables donated.

    The loss is returned so that the forward lookup stays live: under plain
    `jax.grad` of a loss linear in the activations, XLA drops the forward
    gather as dead code (the backward needs only the ids and the cotangent),
    and the step would time the backward alone.
    """
    import jax
    import jax.numpy as jnp
    import sparse_embed as se

    def loss(tables, batch, cotangents):
        acts = se.lookup(plan, batch, tables, 0)
        return sum(jnp.sum(acts[k] * cotangents[k]) for k in acts)

    return jax.jit(jax.value_and_grad(loss), donate_argnums=0).lower(tables, batch, cotangents).compile()


def compile_forward(plan, tables, batch):
    """The inference step: activations only, tables not donated."""
    import jax
    import sparse_embed as se

    return jax.jit(lambda tables, batch: se.lookup(plan, batch, tables, 0)).lower(tables, batch).compile()


HLO_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}
_COPY_RE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+copy(?:-start)?\(")


def table_copies(hlo_text: str, tables: Any) -> int:
    """Number of HLO `copy` ops whose result has a (per-device) table or slot shape."""
    import jax

    shapes = set()
    for x in jax.tree.leaves(tables):
        dims = ",".join(map(str, x.sharding.shard_shape(x.shape)))
        shapes.add(f"{HLO_DTYPES.get(x.dtype.name, x.dtype.name)}[{dims}]")
    hits = 0
    for line in hlo_text.splitlines():
        m = _COPY_RE.match(line)
        if m and any(s in m.group(1) for s in shapes):
            hits += 1
    return hits


def compiled_memory(compiled) -> dict[str, int]:
    """The compiled executable's memory_analysis() (bytes), if the backend provides it."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # not implemented on every backend/version
        return {}
    fields = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes")
    return {f.removesuffix("_size_in_bytes") + "_bytes": int(getattr(m, f)) for f in fields if hasattr(m, f)}


@dataclasses.dataclass
class Samples:
    """Per-step wall and process CPU seconds, and the minor page faults of those steps."""

    wall: list[float] = dataclasses.field(default_factory=list)
    cpu: list[float] = dataclasses.field(default_factory=list)
    minor_faults: int = 0


@dataclasses.dataclass
class Runner:
    """A compiled step, the state it threads through, and the batches it cycles."""

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
            jax.block_until_ready(out)
            samples.wall.append(time.perf_counter() - wall)
            samples.cpu.append(time.process_time() - cpu)
        samples.minor_faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        return samples


def train_runner(compiled, tables, batches, cotangents) -> Runner:
    """Threads the donated tables through the train step; blocks on (loss, tables)."""

    def call(tables, batch):
        loss, new = compiled(tables, batch, cotangents)
        return new, (loss, new)

    return Runner(call, tables, batches)


def forward_runner(compiled, tables, batches) -> Runner:
    """Runs the forward on fixed tables; blocks on the activations."""
    return Runner(lambda tables, batch: (tables, compiled(tables, batch)), tables, batches)


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


# ---------------------------------------------------------------- measurements


@dataclasses.dataclass
class Setup:
    """A workload's plan, initialised tables, batches and cotangents."""

    workload: Workload
    plan: Any
    tables: Any
    batches: list[Any]
    stats: Any
    cotangents: dict[str, Any]
    state_bytes: int  # tables + slots (kept: `tables` is dropped once donated)

    @classmethod
    def create(cls, w: Workload, optimizer: str, mesh, seed: int) -> "Setup":
        import jax
        import sparse_embed as se

        rng = np.random.default_rng(seed)
        plan = build_plan(w, optimizer, mesh)
        tables = jax.block_until_ready(se.init_tables(plan, jax.random.key(seed)))
        batches, stats = make_batches(plan, w, rng)
        return cls(w, plan, tables, batches, stats, make_cotangents(plan, rng), state_bytes(tables))

    def donate_tables(self) -> Any:
        """Hands the tables to a step that donates them; this setup no longer holds them."""
        tables, self.tables = self.tables, None
        return tables

    def describe(self) -> dict[str, Any]:
        """Static facts of the setup: sizes and what preprocessing saw."""
        return {
            "workload": dataclasses.asdict(self.workload),
            "ids_per_step": self.workload.ids_per_step,
            "stacks": list(self.plan.stack_names),
            "state_bytes": self.state_bytes,
            "capacity": dict(self.stats.capacity),
            "max_unique_ids_per_partition": dict(self.stats.max_unique_ids_per_partition),
            "max_ids_per_partition": dict(self.stats.max_ids_per_partition),
        }


def compile_and_inspect(compile_fn: Callable[[], Any], tables: Any) -> tuple[Any, dict[str, Any]]:
    """Compiles, and reports compile time, memory analysis and table-shaped copies."""
    t0 = time.perf_counter()
    compiled = compile_fn()
    info = {"compile_s": time.perf_counter() - t0, **compiled_memory(compiled),
            "hlo_table_copies": table_copies(compiled.as_text(), tables)}
    return compiled, info


def prepare_forward(setup: Setup) -> tuple[Runner, dict[str, Any]]:
    """The compiled forward-only lookup as a runner over the setup's tables (not donated)."""
    compiled, info = compile_and_inspect(
        lambda: compile_forward(setup.plan, setup.tables, setup.batches[0]), setup.tables)
    return forward_runner(compiled, setup.tables, setup.batches), info


def prepare_train(setup: Setup) -> tuple[Runner, dict[str, Any]]:
    """The compiled train step as a runner; it takes over (donates) the setup's tables."""
    compiled, info = compile_and_inspect(
        lambda: compile_train(setup.plan, setup.tables, setup.batches[0], setup.cotangents), setup.tables)
    return train_runner(compiled, setup.donate_tables(), setup.batches, setup.cotangents), info


def measure(setup: Setup, prepared: tuple[Runner, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Warms up, then times `args.steps` steps; returns timings, memory and HLO facts."""
    runner, info = prepared
    runner.run(args.warmup)
    RSS.reset()
    samples = runner.run(args.steps)
    return {**setup.describe(), **info, **timing_summary(samples, setup.workload.ids_per_step),
            "rss_peak_steps_bytes": RSS.peak(), "rss_now_bytes": RSS.current()}


def bench_optimizer(w: Workload, optimizer: str, mesh, args: argparse.Namespace, forward: bool) -> dict[str, Any]:
    """Times the train step for one optimizer (and first the forward-only lookup if `forward`)."""
    setup = Setup.create(w, optimizer, mesh, args.seed)
    out = {"forward": measure(setup, prepare_forward(setup), args)} if forward else {}
    out[f"train_{optimizer}"] = measure(setup, prepare_train(setup), args)
    return out


def bench_vocab_pair(w: Workload, mesh, args: argparse.Namespace, id_range: int | None) -> dict[str, Any]:
    """SGD train step on one table of LARGE vs SMALL rows, timed in alternating blocks.

    `id_range=None` draws each table's ids from its whole vocabulary; an int
    draws both from `[0, id_range)`, i.e. the very same batches.
    """
    setups = {rows: Setup.create(w.with_single_table(rows, id_range), "sgd", mesh, args.seed)
              for rows in args.vocab_sizes}
    prepared = {rows: prepare_train(s) for rows, s in setups.items()}
    for runner, _ in prepared.values():
        runner.run(args.warmup)
    samples = {rows: Samples() for rows in args.vocab_sizes}
    block = max(1, math.ceil(args.steps / args.vocab_rounds))
    RSS.reset()
    for i in range(args.vocab_rounds):
        order = args.vocab_sizes if i % 2 == 0 else args.vocab_sizes[::-1]  # ABBA against drift
        for rows in order:
            prepared[rows][0].run(block, into=samples[rows])
    out = {
        str(rows): {**s.describe(), **prepared[rows][1], **timing_summary(samples[rows], s.workload.ids_per_step)}
        for rows, s in setups.items()
    }
    large, small = (out[str(rows)]["median_ms"] for rows in args.vocab_sizes)
    return {"id_range": id_range, "block_steps": block, "rounds": args.vocab_rounds,
            "rss_peak_steps_bytes": RSS.peak(), "by_rows": out, "ratio": large / small}


def bench_vocab(w: Workload, mesh, args: argparse.Namespace) -> dict[str, Any]:
    """Vocabulary independence, two ways.

    - `same_batch` (the goal, <= 1.3x): both tables get the very same ids (all
      < SMALL), so any difference is per-step work that grows with the
      vocabulary (a dense gradient, a full-table copy or pass).
    - `full_range`: each table's ids spread over its whole vocabulary; this
      adds the memory hierarchy (a SMALL table may fit in cache, a LARGE one
      cannot), reported for honesty, not as the goal.
    """
    small = min(args.vocab_sizes)
    return {"sizes": list(args.vocab_sizes),
            "same_batch": bench_vocab_pair(w, mesh, args, id_range=small),
            "full_range": bench_vocab_pair(w, mesh, args, id_range=None)}


# ---------------------------------------------------------------- report


def cpu_model() -> str:
    """The CPU's model name (Linux), else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def library_version() -> dict[str, Any]:
    """sparse_embed's version, git commit and whether its sources differ from that commit."""
    import sparse_embed

    root = os.path.dirname(os.path.dirname(os.path.abspath(sparse_embed.__file__)))

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", "-C", root, *cmd], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"version": sparse_embed.__version__, "commit": git("rev-parse", "--short", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--", "sparse_embed"))}


def environment(argv: Sequence[str] | None) -> dict[str, Any]:
    import jax
    import jaxlib

    return {
        "command": " ".join(["python benchmarks/step.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "sparse_embed": library_version(),
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "jax_devices": len(jax.devices()),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))},
    }


def _row(name: str, r: dict[str, Any]) -> str:
    mib = lambda key: f"{r[key] / MIB:9.0f}" if key in r else f"{'-':>9}"
    return (f"{name:<24}{r['median_ms']:9.1f}{r['p10_ms']:9.1f}{r['p90_ms']:9.1f}{r['cpu_median_ms']:9.1f}"
            f"{r['lookups_per_s'] / 1e6:10.2f}{mib('state_bytes')}{mib('temp_bytes')}"
            f"{mib('rss_peak_steps_bytes')}{r['minor_faults_per_step'] / 1e3:9.1f}{r['hlo_table_copies']:8d}")


def format_report(results: dict[str, Any]) -> str:
    env, w = results["env"], results["workload"]
    lib = env["sparse_embed"]
    zipf = "uniform" if w["zipf"] is None else f"zipf {w['zipf']}"
    lines = [
        f"sparse_embed step benchmark  ({env['date']}, sparse_embed {lib['commit']}{'+dirty' * lib['dirty']}, "
        f"jax {env['jax']}, {env['backend']}, {env['cpu_count']} cpus, {w['devices']} device(s))",
        f"workload {w['name']}: {w['tables']} tables x {w['rows']:,} rows x {w['dim']}, batch {w['batch']}, "
        f"{w['ids_per_sample']} ids/sample/table ({zipf}), sum combiner; "
        f"{results['ids_per_step']:,} ids/step",
        "",
        f"{'measurement':<24}{'median':>9}{'p10':>9}{'p90':>9}{'cpu':>9}{'Mlookup/s':>10}{'state':>9}"
        f"{'temp':>9}{'peakRSS':>9}{'faults':>9}{'copies':>8}",
        f"{'':<24}{'ms':>9}{'ms':>9}{'ms':>9}{'ms':>9}{'':>10}{'MiB':>9}{'MiB':>9}{'MiB':>9}"
        f"{'k/step':>9}{'(HLO)':>8}",
    ]
    lines += [_row(name, r) for name, r in results["steps"].items()]
    vocab = results.get("vocab")
    if vocab:
        large, small = vocab["sizes"]
        for key, what in (("same_batch", f"the same batches, ids < {small:,}"),
                          ("full_range", "ids over each table's whole vocabulary")):
            v = vocab[key]
            lines += ["", f"vocabulary independence, {what} (1 table x {w['dim']}, batch {w['batch']} x "
                          f"{w['ids_per_sample']} ids, SGD, {v['rounds']} alternating blocks of {v['block_steps']} steps):"]
            lines += [_row(f"{int(rows):,} rows", r) for rows, r in v["by_rows"].items()]
            goal = (" (goal <= 1.3x: " + ("ok" if v["ratio"] <= 1.3 else "ABOVE GOAL") + ")") if key == "same_batch" else \
                " (memory hierarchy included; reported, not a goal)"
            lines.append(f"ratio {large:,} / {small:,} rows: {v['ratio']:.2f}x{goal}")
    lines += [
        "",
        f"process peak RSS: {results['rss_process_peak_bytes'] / MIB:.0f} MiB",
        "cpu: median process CPU time per step (all threads); temp: compiled memory_analysis(); "
        "peakRSS: peak during the timed steps;",
        "faults: minor page faults per step (thousands); copies: table-shaped copy ops in the compiled HLO.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; prints a table, optionally writes JSON, returns the results dict."""
    args = parse_args(argv)
    configure_devices(args.devices)
    import sparse_embed  # noqa: F401  (sets its XLA flags before the backend starts)

    mesh = make_mesh(args.devices)
    w = workload_of(args)
    optimizers = tuple(OPTIMIZERS) if args.optimizer == "all" else (args.optimizer,)
    results: dict[str, Any] = {"env": environment(argv), "workload": dataclasses.asdict(w),
                               "ids_per_step": w.ids_per_step, "steps": {}}
    for i, opt in enumerate(optimizers):
        results["steps"].update(bench_optimizer(w, opt, mesh, args, forward=i == 0 and not args.no_forward))
        gc.collect()
    if not args.no_vocab:
        results["vocab"] = bench_vocab(w, mesh, args)
    results["rss_process_peak_bytes"] = RSS.final_process_peak()
    print(format_report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
    return results


if __name__ == "__main__":
    main()
