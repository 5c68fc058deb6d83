"""jax-tpu-embedding interop: its table layout, natural tables to and from it, and its SparseCore CSR input.

    layout = sparse_embed.jte.jte_layout(plan.tables, num_shards=8)
    stacked = sparse_embed.jte.to_jte(layout, sparse_embed.unstack_tables(plan, tables), num_shards=8)

Specialist: a plan with `sparsecores=S` uses these itself (docs/sparsecore.md,
docs/checkpoints.md). Implemented in `sparse_embed.integrations.jte` and
the SparseCore backend's batch types (`sparse_embed.core.sparsecore.batch`);
loaded on first use.
"""

from sparse_embed import _lazy

__all__ = ["CsrBatch", "JteTableLayout", "SparseCoreBatch", "from_jte", "jte_layout", "jte_layout_from_specs",
           "sparsecore_csr", "to_jte"]

__getattr__, __dir__ = _lazy.attach(__name__, {
    "sparse_embed.core.sparsecore.batch": ("CsrBatch", "SparseCoreBatch"),
    "sparse_embed.integrations.jte": ("JteTableLayout", "from_jte", "jte_layout", "jte_layout_from_specs",
                                      "sparsecore_csr", "to_jte"),
})
