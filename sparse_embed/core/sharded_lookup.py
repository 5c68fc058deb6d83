"""The sharded lookup: a `jax.custom_vjp` whose backward applies the optimizer.

Forward (under `jax.shard_map`, per stack): each device sends every
destination shard its segment of the COO batch (`all_to_all`); each shard's
kernel gathers, clips, scales and pools the rows into per-source partial
activations, which go back (`all_to_all`); each device sums the partials of
its rows.

Backward: the activation gradients are gathered onto every shard
(`all_gather`); each shard's kernel combines the gradients of duplicate
rows and applies the optimizer to exactly the touched rows and their slots.
No work is proportional to the vocabulary. The cotangent returned for
`tables` is the *updated* state, so `jax.grad(loss)(tables)` returns the new
tables. Under the plan's default `nonfinite_gradients="skip"`, a row whose
gradient is NaN/inf keeps its values and slots; `nonfinite_rows` counts such
rows.

Each stack's work on a device is its kernel's (`core.kernels.for_stack`),
through the seam of `core.kernels.interface`: `lookup_forward`,
`lookup_backward` and `nonfinite_rows`. This module runs them inside
`shard_map` and knows neither which kernel nor which backend it got: by
default a kernel routes entries and activations by the stack's placement
(`core.placements`) and does its per-shard work; a backend that owns the
exchange (SparseCore) does it its own way.
"""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sparse_embed.core import kernels
from sparse_embed.core.batch import ShardedCooMatrix, coo, default_gains, is_batch, layout_error
from sparse_embed.core.planning import EmbeddingPlan
from sparse_embed.core.state import (EmbeddingVariables, check_once_per_trace, check_state, check_trainable,
                                     checked_step)


def _local(tree):
    """Inside shard_map: drop the leading device axis of every leaf."""
    return jax.tree.map(lambda x: x[0], tree)


def _stacked(tree):
    """Inside shard_map: add a leading device axis to every leaf (row-sharded outputs)."""
    return jax.tree.map(lambda x: x[None], tree)


def _forward(plan: EmbeddingPlan, batch, tables):
    """Per stack: `(activations [D * rows_per_device, dim], table for the backward, saved)`.

    Every input and output is row-sharded over the plan's axis (the batch
    and what the kernels save with a leading device axis).
    """
    axis = plan.axis_name

    def body(batch, tables):
        out = {}
        for s in plan.stacks:
            fwd = kernels.for_stack(plan, s).lookup_forward(s, axis, _local(batch[s.name]), tables[s.name])
            out[s.name] = (fwd.activations, fwd.table, _stacked(fwd.saved))
        return out

    return jax.shard_map(body, mesh=plan.mesh, in_specs=P(axis), out_specs=P(axis))(batch, tables)


def _backward(plan: EmbeddingPlan, batch, saved, tables, grads, step):
    """Per stack: the updated `EmbeddingVariables` (the kernels' backward on every device)."""
    axis = plan.axis_name
    skip = plan.nonfinite_gradients == "skip"

    def body(batch, saved, tables, grads, step):
        out = {}
        for s in plan.stacks:
            check_trainable(s, tables[s.name])
            out[s.name] = kernels.for_stack(plan, s).lookup_backward(
                s, axis, _local(batch[s.name]), _local(saved[s.name]), tables[s.name], grads[s.name], step, skip)
        return out

    in_specs = (P(axis), P(axis), P(axis), P(axis), P())
    return jax.shard_map(body, mesh=plan.mesh, in_specs=in_specs, out_specs=P(axis))(batch, saved, tables, grads,
                                                                                       step)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup_stacks(plan, batch, tables, step):
    out = _forward(plan, batch, {k: v.table for k, v in tables.items()})
    return {k: v[0] for k, v in out.items()}


def _lookup_fwd(plan, batch, tables, step):
    out = _forward(plan, batch, {k: v.table for k, v in tables.items()})
    acts = {k: v[0] for k, v in out.items()}
    saved = {k: v[2] for k, v in out.items()}
    tables = {k: EmbeddingVariables(out[k][1], v.slots) for k, v in tables.items()}
    return acts, (batch, saved, tables, step)


def _lookup_bwd(plan, residuals, grads):
    batch, saved, tables, step = residuals
    kernels.warn_if_slow(plan)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    return None, _backward(plan, batch, saved, tables, grads, step), None


_lookup_stacks.defvjp(_lookup_fwd, _lookup_bwd)


def _check_batch(plan: EmbeddingPlan, batch: Mapping[str, ShardedCooMatrix]) -> None:
    if not isinstance(batch, Mapping):  # (set() of preprocess's whole (batch, stats) said "unhashable type: 'dict'")
        hint = ("; preprocess returns (batch, stats): batch, stats = sparse_embed.preprocess(plan, ids)"
                if isinstance(batch, tuple) else "")
        raise TypeError(f"batch must be the {{stack: ShardedCooMatrix}} mapping that sparse_embed.preprocess builds, "
                        f"got {type(batch).__name__}{hint}.")
    if set(batch) != set(plan.stack_names):
        raise ValueError(
            f"batch has stacks {sorted(batch)} but the plan has {sorted(plan.stack_names)}; "
            "build it with sparse_embed.preprocess(plan, ...)."
        )
    D = plan.num_shards
    for name, entry in batch.items():
        stack = plan.stack(name)
        why = kernels.for_stack(plan, stack).batch_error(stack, entry)  # the batch type its backend reads
        if why:
            raise (ValueError if is_batch(entry) else TypeError)(why)
        n, S = entry.col_ids.shape, stack.segments
        if entry.shard_starts.shape != (D, S) or len(n) != 2 or n[0] != D or n[1] % S:
            raise ValueError(f"Stack {name!r}: batch arrays have shapes {[x.shape for x in entry[:5]]}, "
                             f"which do not fit a mesh of {D} devices; was it built for another plan?")
        for x in (entry.row_ids, entry.values):
            if x.shape != n:
                raise ValueError(f"Stack {name!r}: col_ids, row_ids and values must have equal shapes.")
        why = layout_error(name, entry.layout, stack.batch_layout)
        if why:
            raise ValueError(why)


def lookup(
    plan: EmbeddingPlan,
    batch: Mapping[str, ShardedCooMatrix],
    tables: Mapping[str, EmbeddingVariables],
    step: jax.Array | int | None = None,
) -> dict[str, jax.Array]:
    """Looks up every feature of the plan. Differentiable w.r.t. `tables`.

    Args:
      plan: the `EmbeddingPlan` (static).
      batch: `{stack: ShardedCooMatrix}` from `preprocess`.
      tables: `{stack: EmbeddingVariables}` from `init_tables`/`stack_tables`.
      step: the global step (int scalar); needed by learning-rate schedules.

    Returns:
      `{feature: activations}`, `[batch_size, dim]` (pooled) or
      `[batch_size, max_sequence_length, dim]` (sequence), float32, sharded
      over the batch.

    The "gradient" of the loss w.r.t. `tables` is the updated state: the
    optimizer already applied to the touched rows. Use `tables` only through
    one `lookup` in a loss (a second one under `jax.grad` raises), and
    replace them with what `jax.grad` returns.
    Rows whose gradient is NaN/inf are left unchanged unless the plan says
    `nonfinite_gradients="apply"` (see `nonfinite_rows`).
    """
    _check_batch(plan, batch)
    check_state(plan, tables)
    check_once_per_trace(plan, tables)
    if step is not None:
        step = checked_step(step, "lookup")
    return _lookup_jit(plan, dict(batch), dict(tables), step)


@functools.partial(jax.jit, static_argnums=0)
def _lookup_jit(plan: EmbeddingPlan, batch, tables, step) -> dict[str, jax.Array]:
    """One compiled program when called eagerly; inlined into the caller's jit otherwise."""
    # ids without a row of a raw-id table read its default vector: the kernels see their rows only
    acts = _lookup_stacks(plan, {k: v if default_gains(v) is None else coo(v) for k, v in batch.items()}, tables,
                          step)
    out = {}
    for s in plan.stacks:
        a, D, dim = acts[s.name], plan.num_shards, s.embedding_dim
        # One array per feature as the kernel wrote it (no copy), or cut out of the stack's rows.
        per = ([x.reshape(D, -1, dim) for x in a] if isinstance(a, tuple)
               else [lay.take(a.reshape(D, s.rows_per_device, dim)) for lay in s.features])
        defaults = default_gains(batch[s.name])
        for lay, x in zip(s.features, per):
            if defaults is not None:  # raw ids without a row read the table's default vector
                dyn = s.dynamic or plan.tiered_tables[s.first.name].dynamic  # an offloaded one's: as declared
                x = x + lay.take(defaults[..., None]) * jnp.asarray(dyn.default_vector(dim))[None, None]
            out[lay.feature.name] = x.reshape(lay.feature.output_shape)
    return out


def _stack_grads(plan: EmbeddingPlan, grads: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """`{feature: dL/dactivations}` -> `{stack: [D * rows_per_device, dim]}` (inverse of `_lookup_jit`'s split)."""
    missing = sorted(set(plan.features) - set(grads))
    if missing:
        raise ValueError(f"activation_grads is missing features {missing}; give one per feature of the plan.")
    out = {}
    for s in plan.stacks:
        parts = []
        for lay in s.features:
            g = jnp.asarray(grads[lay.feature.name], jnp.float32)
            if g.shape != lay.feature.output_shape:
                raise ValueError(f"Feature {lay.feature.name!r}: activation_grads has shape {g.shape}, "
                                 f"but its activations have shape {lay.feature.output_shape}.")
            parts.append(g.reshape(plan.num_shards, lay.rows_per_device, s.embedding_dim))
        out[s.name] = s.join_rows(parts).reshape(-1, s.embedding_dim)
    return out


@functools.partial(jax.jit, static_argnums=0)
def _nonfinite_rows_jit(plan: EmbeddingPlan, batch, grads) -> dict[str, jax.Array]:
    axis = plan.axis_name

    def body(batch, grads):
        out = {}
        for s in plan.stacks:
            out[s.name] = kernels.for_stack(plan, s).nonfinite_rows(s, axis, _local(batch[s.name]), grads[s.name])
        return out

    return jax.shard_map(body, mesh=plan.mesh, in_specs=P(axis), out_specs=P())(batch, _stack_grads(plan, grads))


def nonfinite_rows(
    plan: EmbeddingPlan, batch: Mapping[str, ShardedCooMatrix], activation_grads: Mapping[str, jax.Array]
) -> dict[str, jax.Array]:
    """How many table rows a NaN/inf activation gradient reaches: `{stack: int32 count}`.

    These are the rows that the backward of `lookup` leaves unchanged under
    `plan(..., nonfinite_gradients="skip")` (or poisons under "apply"): rows
    read by an output row whose gradient holds a NaN or inf. (Optimizers
    that combine duplicates also skip a row whose finite gradients overflow
    when summed; that rare row is not counted here.) The
    backward cannot return this count through `jax.grad`, so compute it from
    the gradient of the loss w.r.t. the activations, e.g.
    `jax.grad(head_loss)(acts)`, when the loss is not finite. Jit-able.
    """
    _check_batch(plan, batch)
    return _nonfinite_rows_jit(plan, dict(batch), dict(activation_grads))
