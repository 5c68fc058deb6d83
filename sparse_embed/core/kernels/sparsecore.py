"""A stack's lookup on TPU SparseCores, through jax-tpu-embedding's primitives (inside `shard_map`).

Unlike the other kernels, this one owns the exchange too: on a SparseCore
the primitives read the rows of every device themselves. Per device, from
the stack's CSR input (`host.csr.from_coo`, fields local to the device):

- `forward`: `SparseDenseMatmulOp`, `act[s * b + sample] += gain * row`
  over the device's S slices, `[rows_per_device, dim]`;
- `backward`: `SparseDenseMatmulGradOpWithOptimizerUpdate` with our
  per-row computation: for each touched row, its gradient summed over
  every occurrence, then `Optimizer.update` on that one row (clipping,
  schedules, weight decay included; the learning rate and the step are its
  two hyperparameters), and under "skip" the old row and slots kept when
  the summed gradient is not finite. Returns the new table and slots.

`sharded_lookup` calls them in the TPU branch of `platform_dependent`; the
other branch is the usual exchange and kernel, so the same step runs on
CPU (and is how the tests check the SparseCore branch: lowered for TPU,
and its CSR and per-row computation interpreted in numpy).
"""

from __future__ import annotations

import json

import jax
import jax.extend as jex
import jax.numpy as jnp
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import func as func_dialect
from jax.extend.mlir.dialects import stablehlo as hlo
from jax.interpreters import mlir

from sparse_embed.core.batch import PAD_ID, CsrBatch
from sparse_embed.core.planning import StackPlan
from sparse_embed.core.state import EmbeddingVariables


def _primitives():
    try:
        from jax_tpu_embedding.sparsecore.lib.core.primitives import sparse_dense_matmul_csr
    except ImportError as e:
        raise ImportError("SparseCore stacks need jax-tpu-embedding: pip install \"sparse-embed[tpu]\".") from e
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
        if skip_nonfinite:
            ok = jnp.isfinite(grad).all()
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
