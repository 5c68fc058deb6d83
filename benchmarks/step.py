#!/usr/bin/env python
"""Benchmark of a sparse_embed training step, side by side with FBGEMM, torch and naive Flax.

Default workload W1: 8 tables x 1,000,000 rows x 64 f32, global batch 4096,
20 ids per sample per table (uniform random, or Zipf with `--zipf`), sum
combiner. Measured per run, for sparse_embed on each `--devices` count
(more than 1: simulated host devices) and, once, for each peer in
`--peers` (single-process CPU; see `benchmarks/peers.py`), all on the very
same ids and loss cotangents:

- the train step for each optimizer asked for (`--optimizer`, default SGD,
  Adagrad and RowwiseAdagrad, the ones FBGEMM has on CPU). sparse_embed's is
  `jax.jit(jax.value_and_grad(loss), donate_argnums=0)` with a loss linear
  in the activations (a fixed random cotangent); the peers run forward +
  `out.backward(cotangent)` (+ `optimizer.step()` where it is not fused);
- the forward-only (inference) lookup;
- the memory-traffic lower bound of each measurement (`peers.lower_bound`),
  from the issue's bandwidths and from bandwidths measured in this run;
- vocabulary independence (sparse_embed): one 64-dim table of 10^7 vs 10^5
  rows, SGD, in alternating blocks of steps: on the same batches (goal:
  ratio <= 1.3), and with ids spread over each whole vocabulary.

The measurements run one after the other (forward, then each optimizer),
all systems in turn within each, and each system's tables are freed before
the next system builds its own. Preprocessing and input conversion are not
timed: a few batches are prepared up front and cycled. Reported: median /
p10 / p90 wall time per step, its ratio to FBGEMM's and to the lower bound,
median process CPU time, lookups/s, table+slot bytes, peak RSS during the
steps, and for sparse_embed the compiled temp bytes, minor page faults per
step and table-shaped `copy` ops in the compiled HLO; then the issue's
targets with pass/fail (judged on W1 with 1 device). `--quick` also checks
that all systems agree, from the same tables, on the forward output and
on the tables after one SGD step.

Reading the numbers on XLA:CPU: temp buffers above glibc's mmap threshold
are mapped fresh on every execution, so a step page-faults its whole temp
allocation (the `faults` column; the kernel's page zeroing is counted in
the `cpu` column), and tables live on 4 KiB pages (a TLB miss per random
row). `--hugepages` restarts the script with
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`: glibc then backs large blocks with
transparent huge pages, for every system in the run alike (tables, slots,
XLA's and torch's buffers). The MALLOC_*/GLIBC_TUNABLES in effect are recorded.

    python benchmarks/step.py                       # W1: sparse_embed and every installed peer
    python benchmarks/step.py --json benchmarks/results_step_peers.json --plot benchmarks/step.png
    python benchmarks/step.py --quick               # smoke run, all installed peers, seconds
    python benchmarks/step.py --devices 1,8 --zipf 1.05 --peers fbgemm
    python benchmarks/step.py --optimizer all --peers none
    python benchmarks/step.py --hugepages           # glibc malloc on transparent huge pages
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import importlib.metadata
import itertools
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

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import peers  # noqa: E402
from benchmarks.peers import FORWARD  # noqa: E402

if TYPE_CHECKING:  # jax is imported in main(), after XLA_FLAGS is set
    import jax

# --optimizer name -> sparse_embed.optimizers class (all built with LEARNING_RATE, defaults otherwise)
OPTIMIZERS = {
    "sgd": "SGD", "adagrad": "Adagrad", "rowwise_adagrad": "RowwiseAdagrad", "adam": "Adam",
    "adagrad_momentum": "AdagradMomentum", "ftrl": "FTRL", "laprop": "LaProp",
}
DEFAULT_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")  # the ones FBGEMM's CPU TBE has
LEARNING_RATE = 0.01
NUM_BATCHES = 4
MIB = 2**20
HASH_PRIME = 2_654_435_761  # scatters Zipf ranks over the vocabulary (a bijection mod rows)
AGREEMENT_TOLERANCE = 1e-5  # max |difference| of forward outputs and of the tables after one SGD step (--check)

# Workload presets; explicit flags override them.
PRESETS: dict[str, dict[str, Any]] = {
    "W1": dict(tables=8, rows=1_000_000, dim=64, batch=4096, ids_per_sample=20,
               steps=50, warmup=5, vocab_sizes=(10**7, 10**5)),
    "quick": dict(tables=2, rows=10_000, dim=64, batch=512, ids_per_sample=10,
                  steps=3, warmup=5, vocab_sizes=(10**5, 10**3)),
}

# The issue's targets for sparse_embed on W1, 1 device: (measurement, against, at most).
TARGETS = (
    ("train_sgd", "fbgemm", 0.45), ("train_adagrad", "fbgemm", 0.35), (FORWARD, "fbgemm", 0.6),
    ("train_sgd", "bound", 1.5), (FORWARD, "bound", 1.5), ("train_adagrad", "bound", 2.5),
)
VOCAB_GOAL = 1.3


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
    p.add_argument("--quick", "--small", action="store_true", help="tiny workload, a few steps: a smoke run")
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
    p.add_argument("--slow-steps", type=int, default=5,
                   help="at most this many timed steps (after 1 warmup) for the naive Flax train steps")
    p.add_argument("--zipf", type=float, default=None, help="Zipf exponent of the ids (default: uniform)")
    p.add_argument("--optimizer", type=_names(tuple(OPTIMIZERS)), default=DEFAULT_OPTIMIZERS,
                   help="comma-separated table optimizers, or 'all' (default: sgd,adagrad,rowwise_adagrad)")
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
    preset = "quick" if args.quick else "W1"
    for key, value in PRESETS[preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.preset = preset
    if args.check is None:
        args.check = args.quick
    if args.zipf is not None and args.zipf <= 1.0:
        p.error("--zipf must be > 1")
    if args.vocab_sizes[0] == args.vocab_sizes[1]:
        p.error("--vocab-sizes needs two different sizes")
    args.vocab_sizes = tuple(args.vocab_sizes)
    return args


def workload_of(args: argparse.Namespace) -> Workload:
    """The workload the flags describe (on the first device count); named after the preset if no flag changed it."""
    fields = ("tables", "rows", "dim", "batch", "ids_per_sample")
    is_preset = args.zipf is None and all(getattr(args, k) == PRESETS[args.preset][k] for k in fields)
    return Workload(args.preset if is_preset else "custom", *(getattr(args, k) for k in fields),
                    args.devices[0], args.zipf)


def measurements_of(args: argparse.Namespace) -> list[str]:
    return ([] if args.no_forward else [FORWARD]) + [f"train_{o}" for o in args.optimizer]


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


def cpu_threads() -> int:
    """The cores this process may run on: what XLA:CPU uses, and what torch is set to."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


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


def make_problem(w: Workload, seed: int) -> peers.Problem:
    """NUM_BATCHES batches of ids and one fixed cotangent per table: the inputs every system gets."""
    rng = np.random.default_rng(seed)
    sample = id_sampler(w.id_range or w.rows, w.zipf)
    ids = [[sample(rng, (w.batch, w.ids_per_sample)) for _ in range(w.tables)] for _ in range(NUM_BATCHES)]
    cotangents = [rng.standard_normal((w.batch, w.dim), np.float32) for _ in range(w.tables)]
    return peers.Problem(w.rows, w.dim, ids, cotangents, LEARNING_RATE)


def feature_ids(ids: list[np.ndarray]) -> dict[str, np.ndarray]:
    """One batch's per-table ids as sparse_embed's `{feature: ids}` (feature f{i} reads table t{i})."""
    return {f"f{i}": x for i, x in enumerate(ids)}


def build_plan(w: Workload, optimizer: str, mesh: "jax.sharding.Mesh"):
    """Features f0..f{n-1}, feature i reading table t{i}; default ("auto") stacking."""
    import sparse_embed as se

    opt = getattr(se.optimizers, OPTIMIZERS[optimizer])(LEARNING_RATE)
    features = {}
    for i in range(w.tables):
        table = se.TableSpec(f"t{i}", w.rows, w.dim, optimizer=opt, combiner="sum")
        features[f"f{i}"] = se.FeatureSpec(f"f{i}", table, batch_size=w.batch)
    return se.plan(features, mesh)


def make_batches(plan, problem: peers.Problem) -> tuple[list[Any], Any]:
    """The problem's batches preprocessed with one shared capacity, and their merged Stats."""
    import sparse_embed as se

    raw = [feature_ids(ids) for ids in problem.ids]
    for _ in range(2):  # if auto capacity grew on a later batch, redo the earlier ones at the final size
        done = [se.preprocess(plan, ids) for ids in raw]
        if len({tuple(sorted(stats.capacity.items())) for _, stats in done}) == 1:
            break
    return [b for b, _ in done], functools.reduce(se.Stats.merge, [s for _, s in done])


def make_cotangents(plan, problem: peers.Problem) -> dict[str, "jax.Array"]:
    """The problem's cotangents per feature, sharded like the activations."""
    import jax

    return {name: jax.device_put(c, plan.batch_sharding()) for name, c in feature_ids(problem.cotangents).items()}


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


# ---------------------------------------------------------------- sparse_embed


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
    def create(cls, w: Workload, optimizer: str, mesh, problem: peers.Problem, seed: int) -> "Setup":
        import jax
        import sparse_embed as se

        plan = build_plan(w, optimizer, mesh)
        tables = jax.block_until_ready(se.init_tables(plan, jax.random.key(seed)))
        batches, stats = make_batches(plan, problem)
        return cls(w, plan, tables, batches, stats, make_cotangents(plan, problem), state_bytes(tables))

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
    return forward_runner(compiled, setup.tables, setup.batches), {**setup.describe(), **info}


def prepare_train(setup: Setup) -> tuple[Runner, dict[str, Any]]:
    """The compiled train step as a runner; it takes over (donates) the setup's tables."""
    compiled, info = compile_and_inspect(
        lambda: compile_train(setup.plan, setup.tables, setup.batches[0], setup.cotangents), setup.tables)
    return (train_runner(compiled, setup.donate_tables(), setup.batches, setup.cotangents),
            {**setup.describe(), **info})


def optimizer_of(measurement: str) -> str:
    """The --optimizer name of a measurement (the forward runs on SGD tables, which have no slots)."""
    return "sgd" if measurement == FORWARD else measurement.removeprefix("train_")


def prepare_sparse_embed(w: Workload, mesh, problem: peers.Problem, seed: int, measurement: str):
    """sparse_embed's runner (and facts) for one measurement, on fresh tables."""
    setup = Setup.create(w, optimizer_of(measurement), mesh, problem, seed)
    return prepare_forward(setup) if measurement == FORWARD else prepare_train(setup)


def prepare_peer(peer: peers.Peer, problem: peers.Problem, threads: int, measurement: str):
    """A peer's runner (and state bytes) for one measurement, on fresh tables."""
    s = peer.build(measurement, problem, threads)
    return Runner(s.call, s.state, s.batches), {"state_bytes": s.state_bytes}


def free_memory() -> None:
    """Collects what the last system left in reference cycles (its tables with them), then freezes the survivors.

    With torch and jax loaded a full collection takes ~0.2 s; frozen objects
    are not scanned again, so each later call only looks at new objects.
    `main` unfreezes them at the end.
    """
    gc.collect()
    gc.freeze()


def measure(prepare: Callable[[], tuple[Runner, dict[str, Any]]], steps: int, warmup: int,
            ids_per_step: int) -> dict[str, Any]:
    """Builds a runner, warms up, then times `steps` steps; the runner (and its tables) is dropped on return."""
    base = RSS.current()
    runner, info = prepare()
    runner.run(warmup)
    RSS.reset()
    samples = runner.run(steps)
    return {**info, **timing_summary(samples, ids_per_step), "rss_base_bytes": base,
            "rss_peak_steps_bytes": RSS.peak(), "rss_now_bytes": RSS.current(), "loadavg_1min": os.getloadavg()[0]}


def bench_vocab_pair(w: Workload, mesh, args: argparse.Namespace, id_range: int | None) -> dict[str, Any]:
    """SGD train step on one table of LARGE vs SMALL rows, timed in alternating blocks.

    `id_range=None` draws each table's ids from its whole vocabulary; an int
    draws both from `[0, id_range)`, i.e. the very same batches.
    """
    setups = {}
    for rows in args.vocab_sizes:
        single = w.with_single_table(rows, id_range)
        setups[rows] = Setup.create(single, "sgd", mesh, make_problem(single, args.seed), args.seed)
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
        str(rows): {**prepared[rows][1], **timing_summary(samples[rows], s.workload.ids_per_step)}
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


# ---------------------------------------------------------------- systems side by side


@dataclasses.dataclass
class System:
    """One row group of the comparison: sparse_embed on a mesh, or a peer."""

    key: str
    label: str
    measurements: tuple[str, ...]
    prepare: Callable[[str], tuple[Runner, dict[str, Any]]] | None  # None: not available
    status: str = "ok"
    slow_train: bool = False
    devices: int | None = None  # sparse_embed's mesh; peers: one process

    def steps(self, measurement: str, args: argparse.Namespace) -> tuple[int, int]:
        """(timed steps, warmup steps) for a measurement: fewer for slow train steps."""
        if self.slow_train and measurement != FORWARD:
            return min(args.steps, args.slow_steps), min(args.warmup, 1)
        return args.steps, args.warmup


def sparse_embed_key(devices: int) -> str:
    return "sparse_embed" if devices == 1 else f"sparse_embed_{devices}dev"


def make_systems(args: argparse.Namespace, w: Workload, problem: peers.Problem, threads: int) -> list[System]:
    """sparse_embed on each device count, then the peers asked for (unavailable ones without a prepare)."""
    every = tuple(measurements_of(args))
    systems = []
    for n in args.devices:
        wn, mesh = dataclasses.replace(w, devices=n), make_mesh(n)
        systems.append(System(sparse_embed_key(n), "sparse_embed" + (f" ({n} dev)" if n > 1 else ""), every,
                              functools.partial(prepare_sparse_embed, wn, mesh, problem, args.seed), devices=n))
    for key in args.peers:
        peer = peers.PEERS[key]
        missing = peer.missing()
        prepare = None if missing else functools.partial(prepare_peer, peer, problem, threads)
        systems.append(System(key, peer.label, peer.measurements, prepare, missing or "ok", peer.slow_train))
    return systems


def run_systems(systems: list[System], measurements: list[str], args: argparse.Namespace,
                ids_per_step: int) -> dict[str, Any]:
    """Each measurement for every available system in turn; tables freed between systems."""
    out = {s.key: {"label": s.label, "status": s.status, "devices": s.devices, "steps": {}} for s in systems}
    for m in measurements:
        for s in systems:
            if s.prepare is None or m not in s.measurements:
                continue
            steps, warmup = s.steps(m, args)
            out[s.key]["steps"][m] = measure(functools.partial(s.prepare, m), steps, warmup, ids_per_step)
            free_memory()
    return out


def slot_floats(optimizer: str, dim: int) -> int:
    """f32 slot values per table row of a sparse_embed optimizer (0 for SGD, dim for Adagrad, 1 row-wise)."""
    import sparse_embed as se

    opt = getattr(se.optimizers, OPTIMIZERS[optimizer])(LEARNING_RATE)
    return sum(spec.width for spec in opt.slots(dim).values())


def lower_bounds(w: Workload, problem: peers.Problem, measurements: list[str], threads: int) -> dict[str, Any]:
    """The memory-traffic bound of each measurement, with the issue's and with this run's bandwidths."""
    unique = peers.unique_rows_per_step(problem)
    measured = peers.measure_bandwidth(w.tables * w.rows, w.dim, w.ids_per_step, round(unique), threads)
    out: dict[str, Any] = {"unique_rows_per_step": unique,
                           "bandwidth": {"issue": peers.ISSUE_BANDWIDTH, "measured": measured}, "ms": {}}
    for source in ("issue", "measured"):
        ms = {}
        for m in measurements:
            b = peers.lower_bound(w.ids_per_step, unique, w.dim, slot_floats(optimizer_of(m), w.dim),
                                  out["bandwidth"][source])
            ms[m] = b["forward_ms"] if m == FORWARD else b["train_ms"]
        out["ms"][source] = ms
    return out


def _ratio_to(r: dict[str, Any], reference_ms: float | None) -> float | None:
    return r["median_ms"] / reference_ms if reference_ms else None


def comparison(systems: dict[str, Any], bound: dict[str, Any], measurements: list[str]) -> list[dict[str, Any]]:
    """One row per (measurement, system) measured: times, ratios to FBGEMM and to the bounds, memory."""
    rows = []
    fbgemm = systems.get("fbgemm", {}).get("steps", {})
    for m in measurements:
        for key, s in systems.items():
            r = s["steps"].get(m)
            if r is None:
                continue
            rows.append({
                "measurement": m, "system": key, "label": s["label"],
                **{k: r[k] for k in ("median_ms", "p10_ms", "p90_ms", "cpu_median_ms", "state_bytes",
                                     "rss_peak_steps_bytes")},
                "vs_fbgemm": _ratio_to(r, fbgemm.get(m, {}).get("median_ms")),
                "vs_bound": _ratio_to(r, bound["ms"]["issue"][m]),
                "vs_bound_measured": _ratio_to(r, bound["ms"]["measured"][m]),
            })
    return rows


def targets(rows: list[dict[str, Any]], vocab: dict[str, Any] | None, applicable: bool) -> list[dict[str, Any]]:
    """The issue's goals for 1-device sparse_embed; `pass` is None where a number is missing."""
    ours = {r["measurement"]: r for r in rows if r["system"] == "sparse_embed"}
    out = []
    for m, against, goal in TARGETS:
        value = ours.get(m, {}).get("vs_fbgemm" if against == "fbgemm" else "vs_bound")
        name = "FBGEMM" if against == "fbgemm" else "lower bound"
        out.append({"what": f"{m} / {name}", "value": value, "goal": goal,
                    "pass": None if value is None else value <= goal, "applicable": applicable})
    value = vocab["same_batch"]["ratio"] if vocab else None
    out.append({"what": "vocabulary independence (same batches)", "value": value, "goal": VOCAB_GOAL,
                "pass": None if value is None else value <= VOCAB_GOAL, "applicable": applicable})
    return out


def check_agreement(w: Workload, problem: peers.Problem, args: argparse.Namespace, threads: int) -> dict[str, float]:
    """Max |difference| of each installed peer from sparse_embed, from the same tables.

    Compared: the forward outputs of the first batch, and the tables after
    one SGD step on it.

    Raises AssertionError above AGREEMENT_TOLERANCE: a benchmark comparing
    different math would be worthless.
    """
    import sparse_embed as se

    setup = Setup.create(w, "sgd", make_mesh(args.devices[0]), problem, args.seed)
    names = [f"t{i}" for i in range(w.tables)]
    init = se.unstack_tables(setup.plan, setup.tables)
    forward, _ = prepare_forward(setup)
    pooled = forward.call(forward.state, forward.batches[0])[1]
    ours = [np.asarray(pooled[f"f{i}"]) for i in range(w.tables)]
    train, _ = prepare_train(setup)
    train.run(1)
    ours += [se.unstack_tables(setup.plan, train.state)[n] for n in names]
    same_init = dataclasses.replace(problem, init=[np.array(init[n]) for n in names])
    diffs = {}
    for key in args.peers:
        peer = peers.PEERS[key]
        if peer.missing():
            continue
        s = peer.build(FORWARD, same_init, threads)
        theirs = s.pooled(s.call(s.state, s.batches[0])[1])
        s = peer.build("train_sgd", same_init, threads)
        runner = Runner(s.call, s.state, s.batches)
        runner.run(1)
        theirs += s.tables(runner.state)
        diffs[key] = max(float(np.max(np.abs(x - y))) for x, y in zip(ours, theirs))
    bad = {k: d for k, d in diffs.items() if not d <= AGREEMENT_TOLERANCE}
    assert not bad, f"forward outputs or SGD-updated tables differ from sparse_embed's: {bad} > {AGREEMENT_TOLERANCE}"
    return diffs


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


def package_versions(names: Sequence[str]) -> dict[str, str | None]:
    """Installed distribution versions (None: not installed), without importing them."""
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def environment(argv: Sequence[str] | None, threads: int) -> dict[str, Any]:
    import jax
    import jaxlib

    return {
        "command": " ".join(["python benchmarks/step.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "sparse_embed": library_version(),
        "peers": package_versions(("torch", "fbgemm-gpu-cpu", "fbgemm-gpu", "flax", "optax", "numpy")),
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "jax_devices": len(jax.devices()),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": threads,  # XLA:CPU's and torch.set_num_threads
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))},
        "openmp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_", "MKL_"))},
        "loadavg_start": os.getloadavg(),  # others' work on the machine: torch's OpenMP suffers most from it
    }


def _mib(r: dict[str, Any], key: str) -> str:
    return f"{r[key] / MIB:9.0f}" if key in r else f"{'-':>9}"


def _row(name: str, r: dict[str, Any]) -> str:
    return (f"{name:<24}{r['median_ms']:9.1f}{r['p10_ms']:9.1f}{r['p90_ms']:9.1f}{r['cpu_median_ms']:9.1f}"
            f"{r['lookups_per_s'] / 1e6:10.2f}{_mib(r, 'state_bytes')}{_mib(r, 'temp_bytes')}"
            f"{_mib(r, 'rss_peak_steps_bytes')}{r['minor_faults_per_step'] / 1e3:9.1f}{r['hlo_table_copies']:8d}")


DETAIL_HEADER = [
    f"{'measurement':<24}{'median':>9}{'p10':>9}{'p90':>9}{'cpu':>9}{'Mlookup/s':>10}{'state':>9}"
    f"{'temp':>9}{'peakRSS':>9}{'faults':>9}{'copies':>8}",
    f"{'':<24}{'ms':>9}{'ms':>9}{'ms':>9}{'ms':>9}{'':>10}{'MiB':>9}{'MiB':>9}{'MiB':>9}{'k/step':>9}{'(HLO)':>8}",
]


def _ratio(x: float | None) -> str:
    return f"{x:8.2f}x" if x is not None else f"{'-':>9}"


def format_comparison(results: dict[str, Any]) -> list[str]:
    """The side-by-side table: per measurement, each system and the lower bound."""
    env, bound = results["env"], results["lower_bound"]
    bw = bound["bandwidth"]
    lines = [
        f"side by side (peers: one process, {env['threads']} threads; ratios of medians):",
        f"{'measurement':<22}{'system':<26}{'median':>9}{'p10-p90':>16}{'/FBGEMM':>9}{'/bound':>9}{'/bnd(np)':>9}"
        f"{'state':>9}{'peakRSS':>9}",
        f"{'':<22}{'':<26}{'ms':>9}{'ms':>16}{'':>9}{'':>9}{'':>9}{'MiB':>9}{'MiB':>9}",
    ]
    for m, rows in itertools.groupby(results["comparison"], key=lambda r: r["measurement"]):
        for i, r in enumerate(rows):
            lines.append(f"{m if i == 0 else '':<22}{r['label']:<26}{r['median_ms']:9.1f}"
                         f"{r['p10_ms']:8.1f}-{r['p90_ms']:<7.1f}{_ratio(r['vs_fbgemm'])}{_ratio(r['vs_bound'])}"
                         f"{_ratio(r['vs_bound_measured'])}{_mib(r, 'state_bytes')}{_mib(r, 'rss_peak_steps_bytes')}")
        lines.append(f"{'':<22}{'lower bound':<26}{bound['ms']['issue'][m]:9.1f}"
                     f"{'(numpy: ' + format(bound['ms']['measured'][m], '.1f') + ')':>16}")
    lines += [f"{s['label']}: {s['status']}" for s in results["systems"].values() if s["status"] != "ok"]
    load = max((r["loadavg_1min"] for s in results["systems"].values() for r in s["steps"].values()), default=0.0)
    if load > env["threads"] + 0.5:
        lines.append(f"WARNING: 1-minute load average up to {load:.1f} on {env['threads']} threads: other work was "
                     "running; torch/FBGEMM (OpenMP) steps stall when a core is taken (see peers.py).")
    lines.append(
        f"bound: memory traffic at the issue's {bw['issue']['gather_gbps']:.0f} GB/s gather, "
        f"{bw['issue']['rmw_gbps']:.0f} GB/s row read-modify-write; bnd(np): at this run's numpy-measured "
        f"{bw['measured']['gather_gbps']:.1f} / {bw['measured']['rmw_gbps']:.1f} GB/s "
        f"({bw['measured']['threads']} threads); {bound['unique_rows_per_step']:,.0f} distinct rows/step.")
    return lines


def format_targets(results: dict[str, Any]) -> list[str]:
    lines = ["", "targets (the issue's, for sparse_embed on W1, 1 device):"]
    for t in results["targets"]:
        verdict = "n/a" if t["pass"] is None else ("pass" if t["pass"] else "FAIL")
        if not t["applicable"] and t["pass"] is not None:
            verdict += " (not W1 / 1 device: informational)"
        value = "-" if t["value"] is None else f"{t['value']:.2f}x"
        lines.append(f"  {t['what']:<44} {value:>8}  goal <= {t['goal']}x  {verdict}")
    return lines


def format_report(results: dict[str, Any]) -> str:
    env, w = results["env"], results["workload"]
    lib = env["sparse_embed"]
    zipf = "uniform" if w["zipf"] is None else f"zipf {w['zipf']}"
    lines = [
        f"sparse_embed step benchmark  ({env['date']}, sparse_embed {lib['commit']}{'+dirty' * lib['dirty']}, "
        f"jax {env['jax']}, {env['backend']}, {env['cpu_count']} cpus)",
        f"workload {w['name']}: {w['tables']} tables x {w['rows']:,} rows x {w['dim']}, batch {w['batch']}, "
        f"{w['ids_per_sample']} ids/sample/table ({zipf}), sum combiner; {results['ids_per_step']:,} ids/step",
        f"allocator: {' '.join(f'{k}={v}' for k, v in env['malloc_env'].items()) or 'glibc defaults'}",
    ]
    for s in results["systems"].values():
        if s["devices"] is not None and s["steps"]:
            lines += ["", f"{s['label']} on {s['devices']} device(s):", *DETAIL_HEADER]
            lines += [_row(name, r) for name, r in s["steps"].items()]
    lines += ["", *format_comparison(results)]
    vocab = results.get("vocab")
    if vocab:
        large, small = vocab["sizes"]
        for key, what in (("same_batch", f"the same batches, ids < {small:,}"),
                          ("full_range", "ids over each table's whole vocabulary")):
            v = vocab[key]
            lines += ["", f"vocabulary independence, {what} (1 table x {w['dim']}, batch {w['batch']} x "
                          f"{w['ids_per_sample']} ids, SGD, {v['rounds']} alternating blocks of {v['block_steps']} steps):"]
            lines += [_row(f"{int(rows):,} rows", r) for rows, r in v["by_rows"].items()]
            goal = (f" (goal <= {VOCAB_GOAL}x: " + ("ok" if v["ratio"] <= VOCAB_GOAL else "ABOVE GOAL") + ")"
                    if key == "same_batch" else " (memory hierarchy included; reported, not a goal)")
            lines.append(f"ratio {large:,} / {small:,} rows: {v['ratio']:.2f}x{goal}")
    lines += format_targets(results)
    if "agreement" in results:
        lines.append("from the same tables, max |difference| from sparse_embed's forward output and SGD-updated "
                     "tables: " + (", ".join(
            f"{k} {d:.1e}" for k, d in results["agreement"].items()) or "no peer installed"))
    lines += [
        "",
        f"process peak RSS: {results['rss_process_peak_bytes'] / MIB:.0f} MiB",
        "cpu: median process CPU time per step (all threads); temp: compiled memory_analysis(); "
        "peakRSS: peak during the timed steps;",
        "faults: minor page faults per step (thousands); copies: table-shaped copy ops in the compiled HLO.",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace, argv: Sequence[str] | None) -> dict[str, Any]:
    """All measurements, in order: agreement check, bandwidths, systems side by side, vocabulary, targets."""
    threads = cpu_threads()
    w = workload_of(args)
    problem = make_problem(w, args.seed)
    measurements = measurements_of(args)
    results: dict[str, Any] = {"env": environment(argv, threads), "workload": dataclasses.asdict(w),
                               "ids_per_step": w.ids_per_step}
    if args.check:
        results["agreement"] = check_agreement(w, problem, args, threads)
        free_memory()
    results["lower_bound"] = lower_bounds(w, problem, measurements, threads)
    free_memory()
    systems = make_systems(args, w, problem, threads)
    results["systems"] = run_systems(systems, measurements, args, w.ids_per_step)
    results["comparison"] = comparison(results["systems"], results["lower_bound"], measurements)
    if not args.no_vocab:
        results["vocab"] = bench_vocab(w, make_mesh(args.devices[0]), args)
    results["targets"] = targets(results["comparison"], results.get("vocab"),
                                 applicable=w.name == "W1" and 1 in args.devices)
    results["rss_process_peak_bytes"] = RSS.final_process_peak()
    results["env"]["loadavg_end"] = os.getloadavg()
    return results


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; prints a table, optionally writes JSON and a plot, returns the results dict."""
    args = parse_args(argv)
    configure_devices(max(args.devices))
    import sparse_embed

    sparse_embed.configure_xla_cpu()  # before the backend starts: no whole-table copies in the generic kernel

    try:
        results = run(args, argv)
    finally:
        gc.unfreeze()
    print(format_report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
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
