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
type annotations); importing it has no side effects.
"""

from sparse_embed import distributed, initializers, optimizers
from sparse_embed.core.batch import CsrBatch, ShardedCooMatrix, Stats
from sparse_embed.core.id_maps import IdMap, IdMapStats, init_id_maps, map_ids
from sparse_embed.core.kernels.generic import configure_xla_cpu
from sparse_embed.core.planning import EmbeddingPlan, FeatureLayout, StackPlan, TablePlacement, grow_capacity, plan
from sparse_embed.core.sharded_lookup import lookup, nonfinite_rows
from sparse_embed.core.specs import Dynamic, FeatureSpec, TableSpec
from sparse_embed.core.state import EmbeddingVariables
from sparse_embed.core.tables import init_tables, stack_tables, unstack_state, unstack_tables
from sparse_embed.host.ids import FlatIds, flatten
from sparse_embed.host.malloc import configure_cpu_allocator
from sparse_embed.host.prefetching import Prefetched, Prefetcher, prefetch
from sparse_embed.host.preprocessing import preprocess
from sparse_embed.integrations.jte import JteTableLayout, from_jte, jte_layout, jte_layout_from_specs, to_jte
from sparse_embed.integrations.layout_map import LayoutMap
from sparse_embed.integrations.sparsecore import sparsecore_csr
from sparse_embed.integrations.optax_utils import apply_updates, optax_tx, param_labels
from sparse_embed.io.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    CheckpointManager,
    CorruptCheckpointError,
    Restored,
    TableRecord,
    read_info,
    restore_embeddings,
)
from sparse_embed.io.id_tables import IdTable, id_table_contents, load_id_tables
from sparse_embed.io.convert import convert_checkpoint, export_serving, load_serving
from sparse_embed.io.verify import Verification, verify_checkpoint
from sparse_embed.io.serving import serving_lookup

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
    "Prefetched",
    "Prefetcher",
    "ShardedCooMatrix",
    "Stats",
    "distributed",
    "prefetch",
    "preprocess",
    # the lookup
    "configure_cpu_allocator",
    "configure_xla_cpu",
    "lookup",
    "nonfinite_rows",
    # raw-id tables
    "IdMap",
    "IdMapStats",
    "IdTable",
    "id_table_contents",
    "init_id_maps",
    "load_id_tables",
    "map_ids",
    # training with optax and flax (flax modules: sparse_embed.flax.linen / .nnx)
    "LayoutMap",
    "apply_updates",
    "optax_tx",
    # checkpoints and serving
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
    # jax-tpu-embedding's layout and SparseCore input
    "CsrBatch",
    "from_jte",
    "jte_layout",
    "jte_layout_from_specs",
    "sparsecore_csr",
    "to_jte",
]
