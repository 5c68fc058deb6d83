"""The training run the multi-process tests compare: the same code in N processes and in the pytest process."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import sparse_embed as se
from sparse_embed import optimizers as opt

B = 32
STEPS = 5
GROW_AT = 3  # batches from this step on carry more ids: the auto capacity grows once
PLACEMENT = {"items": "table", "tags": "replicated", "users": "column"}  # and row-wise: the plain plan


def make_plan(mesh, **kw) -> se.EmbeddingPlan:
    """Two stacks: items + tags (stacked), users; a pooled, a sequence and a multi-hot feature; Adagrad, and
    RowwiseAdagrad with max_norm for users (by columns: whole-row statistics summed across processes)."""
    items = se.TableSpec("items", 101, 8, optimizer=opt.Adagrad(0.1), combiner="mean")
    tags = se.TableSpec("tags", 53, 8, optimizer=opt.Adagrad(0.1), combiner="mean")
    users = se.TableSpec("users", 37, 4, optimizer=opt.RowwiseAdagrad(0.05), combiner="sum", max_norm=0.5)
    feats = [
        se.FeatureSpec("clicked", items, B),
        se.FeatureSpec("history", items, B, max_sequence_length=4),
        se.FeatureSpec("tags", tags, B),
        se.FeatureSpec("user", users, B),
    ]
    return se.plan(feats, mesh, **kw)


def global_ids(plan, step: int) -> dict[str, np.ndarray]:
    """The global batch of a step: dense `[B, width]` ids with -1 padding (same on every process)."""
    rng = np.random.default_rng(1000 + step)
    out = {}
    for name, f in sorted(plan.features.items()):
        width = f.max_sequence_length or (3 if step < GROW_AT else 12)
        if name == "tags" and step >= GROW_AT:
            width = 24
        out[name] = rng.integers(-1, f.table.vocabulary_size, size=(f.batch_size, width))
    return out


def make_step(plan):
    weights = {n: np.random.default_rng(7).normal(size=f.output_shape).astype(np.float32)
               for n, f in sorted(plan.features.items())}

    @jax.jit
    def step(tables, batch, i):
        def loss(t):
            acts = se.lookup(plan, batch, t, i)
            return sum(jnp.sum(jnp.tanh(acts[n]) * w) for n, w in weights.items())

        value, new_tables = jax.value_and_grad(loss)(tables)
        return new_tables, value

    return step


def train(plan, feed=lambda plan, ids: ids, steps: int = STEPS):
    """Returns (tables, losses, per-step stats, compiled train-step programs)."""
    tables = se.init_tables(plan, jax.random.key(0))
    step = make_step(plan)
    losses, stats = [], []
    for i in range(steps):
        batch, st = se.preprocess(plan, feed(plan, global_ids(plan, i)))
        tables, loss = step(tables, batch, np.int32(i))
        losses.append(float(loss))
        stats.append(st)
    return tables, losses, stats, step._cache_size()


def stats_array(stats) -> np.ndarray:
    """Stats (one or a list) -> `[n, stacks * 5]` ints, for comparisons."""
    stats = stats if isinstance(stats, list) else [stats]
    return np.array([[d[k] for d in (s.max_ids_per_partition, s.max_unique_ids_per_partition, s.dropped_ids,
                                     s.num_ids, s.capacity) for k in sorted(d)] for s in stats], np.int64)
