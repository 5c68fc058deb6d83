"""The workloads of `benchmarks/step.py`: presets, the ids every system gets, the optimizers by name."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from benchmarks import peers
from benchmarks.peers import FORWARD


OPTIMIZERS = {
    "sgd": "SGD", "adagrad": "Adagrad", "rowwise_adagrad": "RowwiseAdagrad", "adam": "Adam",
    "adagrad_momentum": "AdagradMomentum", "ftrl": "FTRL", "laprop": "LaProp",
}


DEFAULT_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")  # FBGEMM's CPU TBE has all but Adam


LEARNING_RATE = 0.01


NUM_BATCHES = 4


HASH_PRIME = 2_654_435_761  # scatters Zipf ranks over the vocabulary (a bijection mod rows)

# Workload presets; explicit flags override them. "small" is the small model (per-step fixed costs).
PRESETS: dict[str, dict[str, Any]] = {
    "W1": dict(tables=8, rows=1_000_000, dim=64, batch=4096, ids_per_sample=20,
               steps=50, warmup=5, rounds=3, vocab_sizes=(10**7, 10**5)),
    "small": dict(tables=2, rows=10_000, dim=64, batch=256, ids_per_sample=20,
                  steps=200, warmup=20, rounds=3, vocab_sizes=(10**5, 10**3)),
    "quick": dict(tables=2, rows=10_000, dim=64, batch=512, ids_per_sample=10,
                  steps=3, warmup=5, rounds=1, vocab_sizes=(10**5, 10**3)),
}


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one step looks up: `tables` tables, each read by one pooled feature."""

    name: str  # the preset's, or "custom"
    tables: int
    rows: int
    dim: int
    batch: int
    ids_per_sample: int
    devices: int
    zipf: float | None  # None = uniform ids
    id_range: int | None = None  # ids drawn from [0, id_range) instead of [0, rows)

    @property
    def key(self) -> str:
        """What the targets are keyed by: the preset, and the id distribution if not uniform."""
        return self.name + ("" if self.zipf is None else f" zipf {self.zipf:g}")

    @property
    def ids_per_step(self) -> int:
        return self.tables * self.batch * self.ids_per_sample

    def with_single_table(self, rows: int, id_range: int | None = None) -> "Workload":
        """The same batch shape on one table of `rows` rows (the vocabulary test)."""
        return dataclasses.replace(self, name=f"1x{rows}", tables=1, rows=rows, id_range=id_range)


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


def optimizer_of(measurement: str) -> str:
    """The --optimizer name of a measurement (the forward runs on SGD tables, which have no slots)."""
    return "sgd" if measurement == FORWARD else measurement.removeprefix("train_")
