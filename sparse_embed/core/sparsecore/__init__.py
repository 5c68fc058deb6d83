"""The SparseCore backend: TPU SparseCores through jax-tpu-embedding's primitives (docs/sparsecore.md).

A plan with `sparsecores=S > 0` (SparseCores per device; detected on TPU)
runs each stack the primitives can run on them, and lays it out as
jax-tpu-embedding does. The backend is one package per layer it needs
(core imports only core; its preprocessing is host code):

- `layout` (core): how many SparseCores a plan uses, which stacks they can
  run (the others fall back to the usual kernels, with one warning each);
  the plan records the layout as data (`StackPlan.sparsecores`, the "row"
  placement over every SparseCore, one output slice per SparseCore);
- `batch` (core): a SparseCore stack's batch type, `SparseCoreBatch` (its
  COO entries and the primitives' CSR input, `CsrBatch`);
- `kernel` (core): `SparseCoreKernel`, the stack's kernel behind the
  lookup's seam (`core.kernels.interface`): the primitives on TPU, the
  usual kernel on the same arrays elsewhere (`jax.lax.platform_dependent`);
- `sparse_embed.host.sparsecore_input` (host): its preprocessing hook,
  which adds the CSR to each SparseCore stack's COO batch;
- `sparse_embed.integrations.jte.sparsecore_csr`: the same CSR without a
  plan, for tables in any jax-tpu-embedding layout.

A plan without SparseCore stacks runs none of this: the kernel registry
(`core.kernels.for_stack`) and `preprocess` pick a backend's kernel and hook
by the stack's `backend`.
"""

NAME = "sparsecore"  # `StackPlan.backend` of a stack that runs on SparseCores
