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

or with `TrainState` (flax's, for params that hold tables):

    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    state = state.apply_gradients(grads=jax.grad(loss)(state.params, batch, labels, step))
"""

from __future__ import annotations

from typing import Mapping

import flax.linen as nn
import jax
import optax
from flax.training import train_state

from sparse_embed.core.batch import ShardedCooMatrix
from sparse_embed.core.planning import EmbeddingPlan
from sparse_embed.core.sharded_lookup import lookup
from sparse_embed.core.tables import init_tables
from sparse_embed.integrations.optax_utils import apply_updates, on_tables_mesh, optax_tx


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


class TrainState(train_state.TrainState):
    """flax's `TrainState` for params that hold tables: `tx` steps the dense params, the tables are replaced.

    `create(apply_fn=, params=, tx=)` takes the dense optimizer (e.g. `optax.adam(1e-3)`) and wraps it in
    `sparse_embed.optax_tx` (unplaced params and state, and a subclass's fields such as `batch_stats`, go to
    the tables' mesh, replicated, where a jitted step returns them); `apply_gradients(grads=)` swaps in the
    new tables that `jax.grad` returned for them (flax's own adds them to the old ones as if they were
    gradients, and fails on `optax_tx`'s updates) and applies `tx`'s updates to the rest.
    """

    def apply_gradients(self, *, grads, **kwargs) -> "TrainState":
        if isinstance(grads, Mapping) and train_state.OVERWRITE_WITH_GRADIENT in grads:
            raise NotImplementedError(f"sparse_embed's TrainState: grads with a "
                                      f"{train_state.OVERWRITE_WITH_GRADIENT!r} collection are not supported; "
                                      "step those params yourself.")
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        return self.replace(step=self.step + 1, params=apply_updates(self.params, updates), opt_state=opt_state,
                            **kwargs)

    @classmethod
    def create(cls, *, apply_fn, params, tx: optax.GradientTransformation, **kwargs) -> "TrainState":
        # unplaced params, the step count (flax's: a Python 0) and a subclass's fields (batch_stats) where a
        # jitted step's outputs will be, so that the step compiles once, not again at its second call
        params, kwargs = on_tables_mesh((params, kwargs), params)
        state = super().create(apply_fn=apply_fn, params=params, tx=optax_tx(tx), **kwargs)
        return state.replace(step=on_tables_mesh(jax.numpy.asarray(state.step), params))
