"""Optax for models that hold embedding state: a dense optimizer, and exact swaps.

The "gradient" `jax.grad` returns for an `EmbeddingVariables` is the updated
state (the lookup's backward already applied the table's optimizer), so a
train step must give dense params to optax and *replace* embedding state:

    tx = sparse_embed.optax_tx(optax.adam(1e-3))
    opt_state = tx.init(params)
    ...
    grads = jax.grad(loss)(params, ...)          # embedding leaves: new state
    updates, opt_state = tx.update(grads, opt_state, params)
    params = sparse_embed.apply_updates(params, updates)

`params` is any pytree; every leaf inside an `EmbeddingVariables` (table and
slots) is embedding state, everything else is dense.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from sparse_embed.core.state import EmbeddingVariables

EMBEDDING = "embedding"
DENSE = "dense"


def is_embedding(node: Any) -> bool:
    """True for an `EmbeddingVariables` node (a stack's table and slots)."""
    return isinstance(node, EmbeddingVariables)


def param_labels(params: Any) -> Any:
    """`params` with every `EmbeddingVariables` replaced by "embedding" and every other leaf by "dense".

    A prefix of `params`, usable as `optax.multi_transform` (`optax.partition`) labels.
    """
    return jax.tree.map(lambda x: EMBEDDING if is_embedding(x) else DENSE, params, is_leaf=is_embedding)


class NewState:
    """An embedding state's update from `optax_tx`: its new value, which `apply_updates` swaps in.

    Not a pytree node but an opaque leaf, so that what would corrupt the tables silently fails loudly
    instead: `optax.apply_updates` (which would add the new state to the old one) with jax's structure error
    at the table's key path, naming this type; a transform around `optax_tx` or after it in a chain
    (`optax.MultiSteps`, which emits zero updates between its steps, `optax.scale`, `optax.apply_if_finite`)
    because arithmetic, `jax.lax.cond` and `jit` outputs take arrays only. Apply it inside the `jit`
    that computed it.
    """

    __slots__ = ("state",)

    def __init__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return ("NewState(an embedding state's new value from sparse_embed.optax_tx: apply it with "
                "sparse_embed.apply_updates in the jit that computed it; wrap the dense transform in "
                "MultiSteps / chains, never optax_tx's result)")


def _new_states() -> optax.GradientTransformation:
    """Wraps each embedding update (the new state `jax.grad` returned) in `NewState`; no optimizer state."""

    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda x: NewState(x) if is_embedding(x) else x, updates, is_leaf=is_embedding), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def optax_tx(dense_tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`dense_tx` on the dense leaves; embedding "grads" pass through unchanged.

    Embedding leaves hold no optimizer state and are never seen by `dense_tx`
    (so e.g. `optax.clip_by_global_norm` inside it measures dense grads only).
    The updates this returns must be applied with `sparse_embed.apply_updates`:
    an embedding update is a `NewState`, on which `optax.apply_updates` (which
    would add the new table to the old one) fails.
    Put every transform inside `dense_tx` (`optax_tx(optax.chain(clip, adam))`,
    `optax_tx(optax.MultiSteps(adam, k))`): an embedding update is a new
    state, not a delta. Around or after `optax_tx` a transform fails on the
    `NewState`; before it in a chain it would take the new tables for
    gradients (silently: docs/concepts.md).
    """
    # multi_transform: the name every optax >= 0.2.4 has (later also `optax.partition`).
    tx = optax.multi_transform({DENSE: dense_tx, EMBEDDING: _new_states()}, param_labels)
    return tx._replace(init=lambda params: on_tables_mesh(tx.init(params), params))


def tables_mesh(tables: Any) -> Mesh | None:
    """The mesh the (concrete, placed) arrays of `tables` are on, if they are all on one; else None."""
    meshes = {x.sharding.mesh for x in jax.tree.leaves(tables)
              if _concrete(x) and isinstance(x.sharding, NamedSharding)}
    return meshes.pop() if len(meshes) == 1 else None


def replicate_unplaced(tree: Any, mesh: Mesh | None) -> Any:
    """`tree` with its unplaced arrays (uncommitted, as optax makes a step count or an eager init the params)
    replicated on `mesh` (the tables', a one-device mesh too): a jitted train step returns them there, so
    without this its second call would miss the first one's jit cache entry and compile the step again.
    Arrays the caller placed stay."""
    if mesh is None:
        return tree
    replicated = NamedSharding(mesh, PartitionSpec())
    unplaced = lambda x: (_concrete(x) and isinstance(x.sharding, SingleDeviceSharding)
                          and not getattr(x, "_committed", True))
    return jax.tree.map(lambda x: jax.device_put(x, replicated) if unplaced(x) else x, tree)


def on_tables_mesh(tree: Any, params: Any) -> Any:
    """`replicate_unplaced(tree, ...)` on the mesh of the `EmbeddingVariables` in `params` (none: `tree`)."""
    tables = [e for e in jax.tree.leaves(params, is_leaf=is_embedding) if is_embedding(e)]
    return replicate_unplaced(tree, tables_mesh(tables))


def _concrete(x: Any) -> bool:  # (a tracer, in a jit, has no placement yet: the jit's outputs are placed by it)
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def _apply_one(param: Any, update: Any) -> Any:
    if not is_embedding(param):
        return optax.apply_updates(param, update)
    update = update.state if isinstance(update, NewState) else update
    if not is_embedding(update):
        raise TypeError(
            f"apply_updates: an embedding state's update must be the EmbeddingVariables that jax.grad returned "
            f"for it, got {type(update).__name__}. Build the optimizer with sparse_embed.optax_tx(dense_tx)."
        )
    return update


def apply_updates(params: Any, updates: Any) -> Any:
    """`optax.apply_updates` on dense leaves; embedding state becomes its update, bit for bit.

    Embedding leaves are replaced, not added to: no arithmetic and no pass
    over the tables (with donation the new tables are the backward's
    in-place scatter). `updates` must come from `optax_tx(...).update` (or
    hold the `EmbeddingVariables` jax.grad returned where params hold one).
    """
    return jax.tree.map(_apply_one, params, updates, is_leaf=lambda x: is_embedding(x) or isinstance(x, NewState))
