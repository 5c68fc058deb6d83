"""A SparseCore stack's kernel: jax-tpu-embedding's primitives on TPU, the usual kernel elsewhere.

`SparseCoreKernel` is the stack's kernel behind the lookup's seam
(`core.kernels.interface`); `core.kernels.for_stack` wraps the kernel the
plan would otherwise run (`fallback`: native or generic) in it. Unlike the
other kernels it owns the exchange too: on a SparseCore the primitives read
the rows of every device themselves. So it implements the whole-stack
methods, each a `jax.lax.platform_dependent` whose TPU branch runs the
primitives and whose other branch is the fallback's usual exchange and
kernel on the same arrays: one jitted step holds both, the same step runs
on CPU (which is how the tests check the TPU branch: lowered for TPU, and
its CSR and per-row computation interpreted in numpy). Per device, from the
stack's CSR input (`SparseCoreBatch.csr`, fields local to the device):

- `forward`: `SparseDenseMatmulOp`, `act[s * b + sample] += gain * row`
  over the device's S slices, `[rows_per_device, dim]`;
- `backward`: `SparseDenseMatmulGradOpWithOptimizerUpdate` with our
  per-row computation: for each touched row, its gradient summed over
  every occurrence, then `Optimizer.update` on that one row (clipping,
  schedules, weight decay included; the learning rate and the step are its
  two hyperparameters), and under "skip" the old row and slots kept when
  the summed gradient or the update is not finite. Returns the new table and slots.

Everything else (the per-shard work, `nonfinite_rows`, the raw-id map's
search) is the fallback's.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, ClassVar, Sequence

import jax
import jax.extend as jex
import jax.numpy as jnp
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import func as func_dialect
from jax.extend.mlir.dialects import stablehlo as hlo
from jax.interpreters import mlir

from sparse_embed.core import key_set
from sparse_embed.core.collectives import KernelStack
from sparse_embed.core.kernels.interface import Forward, Kernel, Received, StackForward
from sparse_embed.core.planning import StackPlan
from sparse_embed.core.sparsecore.batch import PAD_ID, CsrBatch, SparseCoreBatch
from sparse_embed.core.state import EmbeddingVariables


def _primitives():
    try:
        from jax_tpu_embedding.sparsecore.lib.core.primitives import sparse_dense_matmul_csr
    except ImportError as e:
        raise ImportError("SparseCore stacks need jax-tpu-embedding: pip install jax-tpu-embedding.") from e
    return sparse_dense_matmul_csr.tpu_sparse_dense_matmul_csr_primitive


def max_ids(stack: StackPlan, csr: CsrBatch) -> int:
    """The `max_ids_per_partition` the CSR was built for (its entries per slice over the partitions)."""
    return csr.embedding_ids.shape[-1] // stack.sparsecores // (stack.num_shards * stack.sparsecores)


def forward(stack: StackPlan, csr: CsrBatch, table: jax.Array) -> jax.Array:
    """This device's activations `[rows_per_device, dim]` (one device's CSR fields, 1-D)."""
    matmul = _primitives()
    m = max_ids(stack, csr)
    act = matmul.bind(csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains, jnp.int32(1), table,
                      device_batch_size=stack.sparsecores * stack.slice_rows, max_ids_per_partition=m,
                      max_unique_ids_per_partition=m, sharding_strategy=1, quantization_config=None,
                      enable_minibatching=False)
    return act


def row_update(stack: StackPlan, skip_nonfinite: bool):
    """The per-row computation: `(grad, row, *slots, lr, step) -> (row', *slots')`, every array `[1, dim]`."""
    opt = stack.optimizer
    names = list(opt.slots(stack.embedding_dim))

    def update(grad, row, *rest):
        *slots, lr, step = rest
        new_row, new_slots = opt.update(row, dict(zip(names, slots)), grad, step, lr=lr)
        new = (new_row, *(new_slots[k] for k in names))
        if skip_nonfinite:  # a NaN/inf gradient, or a finite one whose update overflows (g² past float32's range)
            ok = jnp.isfinite(grad).all() & jnp.all(jnp.stack([jnp.isfinite(n).all() for n in new]))
            new = tuple(jnp.where(ok, n, o) for n, o in zip(new, (row, *slots)))
        return new

    return update


def row_update_stablehlo(stack: StackPlan, skip_nonfinite: bool) -> str:
    """`row_update` lowered on `[1, dim]` rows: the computation the SparseCore runs for each touched row."""
    n = 2 + len(stack.optimizer.slots(stack.embedding_dim)) + len(_HYPERPARAMETERS)
    row = jax.ShapeDtypeStruct((1, stack.embedding_dim), jnp.float32)
    return jax.jit(row_update(stack, skip_nonfinite), keep_unused=True).lower(*[row] * n).as_text(dialect="stablehlo")


_HYPERPARAMETERS = ("learning_rate", "step")  # the scalars each row's computation gets, in this order


def backward(stack: StackPlan, csr: CsrBatch, variables: EmbeddingVariables, grads: jax.Array, step,
             skip_nonfinite: bool) -> EmbeddingVariables:
    """The updated table and slots of this device; `grads` `[rows_per_device, dim]` of its activations."""
    opt, m = stack.optimizer, max_ids(stack, csr)
    names = list(opt.slots(stack.embedding_dim))
    hyper = (opt.learning_rate_at(step).astype(jnp.float32), jnp.asarray(0 if step is None else step, jnp.float32))
    out = _grad_update_p.bind(csr.row_pointers, csr.embedding_ids, csr.sample_ids, csr.gains, grads,
                              variables.table, *(variables.slots[k] for k in names), *hyper,
                              num_hyperparameters=len(hyper), stablehlo=row_update_stablehlo(stack, skip_nonfinite),
                              max_ids_per_partition=m, max_unique_ids_per_partition=m,
                              computation_name=f"sparse_embed_{type(opt).__name__.lower()}_{stack.name}")
    return EmbeddingVariables(out[0], dict(zip(names, out[1:])))


# The grad-and-update custom call, as jax-tpu-embedding's custom-optimizer primitive emits it (its 0.1.0
# takes the per-row computation as a jaxpr, whose lowering fails when lowering for several platforms at
# once; this one takes it as StableHLO, as its later releases do). Only the TPU branch of
# `platform_dependent` reaches it; there is no implementation for other platforms.
_grad_update_p = jex.core.Primitive("sparse_embed_sparsecore_grad_update")
_grad_update_p.multiple_results = True


def _grad_update_abstract_eval(*args, num_hyperparameters: int, **params):
    variables = args[5:len(args) - num_hyperparameters]
    return tuple(jax.core.ShapedArray(v.shape, jnp.float32) for v in variables)


_grad_update_p.def_abstract_eval(_grad_update_abstract_eval)


def _grad_update_lowering(ctx, *args, num_hyperparameters: int, stablehlo: str, max_ids_per_partition: int,
                          max_unique_ids_per_partition: int, computation_name: str):
    variables = args[5:len(args) - num_hyperparameters]
    row = ir.RankedTensorType.get([1, ir.RankedTensorType(variables[0].type).get_dim_size(1)], ir.F32Type.get())
    callee = mlir.merge_mlir_modules(ctx.module_context.module, f"{computation_name}_rows",
                                     ir.Module.parse(stablehlo, context=ctx.module_context.context),
                                     dst_symtab=ctx.module_context.symbol_table)
    # The called computation: (grad, table, *slots, *hyperparameters) rows -> tuple(table, *slots) rows.
    n_in, n_out = 1 + len(variables) + num_hyperparameters, len(variables)
    wrapper = func_dialect.FuncOp(computation_name, ([row] * n_in, [ir.TupleType.get_tuple([row] * n_out)]),
                                  ip=ctx.module_context.ip, visibility="private")
    name = ctx.module_context.symbol_table.insert(wrapper).value  # renamed if the name is taken (a second lookup)
    with ir.InsertionPoint(wrapper.add_entry_block()):
        call = func_dialect.CallOp([row] * n_out, ir.FlatSymbolRefAttr.get(callee), list(wrapper.arguments))
        func_dialect.ReturnOp([hlo.tuple(list(call.results))])
    config = {"max_ids_per_partition": max_ids_per_partition,
              "max_unique_ids_per_partition": max_unique_ids_per_partition, "pad_value": PAD_ID,
              "sharding_strategy": 1, "num_slot_variables": len(variables) - 1,
              "num_hyperparameters": num_hyperparameters}
    op = jax.ffi.ffi_lowering(
        "SparseDenseMatmulGradOpWithOptimizerUpdate", result_types=[ir.TupleType.get_tuple(
            [v.type for v in variables])],
        backend_config=json.dumps({"sparse_dense_matmul_config": config, "device_type": "DEVICE_TYPE_SPARSECORE"}),
        called_computations=[name], skip_ffi_layout_processing=True, api_version=1)(ctx, *args)
    out = []
    for i in range(len(variables)):
        element = hlo.GetTupleElementOp(op[0], i)
        element.attributes["mhlo.frontend_attributes"] = ir.DictAttr.get(
            {"_xla_compute_type": ir.StringAttr.get("sparse")})
        out.append(element.results)
    return tuple(out)


mlir.register_lowering(_grad_update_p, _grad_update_lowering)


def _on_tpu(axis: str, tpu: Callable, default: Callable, *args):
    """`default(*args)`, or on TPU `tpu(*args)`, typed as `default`'s outputs: inside shard_map, a None output
    of `tpu` (what the TPU does not need) becomes zeros shaped like the default's, and every output is varying
    over `axis` where the default's is (the primitives' never are)."""

    def on_sparsecores(*args):
        out, likes = tpu(*args), jax.eval_shape(default, *args)
        if isinstance(out, tuple):
            out = type(out)(*(jax.tree.map(lambda like: jnp.zeros(like.shape, like.dtype), like) if x is None else x
                              for x, like in zip(out, likes)))
        varying = lambda x: axis in jax.typeof(x).manual_axis_type.varying
        return jax.tree.map(lambda x, like: jax.lax.pcast(x, axis, to="varying")
                            if axis in like.manual_axis_type.varying and not varying(x) else x, out, likes)

    return jax.lax.platform_dependent(*args, tpu=on_sparsecores, default=default)


@dataclasses.dataclass(frozen=True)
class SparseCoreKernel:
    """A SparseCore stack's kernel (see the module docstring): the primitives on TPU, `fallback` elsewhere."""

    fallback: Kernel  # the kernel the plan runs off TPU (on the same arrays), and for every per-shard method
    name: ClassVar[str] = "sparsecore"

    @property
    def needs_xla_cpu_flags(self) -> bool:
        return self.fallback.needs_xla_cpu_flags

    def unsupported(self, stack: StackPlan) -> str | None:
        return self.fallback.unsupported(stack)  # what the primitives cannot run, the plan never gives them

    def batch_error(self, stack: StackPlan, entry: Any) -> str | None:
        if not isinstance(entry, SparseCoreBatch):
            return (f"Stack {stack.name!r} runs on SparseCores but its batch has no CSR input (a SparseCoreBatch, got "
                    f"a {type(entry).__name__}); build the batch with sparse_embed.preprocess(plan, ...) for this "
                    "plan.")
        return None

    # ------------------------------------------------------------ a whole stack on one device
    def lookup_forward(self, stack: StackPlan, axis: str, batch: SparseCoreBatch, table: jax.Array) -> StackForward:
        """On TPU the activations and the table as they are; it saves nothing (zeros shaped like the
        fallback's residuals): the backward reads the batch's CSR."""
        def usual(batch, table):
            return self.fallback.lookup_forward(stack, axis, batch, table)

        def on_sparsecores(batch, table):
            return StackForward(forward(stack, batch.csr, table), table, None)

        return _on_tpu(axis, on_sparsecores, usual, batch, table)

    def lookup_backward(self, stack: StackPlan, axis: str, batch: SparseCoreBatch, saved: Any,
                        variables: EmbeddingVariables, grads: Any, step, skip_nonfinite: bool) -> EmbeddingVariables:
        def usual(csr, state, g):
            return self.fallback.lookup_backward(stack, axis, batch, saved, state, g, step, skip_nonfinite)

        def on_sparsecores(csr, state, g):
            return backward(stack, csr, state, g, step, skip_nonfinite)

        return _on_tpu(axis, on_sparsecores, usual, batch.csr, variables, grads)

    def nonfinite_rows(self, stack: StackPlan, axis: str, batch: Any, grads: jax.Array) -> jax.Array:
        return self.fallback.nonfinite_rows(stack, axis, batch, grads)

    # ------------------------------------------------------------ the fallback's
    def forward(self, stack: KernelStack, received: Received, table: jax.Array) -> Forward:
        return self.fallback.forward(stack, received, table)

    def backward(self, stack: KernelStack, received: Received, saved: Any, variables: EmbeddingVariables,
                 grads: Any, step, skip_nonfinite: bool) -> EmbeddingVariables:
        return self.fallback.backward(stack, received, saved, variables, grads, step, skip_nonfinite)

    def find_keys(self, keys: key_set.KeySet, queries: jax.Array) -> jax.Array:
        return self.fallback.find_keys(keys, queries)

    def touch_keys(self, keys: key_set.KeySet, queries: jax.Array, step: jax.Array,
                   stale_before: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self.fallback.touch_keys(keys, queries, step, stale_before)

    def touch_keys_many(self, sets: Sequence[tuple[key_set.KeySet, jax.Array, jax.Array]],
                        step: jax.Array) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
        return self.fallback.touch_keys_many(sets, step)

    def insert_keys(self, keys: key_set.KeySet, capacity: jax.Array, queries: jax.Array, want: jax.Array,
                    removed: jax.Array | None, step: jax.Array) -> key_set.Inserted:
        return self.fallback.insert_keys(keys, capacity, queries, want, removed, step)

    def unique_keys(self, queries: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.fallback.unique_keys(queries)

    def take_rows(self, values: jax.Array, index: jax.Array, fill: int) -> jax.Array:
        return self.fallback.take_rows(values, index, fill)
