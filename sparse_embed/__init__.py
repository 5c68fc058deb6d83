"""sparse_embed: large sharded embedding tables for JAX, trained in the backward pass.

spec -> plan -> tables -> preprocess -> lookup:

    tables = sparse_embed.init_tables(plan, rng)
    batch, stats = sparse_embed.preprocess(plan, ids)
    activations = sparse_embed.lookup(plan, batch, tables, step)
    # jax.grad(loss) w.r.t. tables returns the *updated* tables.

The implementation lives in layers, each importing only those below it:
`core` (pure JAX), `host` (preprocessing), `io` (checkpoints, serving) and
`integrations` (optax, Flax, LayoutMap, jax-tpu-embedding). This module
re-exports the public API (`__all__`; a few more names are importable for
type annotations). Each name is imported on first use (`_lazy`), so
`import sparse_embed.core` loads neither orbax, tensorstore, flax nor optax,
and importing this module has no side effects.

Specialist names live in namespaces of their own: `sparse_embed.jte`
(jax-tpu-embedding's layout and SparseCore input), `sparse_embed.tuning`
(XLA:CPU and allocator settings), `sparse_embed.raw_ids` (raw-id tables'
natural form and map state), `sparse_embed.offload` (tables on disk under
a device cache), `sparse_embed.serving` (int8/int4 serving tables, live
updates by deltas), `sparse_embed.torchrec` (TorchRec's tables and fused
optimizer state in and out), `sparse_embed.data` (input pipelines that
resume exactly, the Criteo reader); `sparse_embed.flax.linen` / `.nnx` hold the
Flax modules. Their old top-level names work until the next release, with
a `DeprecationWarning`.
"""

from sparse_embed import _lazy

__version__ = "0.2.0"

__all__ = [
    # specs and the plan
    "Dynamic",
    "EmbeddingPlan",
    "FeatureSpec",
    "TableSpec",
    "grow_capacity",
    "initializers",
    "optimizers",
    "plan",
    # table state
    "EmbeddingVariables",
    "init_tables",
    "stack_tables",
    "unstack_state",
    "unstack_tables",
    # host: batches
    "ShardedCooMatrix",
    "Stats",
    "distributed",
    "prefetch",
    "preprocess",
    # the lookup (XLA:CPU and allocator settings: sparse_embed.tuning)
    "lookup",
    "nonfinite_rows",
    # raw-id tables (their natural form and map state: sparse_embed.raw_ids)
    "init_id_maps",
    "map_ids",
    # training with optax and flax (flax modules: sparse_embed.flax.linen / .nnx)
    "LayoutMap",
    "apply_updates",
    "optax_tx",
    # checkpoints and serving (jax-tpu-embedding's layout: sparse_embed.jte)
    "CheckpointError",
    "CheckpointManager",
    "CorruptCheckpointError",
    "convert_checkpoint",
    "export_serving",
    "load_serving",
    "read_info",
    "restore_embeddings",
    "serving_lookup",
    "verify_checkpoint",
]

# Where each name comes from: `__all__` and the names importable for type annotations.
_NAMES = {
    "sparse_embed.core.batch": ("ShardedCooMatrix", "Stats"),
    "sparse_embed.core.id_maps": ("init_id_maps", "map_ids"),
    "sparse_embed.core.planning": ("EmbeddingPlan", "FeatureLayout", "StackPlan", "TablePlacement", "grow_capacity",
                                   "plan"),
    "sparse_embed.core.sharded_lookup": ("lookup", "nonfinite_rows"),
    "sparse_embed.core.specs": ("Dynamic", "FeatureSpec", "TableSpec"),
    "sparse_embed.core.state": ("EmbeddingVariables",),
    "sparse_embed.core.tables": ("init_tables", "stack_tables", "unstack_state", "unstack_tables"),
    "sparse_embed.host.ids": ("FlatIds", "flatten"),
    "sparse_embed.host.prefetching": ("Prefetched", "Prefetcher", "prefetch"),
    "sparse_embed.host.preprocessing": ("preprocess",),
    "sparse_embed.integrations.layout_map": ("LayoutMap",),
    "sparse_embed.integrations.optax_utils": ("apply_updates", "optax_tx", "param_labels"),
    "sparse_embed.io.checkpoint": ("CheckpointError", "CheckpointInfo", "CheckpointManager", "CorruptCheckpointError",
                                   "Restored", "TableRecord", "read_info", "restore_embeddings"),
    "sparse_embed.io.convert": ("convert_checkpoint", "export_serving", "load_serving"),
    "sparse_embed.io.serving": ("serving_lookup",),
    "sparse_embed.io.verify": ("Verification", "verify_checkpoint"),
}
_SUBMODULES = ("data", "distributed", "flax", "initializers", "jte", "offload", "optimizers", "raw_ids", "serving",
               "torchrec", "tuning")
# Old top-level names -> their namespace now (each still resolves, with a DeprecationWarning)
_MOVED = {
    **dict.fromkeys(("CsrBatch", "JteTableLayout", "from_jte", "jte_layout", "jte_layout_from_specs",
                     "sparsecore_csr", "to_jte"), "sparse_embed.jte"),
    **dict.fromkeys(("configure_cpu_allocator", "configure_xla_cpu"), "sparse_embed.tuning"),
    **dict.fromkeys(("IdMap", "IdMapStats", "IdTable", "id_table_contents", "load_id_tables"),
                    "sparse_embed.raw_ids"),
}

__getattr__, __dir__ = _lazy.attach(__name__, _NAMES, submodules=_SUBMODULES, moved=_MOVED)
