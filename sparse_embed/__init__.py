"""sparse_embed: large sharded embedding tables for JAX, trained in the backward pass.

spec -> plan -> tables -> preprocess -> lookup:

    tables = sparse_embed.init_tables(plan, rng)
    batch, stats = sparse_embed.preprocess(plan, ids)
    activations = sparse_embed.lookup(plan, batch, tables, step)
    # jax.grad(loss) w.r.t. tables returns the *updated* tables.
"""

from sparse_embed import _xla_flags

_xla_flags.ensure_cpu_flags()

from sparse_embed import optimizers  # noqa: E402
from sparse_embed.inputs import FlatIds, flatten  # noqa: E402
from sparse_embed.lookup import lookup  # noqa: E402
from sparse_embed.planning import (  # noqa: E402
    EmbeddingPlan,
    FeatureLayout,
    StackPlan,
    TablePlacement,
    grow_capacity,
    plan,
)
from sparse_embed.preprocess import ShardedCooMatrix, Stats, preprocess  # noqa: E402
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
    "EmbeddingPlan",
    "EmbeddingVariables",
    "FeatureLayout",
    "FeatureSpec",
    "FlatIds",
    "ShardedCooMatrix",
    "StackPlan",
    "Stats",
    "TablePlacement",
    "TableSpec",
    "flatten",
    "grow_capacity",
    "init_tables",
    "lookup",
    "optimizers",
    "plan",
    "preprocess",
    "stack_tables",
    "unstack_state",
    "unstack_tables",
]
