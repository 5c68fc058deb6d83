"""What `benchmarks/e2e.py` trains, the same for every system: the DLRM's shape, its synthetic data, its init.

Two models share one DLRM: bottom MLP `num_dense-512-256-dim` (ReLU), the
pairwise dot products of the bottom output and the pooled features, top
MLP `512-256-1` on `[bottom, dots]`; row-wise Adagrad on the tables,
Adagrad on the dense part (`g / (sqrt(acc) + eps)`, accumulators from 0, as
torch's), binary cross-entropy, batch 4096. Every system starts from the
same tables and dense weights (`initial_tables`, `dense_init`).

- `demo`: the sparse features of `sparse_embed.examples.dlrm` labelled by
  its teacher (static user ids): user, item, history (up to 8 items, the
  item table, mean) and tags (1-5 weighted tags, weighted mean), dim 64.
- `w1`: 8 tables of 10^6 x 64, 20 Zipf ids per sample in each, labelled by
  a teacher of the same construction (random per-id vectors, here hashed
  into 4096 buckets per table to keep its memory small).

Every system sees the same batches: ragged ids `(values, lengths)` per
feature with their per-id gains (the combiner folded in: 1 for one id,
1/n for a mean, w/sum(w) for a weighted mean), pooled by a weighted sum.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from sparse_embed.examples import dlrm


@dataclasses.dataclass(frozen=True)
class Model:
    """A DLRM and its data: tables `(name, rows)`, features `(name, table)`, sizes and learning rates."""

    name: str
    tables: tuple[tuple[str, int], ...]
    features: tuple[tuple[str, str], ...]
    dim: int = 64
    num_dense: int = 13
    batch: int = 4096
    bottom: tuple[int, ...] = (512, 256)  # then `dim`
    top: tuple[int, ...] = (512, 256)  # then 1
    ids_per_sample: int = 20  # w1's
    zipf: float = 1.05  # w1's id skew
    embedding_lr: float = 0.05
    dense_lr: float = 0.01
    eps: float = 1e-8  # both Adagrads', outside the square root

    @property
    def vectors(self) -> int:
        return len(self.features) + 1  # the pooled features and the bottom MLP's output

    def most_ids(self, feature: str) -> int:
        """The most ids a sample of `feature` has."""
        if not self.name.startswith("demo"):
            return self.ids_per_sample
        return {"history": 8, "tags": 5}.get(feature, 1)

    def layers(self) -> list[tuple[str, int, int]]:
        """`(name, fan_in, fan_out)` of every dense layer, bottom then top."""
        bottom = [self.num_dense, *self.bottom, self.dim]
        top = [self.dim + self.vectors * (self.vectors - 1) // 2, *self.top, 1]
        return ([(f"bottom_{i}", a, b) for i, (a, b) in enumerate(zip(bottom, bottom[1:]))]
                + [(f"top_{i}", a, b) for i, (a, b) in enumerate(zip(top, top[1:]))])


def _demo(name: str, users: int, items: int, tags: int, **kw) -> Model:
    return Model(name, (("user", users), ("item", items), ("tag", tags)),
                 (("user", "user"), ("item", "item"), ("history", "item"), ("tags", "tag")), **kw)


def _w1(name: str, rows: int, **kw) -> Model:
    return Model(name, tuple((f"t{i}", rows) for i in range(8)), tuple((f"f{i}", f"t{i}") for i in range(8)), **kw)


SMALL = dict(dim=16, batch=256, bottom=(32, 16), top=(32, 16))
MODELS = {
    "demo": _demo("demo", 100_000, 20_000, 2_000),
    "w1": _w1("w1", 1_000_000),
    "demo_tiny": _demo("demo_tiny", 1_000, 500, 100, **SMALL),
    "w1_tiny": _w1("w1_tiny", 1_000, ids_per_sample=5, **SMALL),
}


class HostBatch(NamedTuple):
    """One batch on the host. B = batch size."""

    ids: dict[str, tuple[np.ndarray, np.ndarray]]  # feature -> (values int64 [n], lengths int32 [B])
    gains: dict[str, np.ndarray]  # feature -> float32 [n]: the weighted sum's weights
    dense: np.ndarray  # [B, num_dense] float32
    labels: np.ndarray  # [B] float32

    def nbytes(self) -> int:
        arrays = [a for pair in self.ids.values() for a in pair] + [*self.gains.values(), self.dense, self.labels]
        return sum(a.nbytes for a in arrays)


def _ragged(values: np.ndarray, lengths: np.ndarray, gains: np.ndarray) -> tuple[tuple, np.ndarray]:
    return (values.astype(np.int64), lengths.astype(np.int32)), gains.astype(np.float32)


def _demo_batch(teacher: dlrm.Teacher, rng: np.random.Generator, batch: int) -> HostBatch:
    ex = teacher.sample(rng, batch)
    ids, gains, one = {}, {}, np.ones(batch, np.int32)
    for f in ("user", "item"):
        ids[f], gains[f] = _ragged(ex.ids[f], one, np.ones(batch))
    history = ex.ids["history"]
    n = (history >= 0).sum(1)
    ids["history"], gains["history"] = _ragged(history[history >= 0], n, np.repeat(1.0 / np.maximum(n, 1), n))
    tag_ids, tag_lengths = ex.ids["tags"]
    w = ex.weights["tags"][0]
    total = np.add.reduceat(w, np.concatenate([[0], np.cumsum(tag_lengths)[:-1]]))  # every sample has >= 1 tag
    ids["tags"], gains["tags"] = _ragged(tag_ids, tag_lengths, w / np.repeat(total, tag_lengths))
    return HostBatch(ids, gains, ex.dense, ex.labels)


@dataclasses.dataclass(frozen=True, eq=False)
class W1Teacher:
    """The demo's teacher for w1: score = sum_f <v_f, v_7> + <tanh(P dense), v_7>, v_f the mean teacher vector of
    feature f's ids; standardised, times `signal`, minus 1 (about a third click)."""

    model: Model
    sampler: dlrm.ZipfSampler
    vectors: np.ndarray  # [8, 4096, k]
    dense_proj: np.ndarray  # [num_dense, k]
    center: float = 0.0
    scale: float = 1.0
    signal: float = 1.5

    @classmethod
    def create(cls, model: Model, seed: int, k: int = 8) -> "W1Teacher":
        rng = np.random.default_rng([seed, 0])
        rows = model.tables[0][1]
        t = cls(model, dlrm.ZipfSampler.create(rng, rows, model.zipf),
                rng.normal(0, 1 / np.sqrt(k), (len(model.tables), 4096, k)).astype(np.float32),
                rng.normal(0, 1, (model.num_dense, k)).astype(np.float32))
        raw = t.raw(*t.draw(np.random.default_rng([seed, 99]), 4096))
        return dataclasses.replace(t, center=float(raw.mean()), scale=float(raw.std()))

    def draw(self, rng: np.random.Generator, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """`[F, B, ids_per_sample]` ids (each table's ranks shifted by its own offset) and `[B, num_dense]`."""
        rows, f = self.model.tables[0][1], len(self.model.tables)
        ids = self.sampler(rng, (f, batch, self.model.ids_per_sample))
        ids = (ids + (np.arange(f) * (rows // f))[:, None, None]) % rows
        return ids, rng.normal(size=(batch, self.model.num_dense)).astype(np.float32)

    def raw(self, ids: np.ndarray, dense: np.ndarray) -> np.ndarray:
        buckets = (ids * 2654435761) % self.vectors.shape[1]
        v = np.stack([self.vectors[f][buckets[f]].mean(1) for f in range(ids.shape[0])])  # [F, B, k]
        return np.einsum("fbk,bk->b", v[:-1], v[-1]) + np.einsum("bk,bk->b", np.tanh(dense @ self.dense_proj), v[-1])

    def sample(self, rng: np.random.Generator, batch: int) -> HostBatch:
        ids, dense = self.draw(rng, batch)
        logits = self.signal * (self.raw(ids, dense) - self.center) / self.scale - 1.0
        labels = (rng.random(batch) < 1 / (1 + np.exp(-logits))).astype(np.float32)
        n, per = self.model.ids_per_sample, {}
        for i, (f, _) in enumerate(self.model.features):
            per[f] = _ragged(ids[i].reshape(-1), np.full(batch, n), np.ones(batch * n))
        return HostBatch({f: v[0] for f, v in per.items()}, {f: v[1] for f, v in per.items()}, dense, labels)


class Data:
    """`batch(i)` (training) and `eval_batch(i)` (held out): the same batches for every system, from `seed`."""

    def __init__(self, model: Model, seed: int = 0):
        self.model, self.seed = model, seed
        if model.name.startswith("demo"):
            (_, users), (_, items), (_, tags) = model.tables
            config = dlrm.DataConfig(users=users, user_rows=None, items=items, tags=tags, num_dense=model.num_dense)
            teacher = dlrm.Teacher.create(config, seed)
            self._sample = lambda rng: _demo_batch(teacher, rng, model.batch)
        else:
            teacher = W1Teacher.create(model, seed)
            self._sample = lambda rng: teacher.sample(rng, model.batch)

    def batch(self, i: int) -> HostBatch:
        return self._sample(np.random.default_rng([self.seed, 1, i]))

    def eval_batch(self, i: int) -> HostBatch:
        return self._sample(np.random.default_rng([self.seed, 2, i]))


def dense_init(model: Model, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """`{layer: (kernel [in, out], bias [out])}`, torch's default Linear init (U(+-1/sqrt(in))), for every system."""
    rng, out = np.random.default_rng([seed, 5]), {}
    for name, a, b in model.layers():
        bound = 1 / np.sqrt(a)
        out[name] = (rng.uniform(-bound, bound, (a, b)).astype(np.float32),
                     rng.uniform(-bound, bound, b).astype(np.float32))
    return out


def initial_tables(model: Model, seed: int = 0) -> dict[str, np.ndarray]:
    """`{table: [rows, dim]}` float32, normal (std 0.02) clipped at 2 std: every system starts from these rows, so
    that their AUCs differ by the arithmetic's rounding, not by the draw of the initial tables."""
    out = {}
    for i, (t, rows) in enumerate(model.tables):
        a = np.random.default_rng([seed, 6, i]).standard_normal((rows, model.dim), dtype=np.float32)
        out[t] = np.clip(a * np.float32(0.02), -0.04, 0.04, out=a)
    return out


auc = dlrm.auc
