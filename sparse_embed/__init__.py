"""sparse_embed: large sharded embedding tables for JAX, trained in the backward pass.

spec -> plan -> tables -> preprocess -> lookup:

    tables = sparse_embed.init_tables(plan, rng)
    batch, stats = sparse_embed.preprocess(plan, ids)
    activations = sparse_embed.lookup(plan, batch, tables, step)
    # jax.grad(loss) w.r.t. tables returns the *updated* tables.
"""

from sparse_embed import _xla_flags

_xla_flags.ensure_cpu_flags()

from sparse_embed import distributed, optimizers  # noqa: E402
from sparse_embed.checkpoint import (  # noqa: E402
    CheckpointError,
    CheckpointInfo,
    CheckpointManager,
    Restored,
    TableRecord,
    read_info,
    restore_embeddings,
)
from sparse_embed.convert import convert_checkpoint, export_serving, load_serving  # noqa: E402
from sparse_embed.inputs import FlatIds, flatten  # noqa: E402
from sparse_embed.jte import JteTableLayout, from_jte, jte_layout, jte_layout_from_specs, to_jte  # noqa: E402
from sparse_embed.layout import LayoutMap  # noqa: E402
from sparse_embed.lookup import lookup, nonfinite_rows  # noqa: E402
from sparse_embed.optax_utils import apply_updates, optax_tx, param_labels  # noqa: E402
from sparse_embed.planning import (  # noqa: E402
    EmbeddingPlan,
    FeatureLayout,
    StackPlan,
    TablePlacement,
    grow_capacity,
    plan,
)
from sparse_embed.prefetch import Prefetched, Prefetcher, prefetch  # noqa: E402
from sparse_embed.preprocess import ShardedCooMatrix, Stats, preprocess  # noqa: E402
from sparse_embed.serving import serving_lookup  # noqa: E402
from sparse_embed.specs import FeatureSpec, TableSpec  # noqa: E402
from sparse_embed.tables import (  # noqa: E402
    EmbeddingVariables,
    init_tables,
    stack_tables,
    unstack_state,
    unstack_tables,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "JteTableLayout",
    "Restored",
    "TableRecord",
    "convert_checkpoint",
    "export_serving",
    "from_jte",
    "jte_layout",
    "jte_layout_from_specs",
    "load_serving",
    "read_info",
    "restore_embeddings",
    "serving_lookup",
    "to_jte",
    "EmbeddingPlan",
    "EmbeddingVariables",
    "FeatureLayout",
    "FeatureSpec",
    "FlatIds",
    "LayoutMap",
    "ShardedCooMatrix",
    "StackPlan",
    "Stats",
    "TablePlacement",
    "TableSpec",
    "apply_updates",
    "flatten",
    "grow_capacity",
    "init_tables",
    "lookup",
    "nonfinite_rows",
    "optax_tx",
    "optimizers",
    "distributed",
    "param_labels",
    "plan",
    "preprocess",
    "Prefetched",
    "Prefetcher",
    "prefetch",
    "stack_tables",
    "unstack_state",
    "unstack_tables",
]
