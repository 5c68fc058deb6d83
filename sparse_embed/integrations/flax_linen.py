"""`Embed`, a linen module over `init_tables` + `lookup`.

The tables live in the "params" collection as one param, `tables`
(`{stack: EmbeddingVariables(table [rows, dim], slots {name: [rows, width]})}`),
sharded `P(axis, None)` over the plan's mesh. `jax.jit(model.init)` keeps
that sharding; to pin every param, jit init with
`out_shardings=LayoutMap(mesh, rules, plan=plan).shardings(jax.eval_shape(model.init, ...))`.

Train step (the "gradient" of `tables` is the updated tables):

    tx = sparse_embed.optax_tx(optax.adam(1e-3))     # dense leaves only
    grads = jax.grad(loss)(params, batch, labels, step)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = sparse_embed.apply_updates(params, updates)
"""

from __future__ import annotations

from typing import Mapping

import flax.linen as nn
import jax

from sparse_embed.core.batch import ShardedCooMatrix
from sparse_embed.core.planning import EmbeddingPlan
from sparse_embed.core.sharded_lookup import lookup
from sparse_embed.core.tables import init_tables


class Embed(nn.Module):
    """Looks up every feature of `plan`; owns the plan's stacked tables as the param `tables`.

    Attributes:
      plan: the `EmbeddingPlan` (static, hashable).
      with_slots: False creates no optimizer slots (eval/serving: no training).
    """

    plan: EmbeddingPlan
    with_slots: bool = True

    @nn.compact
    def __call__(
        self, batch: Mapping[str, ShardedCooMatrix], step: jax.Array | int | None = None
    ) -> dict[str, jax.Array]:
        """`batch` from `preprocess(plan, ...)`; `step`, the global step (int32 scalar) that
        schedules and bias-corrected optimizers need, passed as is to `lookup`.

        Returns `{feature: [batch_size, dim]}` (pooled) or `[batch_size, max_sequence_length, dim]`.
        """
        if self.has_variable("params", "tables"):  # given (apply): `lookup` checks them against the plan, naming
            tables = self.get_variable("params", "tables")  # the stack (trained ones, slots and all, serve eval too)
        else:
            tables = self.param("tables", lambda rng: init_tables(self.plan, rng, with_slots=self.with_slots))
        return lookup(self.plan, batch, tables, step)
