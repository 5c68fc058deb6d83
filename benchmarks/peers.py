"""What `benchmarks/step.py` times sparse_embed against, on the very same ids and cotangents.

- `fbgemm`: FBGEMM's table-batched embedding (TBE) on CPU, the kernel under
  TorchRec's fused EmbeddingBagCollection:
  `SplitTableBatchedEmbeddingBagsCodegen` with `EmbeddingLocation.HOST`,
  `ComputeDevice.CPU`, `PoolingMode.SUM`, its default bounds check
  (`WARNING`), and the optimizer fused into the backward (EXACT_SGD,
  EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD). Package `fbgemm-gpu-cpu`.
- `torch`: one `torch.nn.EmbeddingBag(mode="sum", sparse=True)` per table and
  `torch.optim.SGD` / `Adagrad` / `SparseAdam`, which take sparse gradients
  (torch has no row-wise Adagrad; FBGEMM has no Adam on CPU).
- `flax`: the naive Flax model, "what a Flax user writes today": one
  `flax.linen.Embed` per table, a sum over each sample's ids, and
  `optax.sgd` / `optax.adagrad` on *dense* gradients, jitted with the params
  and optimizer state donated.

Each peer's train step is the forward plus the backward of a loss linear in
the pooled output, `out.backward(cotangent)` with the benchmark's fixed
random cotangent; its forward-only measurement runs without gradients
(`torch.no_grad()` / a jitted `apply`). The optimizers' hyperparameters
other than the learning rate are each library's defaults (FBGEMM's Adagrad
starts its accumulator at 0 with eps 1e-8, sparse_embed's at 0.1 without
eps): the same amount of work, not identical updates. SGD is the same
math everywhere, and `step.py --quick` checks that all systems agree after
one SGD step from the same tables (to ~1e-8).

torch runs its intra-op work on OpenMP threads, set to the cores JAX uses.
When another process keeps one of those cores busy, an OpenMP region
waits for the descheduled thread, and the torch-based peers then take
tens of milliseconds more per step (seen here: FBGEMM and EmbeddingBag
SGD at 48-96 ms instead of ~1 ms on the --quick workload). XLA's thread
pool degrades less. Compare the systems on an otherwise idle machine.

The module also computes the memory-traffic lower bound of a step (see
`lower_bound`) and measures the two bandwidths it uses (`measure_bandwidth`).
It imports torch, fbgemm_gpu and flax only when a peer is built, so a
missing package only turns that peer's rows into "not installed".
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

FORWARD = "forward"
TRAIN_SGD, TRAIN_ADAGRAD, TRAIN_ROWWISE, TRAIN_ADAM = "train_sgd", "train_adagrad", "train_rowwise_adagrad", "train_adam"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One workload's inputs, shared by every system: `tables` tables of `rows x dim` f32, sum pooling.

    `ids[b][t]` is batch b's `[batch, ids_per_sample]` int32 ids into table t;
    `cotangents[t]` the fixed `[batch, dim]` f32 loss cotangent of table t's
    pooled output. `init`, if set, gives every system the same initial
    tables (`[rows, dim]` each); otherwise each initialises its own.
    """

    rows: int
    dim: int
    ids: list[list[np.ndarray]]
    cotangents: list[np.ndarray]
    learning_rate: float
    init: list[np.ndarray] | None = None

    @property
    def tables(self) -> int:
        return len(self.cotangents)


@dataclasses.dataclass
class Stepper:
    """A built system: `call(state, batch) -> (state, output)` over its own converted batches."""

    call: Callable[[Any, Any], tuple[Any, Any]]
    state: Any
    batches: list[Any]
    state_bytes: int  # tables + optimizer state
    tables: Callable[[Any], list[np.ndarray]]  # state -> the per-table arrays (host copies)
    pooled: Callable[[Any], list[np.ndarray]] = lambda out: [np.asarray(x) for x in out]  # forward output -> per table


@dataclasses.dataclass(frozen=True)
class Peer:
    """A system to compare with: its label, the modules it needs, what it can measure, and its builder."""

    label: str
    modules: tuple[str, ...]
    measurements: tuple[str, ...]
    build: Callable[[str, Problem, int], Stepper]  # (measurement, problem, threads) -> Stepper
    slow_train: bool = False  # time fewer train steps (see step.py --slow-steps)

    def missing(self) -> str | None:
        """None if every module is importable, else "not installed (...)"."""
        absent = [m for m in self.modules if not _importable(m)]
        return f"not installed ({', '.join(absent)})" if absent else None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install, or sys.modules[module] = None
        return False


# ---------------------------------------------------------------- torch-based peers


def _torch(threads: int):
    """torch, with its intra-op thread count set to the cores JAX uses."""
    import torch

    torch.set_num_threads(threads)
    return torch


def _torch_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _fbgemm(measurement: str, p: Problem, threads: int) -> Stepper:
    """FBGEMM TBE on CPU; the train step's backward applies the fused optimizer in place."""
    torch = _torch(threads)
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    optimizer = {FORWARD: EmbOptimType.EXACT_SGD, TRAIN_SGD: EmbOptimType.EXACT_SGD,
                 TRAIN_ADAGRAD: EmbOptimType.EXACT_ADAGRAD, TRAIN_ROWWISE: EmbOptimType.EXACT_ROWWISE_ADAGRAD}
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(p.rows, p.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * p.tables,
        optimizer=optimizer[measurement], learning_rate=p.learning_rate, pooling_mode=PoolingMode.SUM)
    if p.init is not None:
        for w, x in zip(tbe.split_embedding_weights(), p.init):
            w.copy_(torch.from_numpy(x))
    # TBE's input: all tables' ids concatenated (table-major), bags of ids_per_sample each.
    batches = []
    for ids in p.ids:
        indices = torch.from_numpy(np.concatenate([x.reshape(-1) for x in ids]).astype(np.int64))
        batches.append((indices, torch.arange(0, indices.numel() + 1, ids[0].shape[1], dtype=torch.int64)))
    cotangent = torch.from_numpy(np.concatenate(p.cotangents, axis=1))  # output is [batch, tables * dim]

    def forward(tbe, batch):
        with torch.no_grad():
            return tbe, tbe(*batch)

    def train(tbe, batch):
        out = tbe(*batch)
        out.backward(cotangent)
        return tbe, out

    return Stepper(forward if measurement == FORWARD else train, tbe, batches,
                   _torch_bytes(tbe.parameters()),
                   lambda tbe: [w.numpy().copy() for w in tbe.split_embedding_weights()],
                   lambda out: [x.numpy() for x in out.split(p.dim, dim=1)])


def _torch_bags(measurement: str, p: Problem, threads: int) -> Stepper:
    """`nn.EmbeddingBag(sparse=True)` per table; `torch.optim` applies the sparse gradients."""
    torch = _torch(threads)
    torch.sparse.check_sparse_tensor_invariants.disable()  # torch's default, said explicitly (no warning per step)
    if p.init is None:
        bags = [torch.nn.EmbeddingBag(p.rows, p.dim, mode="sum", sparse=True) for _ in range(p.tables)]
    else:
        bags = [torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(x.copy()), freeze=False, mode="sum", sparse=True)
                for x in p.init]
    params = [b.weight for b in bags]
    batches = [[torch.from_numpy(x.astype(np.int64)) for x in ids] for ids in p.ids]
    cotangents = [torch.from_numpy(c) for c in p.cotangents]

    def tables(state) -> list[np.ndarray]:
        return [b.weight.detach().numpy().copy() for b in state[0]]

    if measurement == FORWARD:
        def forward(state, batch):
            with torch.no_grad():
                return state, [bag(x) for bag, x in zip(state[0], batch)]

        return Stepper(forward, (bags, None), batches, _torch_bytes(params), tables)
    if measurement == TRAIN_SGD:
        opt = torch.optim.SGD(params, lr=p.learning_rate)
    elif measurement == TRAIN_ADAM:  # lazy Adam, as sparse_embed's (its slots appear at the first step)
        opt = torch.optim.SparseAdam(params, lr=p.learning_rate)
    else:
        opt = torch.optim.Adagrad(params, lr=p.learning_rate, initial_accumulator_value=0.1)

    def train(state, batch):
        outs = [bag(x) for bag, x in zip(state[0], batch)]
        torch.autograd.backward(outs, cotangents)
        state[1].step()
        state[1].zero_grad(set_to_none=True)
        return state, outs

    slots = (v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    return Stepper(train, (bags, opt), batches, _torch_bytes(params) + _torch_bytes(slots), tables)


# ---------------------------------------------------------------- naive Flax


def _flax_naive(measurement: str, p: Problem, threads: int) -> Stepper:
    """`nn.Embed` per table + sum over ids; optax on the dense gradients, params and state donated.

    `threads` is unused: XLA:CPU already runs on every core.
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    class Embeddings(nn.Module):
        rows: int
        dim: int

        @nn.compact
        def __call__(self, ids: list[jax.Array]) -> list[jax.Array]:
            return [nn.Embed(self.rows, self.dim, name=f"t{i}")(x).sum(axis=1) for i, x in enumerate(ids)]

    model = Embeddings(p.rows, p.dim)
    batches = [[jnp.asarray(x) for x in ids] for ids in p.ids]
    if p.init is None:
        params = jax.jit(model.init)(jax.random.key(0), batches[0])
    else:
        params = {"params": {f"t{i}": {"embedding": jnp.asarray(x)} for i, x in enumerate(p.init)}}

    def tables(state) -> list[np.ndarray]:
        return [np.asarray(state[0]["params"][f"t{i}"]["embedding"]) for i in range(p.tables)]

    def nbytes(tree) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(tree))

    if measurement == FORWARD:
        apply = jax.jit(model.apply)
        return Stepper(lambda state, batch: (state, apply(state[0], batch)), (params, None), batches,
                       nbytes(params), tables)
    tx = optax.sgd(p.learning_rate) if measurement == TRAIN_SGD else optax.adagrad(p.learning_rate)
    cotangents = [jnp.asarray(c) for c in p.cotangents]

    @jax.jit
    def init_state(params):
        return params, tx.init(params)

    def step(state, ids, cotangents):
        params, opt_state = state

        def loss(params):
            return sum(jnp.sum(out * c) for out, c in zip(model.apply(params, ids), cotangents))

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    step = jax.jit(step, donate_argnums=0)

    def train(state, batch):
        state, value = step(state, batch, cotangents)
        return state, (value, state)

    state = init_state(params)
    return Stepper(train, state, batches, nbytes(state), tables)


PEERS: dict[str, Peer] = {
    "fbgemm": Peer("FBGEMM TBE (CPU)", ("torch", "fbgemm_gpu"),
                   (FORWARD, TRAIN_SGD, TRAIN_ADAGRAD, TRAIN_ROWWISE), _fbgemm),
    "torch": Peer("torch EmbeddingBag", ("torch",), (FORWARD, TRAIN_SGD, TRAIN_ADAGRAD, TRAIN_ADAM), _torch_bags),
    "flax": Peer("naive Flax (dense grads)", ("flax", "optax"),
                 (FORWARD, TRAIN_SGD, TRAIN_ADAGRAD), _flax_naive, slow_train=True),
}


# ---------------------------------------------------------------- memory-traffic lower bound

# The issue's bandwidths of this machine: random 256-byte row gather, and row read-modify-write (bytes read + written).
ISSUE_BANDWIDTH = {"gather_gbps": 9.0, "rmw_gbps": 22.0}
METER_CHUNK = 1024  # rows per numpy call: the chunk stays in L2, so only the table's side reaches memory
METER_REPEATS = 5


def unique_rows_per_step(p: Problem) -> float:
    """Distinct (table, row) pairs per step, averaged over the batches: the rows a step must update."""
    return float(np.mean([sum(np.unique(x).size for x in ids) for ids in p.ids]))


def lower_bound(ids_per_step: int, unique_rows: float, dim: int, slot_floats: int,
                bandwidth: dict[str, float]) -> dict[str, float]:
    """Milliseconds a step cannot beat, from the bytes it must move and two bandwidths.

        forward = N * 4 * dim / gather_bw
        train   = forward + 2 * U * 4 * (dim + slot_floats) / rmw_bw

    N = ids per step (every id's row is read once, pooled in cache); U =
    distinct rows per step, each read and written once with its optimizer
    slots (`slot_floats` f32 per row: 0 for SGD, dim for Adagrad, 1 for
    row-wise Adagrad). gather_bw is the random-row read bandwidth, rmw_bw
    the read-modify-write bandwidth of distinct rows in id order, counting
    the bytes read and written. On W1 with the issue's 9 and 22 GB/s:
    forward 18.6 ms, SGD 33.3 ms, Adagrad 47.9 ms.
    """
    forward = ids_per_step * 4 * dim / (bandwidth["gather_gbps"] * 1e9)
    update = 2 * unique_rows * 4 * (dim + slot_floats) / (bandwidth["rmw_gbps"] * 1e9)
    return {"forward_ms": 1e3 * forward, "train_ms": 1e3 * (forward + update)}


def _chunks(ids: np.ndarray, threads: int) -> list[list[np.ndarray]]:
    """Each thread's list of METER_CHUNK-row index chunks."""
    return [np.array_split(part, max(1, -(-part.size // METER_CHUNK))) for part in np.array_split(ids, threads)]


def _time_threads(work: Callable[[list[np.ndarray]], None], parts: list[list[np.ndarray]], pool) -> float:
    """Median seconds of running `work` on every part at once, over METER_REPEATS runs."""
    times = []
    for _ in range(METER_REPEATS):
        t0 = time.perf_counter()
        list(pool.map(work, parts))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_bandwidth(total_rows: int, dim: int, ids_per_step: int, unique_rows: int, threads: int,
                      seed: int = 0) -> dict[str, float]:
    """This machine's gather and read-modify-write bandwidths (GB/s), measured with numpy on `threads` threads.

    A `[total_rows, dim]` f32 table (the workload's size, so the same cache
    and TLB behaviour) is read at `ids_per_step` random rows (np.take into a
    METER_CHUNK-row buffer), and `unique_rows` distinct rows in id order are
    gathered and assigned back (read + write bytes). numpy releases the GIL
    in both, so the threads run in parallel. numpy's per-row loop is slower
    than a compiled kernel (about 10 GB/s single-threaded even from cache),
    so these are what numpy achieves, not the hardware's limit: compare
    with the issue's figures.
    """
    rng = np.random.default_rng(seed)
    table = np.full((total_rows, dim), 0.5, np.float32)
    gather_ids = rng.integers(0, total_rows, ids_per_step)
    rmw_ids = np.sort(rng.permutation(total_rows)[:unique_rows])

    def gather(chunks: list[np.ndarray]) -> None:
        out = np.empty((METER_CHUNK, dim), np.float32)
        for c in chunks:
            np.take(table, c, axis=0, out=out[: c.size])

    def rmw(chunks: list[np.ndarray]) -> None:
        for c in chunks:
            table[c] = table[c]

    with ThreadPoolExecutor(threads) as pool:
        gather_s = _time_threads(gather, _chunks(gather_ids, threads), pool)
        rmw_s = _time_threads(rmw, _chunks(rmw_ids, threads), pool)
    row = 4 * dim
    return {"gather_gbps": ids_per_step * row / gather_s / 1e9, "rmw_gbps": 2 * unique_rows * row / rmw_s / 1e9,
            "threads": threads}
