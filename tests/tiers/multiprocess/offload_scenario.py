"""The run of tests/tiers/test_offload_processes.py: offloaded tables (one keyed by raw ids; and one in memory), by
1 or 2 processes."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

import sparse_embed as se

V, D, B, L = 2000, 8, 32, 4  # rows of each table, row width, global batch, ids per sample
CACHE = 160  # cache rows per feature: one batch reads ~100 distinct rows of a feature, all batches ~1000
STEPS = 8
FLUSH_AT = 4  # the store is committed here and at the end; a refused batch comes right after
TABLES = {"adagrad": (se.optimizers.Adagrad(0.1), "mean"), "sgd": (se.optimizers.SGD(0.1), "sum"),
          "adam": (se.optimizers.Adam(0.01), "mean"), "plain": (se.optimizers.RowwiseAdagrad(0.1), "mean"),
          "raw": (se.optimizers.Adagrad(0.1), "sum")}
TIERED = ("adagrad", "adam", "raw", "sgd")
RAW = se.Dynamic(expire_after=3)  # the raw-id table: RAW_V rows for ids from RAW_IDS, a cache of RAW_CACHE
RAW_V, RAW_CACHE = 320, 200
RAW_IDS = np.random.default_rng(12).integers(0, 2**62, 3000)
# (feature, table, max_sequence_length, weighted)
FEATURES = [("f", "adagrad", 0, False), ("seq", "adagrad", L, False), ("g", "sgd", 0, True),
            ("a", "adam", 0, False), ("p", "plain", 0, False), ("r", "raw", 0, False)]


def features(root: str | None) -> list[se.FeatureSpec]:
    """The features; with `root`, the tables in TIERED are offloaded to `root/<table>`."""
    specs = {}
    for name, (opt, combiner) in TABLES.items():
        rows = RAW_CACHE if name == "raw" else CACHE * sum(t == name for _, t, _, _ in FEATURES)
        storage = se.offload.Offload(os.path.join(root, name), rows) if root and name in TIERED else None
        specs[name] = se.TableSpec(name, RAW_V if name == "raw" else V, D, optimizer=opt, combiner=combiner,
                                   dynamic=RAW if name == "raw" else None, storage=storage)
    return [se.FeatureSpec(f, specs[t], B, max_sequence_length=seq) for f, t, seq, _ in FEATURES]


def batches(steps: int = STEPS) -> list[tuple[dict, dict]]:
    """Global `(ids, weights)` per step: a Zipf head (hits) and a uniform tail (misses), -1 padding."""
    g, r = np.random.default_rng(11), np.random.default_rng(13)
    out = []
    for _ in range(steps):
        ids, weights = {}, {}
        for f, _, _, weighted in FEATURES:
            h = r if f == "r" else g  # raw ids: from their own generator (the others' draws as before)
            n = RAW_IDS.size if f == "r" else V
            x = np.where(h.random((B, L)) < 0.5, h.zipf(1.3, (B, L)) % n, h.integers(0, n, (B, L))).astype(np.int64)
            x = RAW_IDS[x] if f == "r" else x
            x[:, 1:][h.random((B, L - 1)) < 0.2] = -1
            ids[f] = x
            if weighted:
                weights[f] = g.uniform(0.25, 2.0, (B, L)).astype(np.float32)
        out.append((ids, weights))
    return out


def linear_step(plan: se.EmbeddingPlan, features=None, batch_size: int = B, dim: int = D):
    """`(tables, id_maps, batch, step) -> (loss, tables', id_maps', id_stats)` for a loss linear in the activations
    (`map_ids` first for raw-id tables in memory); `features`: `(name, table, sequence length, weighted)` rows
    (default FEATURES), each activation's fixed cotangent drawn from them. Also tests/tiers/test_offload_raw_ids.py's."""
    g = np.random.default_rng(2)
    cts = {f: jnp.asarray(g.standard_normal((batch_size, seq, dim) if seq else (batch_size, dim)).astype(np.float32))
           for f, _, seq, _ in (FEATURES if features is None else features)}

    def loss(tables, batch, step):
        acts = se.lookup(plan, batch, tables, step)
        return sum(jnp.sum(acts[k] * cts[k]) for k in sorted(acts))

    def step(tables, id_maps, batch, i):
        stats = {}
        if id_maps:
            batch, tables, id_maps, stats = se.map_ids(plan, batch, tables, id_maps, i)
        value, tables = jax.value_and_grad(loss)(tables, batch, i)
        return value, tables, id_maps, stats

    return jax.jit(step, donate_argnums=(0, 1))


def train_in_memory(plan, feed=lambda plan, x: x):
    """The state of every table after STEPS steps of plain training."""
    rng = jax.random.key(0)
    tables, id_maps, step = se.init_tables(plan, rng), se.init_id_maps(plan, rng), linear_step(plan)
    for i, (ids, weights) in enumerate(batches()):
        batch, _ = se.preprocess(plan, feed(plan, ids), feed(plan, weights))
        _, tables, id_maps, _ = step(tables, id_maps, batch, i)
    return se.unstack_state(plan, tables)
