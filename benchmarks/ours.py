"""sparse_embed's side of `benchmarks/step.py`: plan, batches, the compiled steps, the vocabulary test."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import time
from typing import TYPE_CHECKING, Any, Callable

from benchmarks import peers
from benchmarks.measuring import RSS, Runner, Samples, state_bytes, timing_summary
from benchmarks.peers import FORWARD
from benchmarks.workload import LEARNING_RATE, OPTIMIZERS, Workload, feature_ids, make_problem, optimizer_of

if TYPE_CHECKING:  # jax is imported after XLA_FLAGS is set
    import jax


def build_plan(w: Workload, optimizer: str, mesh: "jax.sharding.Mesh", kernel: str = "auto"):
    """Features f0..f{n-1}, feature i reading table t{i}; default ("auto") stacking; the lookup `kernel`."""
    import sparse_embed as se

    opt = getattr(se.optimizers, OPTIMIZERS[optimizer])(LEARNING_RATE)
    features = {}
    for i in range(w.tables):
        table = se.TableSpec(f"t{i}", w.rows, w.dim, optimizer=opt, combiner="sum")
        features[f"f{i}"] = se.FeatureSpec(f"f{i}", table, batch_size=w.batch)
    return se.plan(features, mesh, kernel=kernel)


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


def train_runner(compiled, tables, batches, cotangents) -> Runner:
    """Threads the donated tables through the train step; blocks on (loss, tables)."""

    def call(tables, batch):
        loss, new = compiled(tables, batch, cotangents)
        return new, (loss, new)

    return Runner(call, tables, batches)


def forward_runner(compiled, tables, batches) -> Runner:
    """Runs the forward on fixed tables; blocks on the activations."""
    return Runner(lambda tables, batch: (tables, compiled(tables, batch)), tables, batches)


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
    def create(cls, w: Workload, optimizer: str, mesh, problem: peers.Problem, seed: int,
               kernel: str = "auto") -> "Setup":
        import jax
        import sparse_embed as se

        plan = build_plan(w, optimizer, mesh, kernel)
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


def prepare_sparse_embed(w: Workload, mesh, problem: peers.Problem, seed: int, kernel: str, measurement: str):
    """sparse_embed's runner (and facts) for one measurement with one kernel, on fresh tables."""
    setup = Setup.create(w, optimizer_of(measurement), mesh, problem, seed, kernel)
    return prepare_forward(setup) if measurement == FORWARD else prepare_train(setup)


def bench_vocab_pair(w: Workload, mesh, args: argparse.Namespace, kernel: str, id_range: int | None) -> dict[str, Any]:
    """SGD train step on one table of LARGE vs SMALL rows, timed in alternating blocks.

    `id_range=None` draws each table's ids from its whole vocabulary; an int
    draws both from `[0, id_range)`, i.e. the very same batches.
    """
    setups = {}
    for rows in args.vocab_sizes:
        single = w.with_single_table(rows, id_range)
        setups[rows] = Setup.create(single, "sgd", mesh, make_problem(single, args.seed), args.seed, kernel)
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
    return {"kernel": kernel, "id_range": id_range, "block_steps": block, "rounds": args.vocab_rounds,
            "rss_peak_steps_bytes": RSS.peak(), "by_rows": out, "ratio": large / small}


def bench_vocab(w: Workload, mesh, args: argparse.Namespace, kernel: str) -> dict[str, Any]:
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
            "same_batch": bench_vocab_pair(w, mesh, args, kernel, id_range=small),
            "full_range": bench_vocab_pair(w, mesh, args, kernel, id_range=None)}
