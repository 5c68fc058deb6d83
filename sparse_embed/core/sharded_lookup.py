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

Which entries and activations move where is the stack's placement's
(`core.placements`: its `exchange`, `activations` and `backward`, with the
collectives of `core.collectives`); the per-shard work is a `core.kernels`
implementation. This module runs them inside `shard_map` and knows nothing
of how either works. A
SparseCore stack (`plan(sparsecores=S)`) runs `kernels.sparsecore` instead
on TPU, which does the exchange itself (`jax.lax.platform_dependent`).
"""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sparse_embed.core import kernels
from sparse_embed.core.batch import ShardedCooMatrix
from sparse_embed.core.kernels import Received
from sparse_embed.core.kernels import sparsecore
from sparse_embed.core.kernels.generic import nonfinite_row_count, warn_if_slow_on_cpu
from sparse_embed.core.planning import EmbeddingPlan, StackPlan
from sparse_embed.core.state import EmbeddingVariables, check_state, check_trainable


def _exchange(stack: StackPlan, axis: str, coo: ShardedCooMatrix) -> Received:
    """The entries this device's kernel reads (inside shard_map), `[sources, C]`, by the stack's placement."""
    return Received(*stack.strategy.exchange(stack, axis, coo))


def _activations(stack: StackPlan, axis: str, partials: jax.Array) -> jax.Array:
    """This device's activations `[rows_per_device, dim]` from every shard's partials `[D, partial_rows, dim]`
    (or, in blocks, `([n_i, dim], ...)` from `([1, n_i, dim], ...)`: see `StackPlan.activations_per_feature`)."""
    if isinstance(partials, tuple):
        return tuple(p[0] for p in partials)
    return stack.strategy.activations(stack, axis, partials)


def _local(tree):
    """Inside shard_map: drop the leading device axis of every leaf."""
    return jax.tree.map(lambda x: x[0], tree)


def _stacked(tree):
    """Inside shard_map: add a leading device axis to every leaf (row-sharded outputs)."""
    return jax.tree.map(lambda x: x[None], tree)


def _on_tpu_sparsecores(stack: StackPlan, axis: str, tpu, default, *args):
    """`default(*args)`, or on TPU `tpu(*args)` for a SparseCore stack (`default`'s outputs' shapes and types)."""
    if not stack.sparsecores:
        return default(*args)

    def on_sparsecores(*args):
        out, likes = tpu(*args), jax.eval_shape(default, *args)
        if type(out) is tuple:  # None: what the TPU does not need; zeros shaped like the default's
            out = tuple(jax.tree.map(lambda like: jnp.zeros(like.shape, like.dtype), like) if x is None else x
                        for x, like in zip(out, likes))
        # Typed as varying over the axis where the default's outputs are (the primitives' never are).
        varying = lambda x: axis in jax.typeof(x).manual_axis_type.varying
        return jax.tree.map(lambda x, like: jax.lax.pcast(x, axis, to="varying")
                            if axis in like.manual_axis_type.varying and not varying(x) else x, out, likes)

    return jax.lax.platform_dependent(*args, tpu=on_sparsecores, default=default)


def _forward(plan: EmbeddingPlan, batch, tables):
    """Per stack: `(activations [D * rows_per_device, dim], received, table for the backward, saved)`.

    Every input and output is row-sharded over the plan's axis (the batch
    and residuals with a leading device axis). On TPU a SparseCore stack
    saves nothing (zeros of the same shapes) but its CSR.
    """
    axis = plan.axis_name

    def body(batch, tables):
        out = {}
        for s in plan.stacks:
            def usual(coo, table, s=s):
                rec = _exchange(s, axis, coo)
                view = s.strategy.view(s, axis, s.activations_per_feature)
                fwd = kernels.for_stack(plan, s).forward(view, rec, table)
                return _activations(s, axis, fwd.partials), _stacked(rec), fwd.table, _stacked(fwd.saved)

            def on_sparsecores(coo, table, s=s):
                return sparsecore.forward(s, coo.csr, table), None, table, None

            out[s.name] = _on_tpu_sparsecores(s, axis, on_sparsecores, usual, _local(batch[s.name]), tables[s.name])
        return out

    return jax.shard_map(body, mesh=plan.mesh, in_specs=P(axis), out_specs=P(axis))(batch, tables)


def _kernel_backward(plan: EmbeddingPlan, s: StackPlan, rec: Received, saved, state: EmbeddingVariables,
                     grads: jax.Array, step, skip: bool) -> EmbeddingVariables:
    """Inside shard_map: a stack's update by its kernel, from this device's activation gradients (routed to the
    shards by the stack's placement)."""
    return s.strategy.backward(s, plan.axis_name, kernels.for_stack(plan, s), rec, saved, state, grads, step, skip)


def _backward(plan: EmbeddingPlan, recs, saved, csrs, tables, grads, step):
    """Per stack: the updated `EmbeddingVariables` (the kernels' backward on every shard)."""
    axis = plan.axis_name
    skip = plan.nonfinite_gradients == "skip"

    def body(recs, saved, csrs, tables, grads, step):
        out = {}
        for s in plan.stacks:
            check_trainable(s, tables[s.name])

            def usual(csr, state, g, s=s):
                return _kernel_backward(plan, s, _local(recs[s.name]), _local(saved[s.name]), state, g, step, skip)

            def on_sparsecores(csr, state, g, s=s):
                return sparsecore.backward(s, csr, state, g, step, skip)

            out[s.name] = _on_tpu_sparsecores(s, axis, on_sparsecores, usual, _local(csrs.get(s.name)),
                                              tables[s.name], grads[s.name])
        return out

    in_specs = (P(axis), P(axis), P(axis), P(axis), P(axis), P())
    return jax.shard_map(body, mesh=plan.mesh, in_specs=in_specs, out_specs=P(axis))(recs, saved, csrs, tables,
                                                                                       grads, step)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup_stacks(plan, batch, tables, step):
    out = _forward(plan, batch, {k: v.table for k, v in tables.items()})
    return {k: v[0] for k, v in out.items()}


def _lookup_fwd(plan, batch, tables, step):
    out = _forward(plan, batch, {k: v.table for k, v in tables.items()})
    acts = {k: v[0] for k, v in out.items()}
    recs = {k: v[1] for k, v in out.items()}
    saved = {k: v[3] for k, v in out.items()}
    csrs = {s.name: batch[s.name].csr for s in plan.stacks if s.sparsecores}
    tables = {k: EmbeddingVariables(out[k][2], v.slots) for k, v in tables.items()}
    return acts, (recs, saved, csrs, tables, step)


def _lookup_bwd(plan, residuals, grads):
    recs, saved, csrs, tables, step = residuals
    warn_if_slow_on_cpu(plan, [s.name for s in plan.stacks if isinstance(kernels.for_stack(plan, s),
                                                                           kernels.GenericKernel)])
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    return None, _backward(plan, recs, saved, csrs, tables, grads, step), None


_lookup_stacks.defvjp(_lookup_fwd, _lookup_bwd)


def _check_batch(plan: EmbeddingPlan, batch: Mapping[str, ShardedCooMatrix]) -> None:
    if set(batch) != set(plan.stack_names):
        raise ValueError(
            f"batch has stacks {sorted(batch)} but the plan has {sorted(plan.stack_names)}; "
            "build it with sparse_embed.preprocess(plan, ...)."
        )
    D = plan.num_shards
    for name, coo in batch.items():
        if not isinstance(coo, ShardedCooMatrix):
            raise TypeError(f"Stack {name!r}: batch entry must be a ShardedCooMatrix, got {type(coo).__name__}.")
        n, S = coo.col_ids.shape, plan.stack(name).segments if name in plan.stack_names else D
        if coo.shard_starts.shape != (D, S) or len(n) != 2 or n[0] != D or n[1] % S:
            raise ValueError(f"Stack {name!r}: batch arrays have shapes {[x.shape for x in coo[:5]]}, "
                             f"which do not fit a mesh of {D} devices; was it built for another plan?")
        for x in (coo.row_ids, coo.values):
            if x.shape != n:
                raise ValueError(f"Stack {name!r}: col_ids, row_ids and values must have equal shapes.")
        if plan.stack(name).sparsecores and coo.csr is None:
            raise ValueError(f"Stack {name!r} runs on SparseCores but its batch has no CSR input; build the batch "
                             "with sparse_embed.preprocess(plan, ...) for this plan.")
        if coo.keys is not None:
            raise ValueError(f"Stack {name!r}: the batch holds raw ids (its table is dynamic); map them to rows "
                             "first: batch, tables, id_maps, stats = sparse_embed.map_ids(plan, batch, tables, "
                             "id_maps, step).")


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
    one `lookup` in a loss, and replace them with what `jax.grad` returns.
    Rows whose gradient is NaN/inf are left unchanged unless the plan says
    `nonfinite_gradients="apply"` (see `nonfinite_rows`).
    """
    _check_batch(plan, batch)
    check_state(plan, tables)
    if step is not None:
        step = jnp.asarray(step)
    return _lookup_jit(plan, dict(batch), dict(tables), step)


@functools.partial(jax.jit, static_argnums=0)
def _lookup_jit(plan: EmbeddingPlan, batch, tables, step) -> dict[str, jax.Array]:
    """One compiled program when called eagerly; inlined into the caller's jit otherwise."""
    acts = _lookup_stacks(plan, {k: v._replace(defaults=None) for k, v in batch.items()}, tables, step)
    out = {}
    for s in plan.stacks:
        a, D, dim = acts[s.name], plan.num_shards, s.embedding_dim
        # One array per feature as the kernel wrote it (no copy), or cut out of the stack's rows.
        per = ([x.reshape(D, -1, dim) for x in a] if isinstance(a, tuple)
               else [lay.take(a.reshape(D, s.rows_per_device, dim)) for lay in s.features])
        defaults = batch[s.name].defaults
        for lay, x in zip(s.features, per):
            if defaults is not None:  # raw ids without a row read the table's default vector
                x = x + lay.take(defaults[..., None]) * jnp.asarray(s.dynamic.default_vector(dim))[None, None]
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
            rec = _exchange(s, axis, _local(batch[s.name]))
            out[s.name] = s.strategy.nonfinite_rows(s, axis, rec, grads[s.name], nonfinite_row_count)
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
