"""Shared by the Flax/Optax/layout tests: a two-stack plan, random batches, tree comparisons."""

from __future__ import annotations

import jax
import numpy as np

import sparse_embed as se
from sparse_embed import optimizers as opt

B = 16
ITEM_OPTIMIZERS = {"adagrad": opt.Adagrad(0.2), "sgd": opt.SGD(0.3), "rowwise": opt.RowwiseAdagrad(0.2)}


PLACEMENTS = {"row": "row", "table_replicated": {"items": "table", "users": "replicated"}}


def make_plan(mesh, items_optimizer="adagrad", axis_name=None, placement="row") -> se.EmbeddingPlan:
    """items (pooled + sequence features) and users (Adam, needs the step): two stacks."""
    items = se.TableSpec("items", 61, 8, optimizer=ITEM_OPTIMIZERS[items_optimizer], combiner="mean")
    users = se.TableSpec("users", 37, 8, optimizer=opt.Adam(0.05), combiner="sum")
    feats = {
        "clicked": se.FeatureSpec("clicked", items, B),
        "history": se.FeatureSpec("history", items, B, max_sequence_length=3),
        "user": se.FeatureSpec("user", users, B),
    }
    return se.plan(feats, mesh, axis_name=axis_name, placement=PLACEMENTS[placement])


def make_batch(plan: se.EmbeddingPlan, seed: int):
    """A preprocessed batch of random ids (dense `[B, L]` with -1 padding)."""
    rng = np.random.default_rng(seed)
    ids = {}
    for name, f in plan.features.items():
        width = max(f.max_sequence_length, 4)
        ids[name] = rng.integers(-1, f.table.vocabulary_size, size=(f.batch_size, width))
    return se.preprocess(plan, ids)[0]


def cotangents(plan: se.EmbeddingPlan, seed: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.normal(size=f.output_shape).astype(np.float32) for n, f in plan.features.items()}


def features_vector(acts: dict[str, jax.Array]) -> jax.Array:
    """`[B, 5 * dim]`: the pooled features and the flattened sequence."""
    return jax.numpy.concatenate([acts["clicked"], acts["history"].reshape(B, -1), acts["user"]], axis=-1)


def assert_trees_equal(got, want) -> None:
    """Same structure, bitwise-equal leaves (the path is in the message)."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=jax.tree_util.keystr(path))
