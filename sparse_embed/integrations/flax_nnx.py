"""`Embed`, an nnx module over `init_tables` + `lookup`, and the `Optimizer` that trains it.

The tables live in `EmbeddingTable` variables (slots in `EmbeddingSlot`, a
subclass), at `tables/{stack}/table` and `tables/{stack}/slots/{name}`,
sharded `P(axis, None)` (their `out_sharding`/`mesh` metadata says so, for
`nnx.get_named_sharding`). `EmbeddingTable` is an `nnx.Param`, so
`nnx.grad(loss)(model)` (wrt `nnx.Param` by default) runs the lookup's
backward and returns the *updated* tables as their "gradient". Filter them
with `EmbeddingTable`, and dense params with `DENSE`.

Train step:

    optimizer = sparse_embed.flax.nnx.Optimizer(model, optax.adam(1e-3))

    @nnx.jit(donate_argnums=(0, 1))
    def train_step(model, optimizer, batch, labels, step):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch, labels, step)
        optimizer.update(model, grads)   # adam on DENSE; embedding state replaced
        return loss

Do not use a plain `nnx.Optimizer(model, tx, wrt=nnx.Param)`: it would feed
the new tables to `tx` as gradients and keep optimizer state of table size.

Raw-id (dynamic) tables: map the batch's ids to rows first, in the same step,
with `batch, id_maps, id_stats = model.embed.map_ids(batch, id_maps, step)`
(docs/raw_ids.md); the new ids' rows are initialised in the module's tables.

Checkpoints: save `model.embed.embedding_variables()` as the tables and
`nnx.state(model, nnx.Not(EmbeddingTable))` as the user pytree; restore
with `model.embed.set_embedding_variables(restored.tables)` and
`nnx.update(model, restored.user)` (docs/checkpoints.md).
"""

from __future__ import annotations

from typing import Mapping

import flax.nnx as nnx
import jax
import optax

from sparse_embed.core.batch import ShardedCooMatrix
from sparse_embed.core.id_maps import IdMap, IdMapStats, map_ids
from sparse_embed.core.planning import EmbeddingPlan
from sparse_embed.core.sharded_lookup import lookup
from sparse_embed.core.state import EmbeddingVariables, check_state
from sparse_embed.core.tables import init_tables
from sparse_embed.integrations.optax_utils import replicate_unplaced, tables_mesh


class EmbeddingTable(nnx.Param):
    """A stacked table `[rows, dim]`; trained by the lookup's backward, never by optax."""


class EmbeddingSlot(EmbeddingTable):
    """An optimizer slot of a stacked table, `[rows, width]`."""


DENSE = nnx.All(nnx.Param, nnx.Not(EmbeddingTable))
"""Filter: the params an optax transformation should see (all but embedding state)."""


class Embed(nnx.Module):
    """Looks up every feature of `plan`; owns the plan's stacked tables.

    `Embed(plan, rngs=rngs)` draws the init key from `rngs.params()`;
    `with_slots=False` creates no optimizer slots (eval/serving).
    """

    def __init__(self, plan: EmbeddingPlan, *, rngs: nnx.Rngs, with_slots: bool = True):
        self.plan = plan
        meta = dict(out_sharding=(plan.axis_name,), mesh=plan.mesh)
        # Plain dicts (nnx.data), not nnx.Dict: stack and slot names would shadow nnx.Dict's methods.
        self.tables = nnx.data({
            name: {"table": EmbeddingTable(v.table, **meta),
                   "slots": {k: EmbeddingSlot(a, **meta) for k, a in v.slots.items()}}
            for name, v in init_tables(plan, rngs.params(), with_slots=with_slots).items()
        })

    def embedding_variables(self) -> dict[str, EmbeddingVariables]:
        """The current values, `{stack: EmbeddingVariables}`, as `lookup` and `unstack_state` take them."""
        return {
            name: EmbeddingVariables(d["table"].get_value(), {k: s.get_value() for k, s in d["slots"].items()})
            for name, d in self.tables.items()
        }

    def __call__(
        self, batch: Mapping[str, ShardedCooMatrix], step: jax.Array | int | None = None
    ) -> dict[str, jax.Array]:
        """`batch` from `preprocess(plan, ...)`; `step`, the global step (int32 scalar) that
        schedules and bias-corrected optimizers need, passed as is to `lookup`.

        Returns `{feature: [batch_size, dim]}` (pooled) or `[batch_size, max_sequence_length, dim]`.
        """
        return lookup(self.plan, batch, self.embedding_variables(), step)

    def map_ids(
        self, batch: Mapping[str, ShardedCooMatrix], id_maps: Mapping[str, IdMap], step: jax.Array | int, *,
        train: bool = True,
    ) -> tuple[dict[str, ShardedCooMatrix], dict[str, IdMap], dict[str, IdMapStats]]:
        """`sparse_embed.map_ids` on this module's tables: `(batch, id_maps, {stack: IdMapStats})`.

        Call it before the module, in the same step, with the maps from
        `init_id_maps(plan, rng)`; keep the `id_maps` it returns. In
        training, the rows of newly admitted ids (and their slots) are
        initialised in the module's variables; `train=False` changes nothing.
        """
        batch, tables, id_maps, stats = map_ids(self.plan, batch, self.embedding_variables(), id_maps, step,
                                                train=train)
        self._set(tables)  # map_ids checked them against the plan
        return batch, id_maps, stats

    def set_embedding_variables(self, tables: Mapping[str, EmbeddingVariables]) -> None:
        """Sets the module's tables and slots to `tables` (`{stack: EmbeddingVariables}`, e.g. the `tables` of
        `CheckpointManager.restore(plan)`), which must fit the plan (a ValueError naming the stack otherwise).

        A module made with `with_slots=False` (eval) takes the tables and leaves their slots out; a module that
        trains needs them.
        """
        check_state(self.plan, tables)
        for name, v in tables.items():
            held = self.tables[name]
            if held["slots"] and not v.slots:
                raise ValueError(f"Stack {name!r}: the module trains, so it needs the optimizer's slots "
                                 f"{sorted(held['slots'])}, and these tables have none (made for inference?).")
        self._set(tables)

    def _set(self, tables: Mapping[str, EmbeddingVariables]) -> None:
        """The values of `tables` into the module's variables, unchecked (a module for eval takes no slots)."""
        for name, v in tables.items():
            held = self.tables[name]
            held["table"].set_value(v.table)
            for k, a in (v.slots if held["slots"] else {}).items():
                held["slots"][k].set_value(a)


def _check_whole_stacks(model: nnx.Module, wrt) -> None:
    """Refuses a `wrt` that selects part of a stack's state (its table without all its slots, or slots without the
    table): the lookup's backward updates them together, and the part left out would stay as it was, silently (an
    Adagrad table trained with its accumulator never growing)."""
    picked = set(nnx.state(model, wrt).flat_state().paths)
    stacks: dict[tuple, list[tuple]] = {}
    for path, var in nnx.state(model, EmbeddingTable).flat_state():
        stacks.setdefault(path[:-2] if isinstance(var, EmbeddingSlot) else path[:-1], []).append(path)
    for stack, paths in stacks.items():
        left = [p for p in paths if p not in picked]
        if 0 < len(left) < len(paths):
            name = "/".join(map(str, stack))
            raise ValueError(
                f"Optimizer: wrt selects part of the embedding state of stack {name!r}, leaving out "
                f"{['/'.join(map(str, p[len(stack):])) for p in left]}: the lookup's backward updates a table and "
                "its optimizer slots together. Select all of them (sparse_embed.flax.nnx.EmbeddingTable covers the "
                "slots) or none (sparse_embed.flax.nnx.DENSE)."
            )


class Optimizer(nnx.Optimizer):
    """`nnx.Optimizer` for models with `Embed`: `tx` on the dense params, embedding state replaced.

    `wrt` (default `nnx.Param`) is the filter given to `nnx.grad`; `tx`
    and its state cover `wrt` minus `EmbeddingTable`. `update(model, grads)`
    sets every `EmbeddingTable` that `wrt` selects to its "gradient" (the
    updated state, bit for bit, no pass over the tables) and applies `tx` to
    the rest; tables `wrt` leaves out (e.g. `wrt=DENSE`) stay frozen. `wrt`
    takes a stack's table and slots together or not at all (a ValueError
    naming the stack otherwise). Give `nnx.grad` that `wrt`, not
    `optimizer.wrt` (flax's attribute: here the dense part only, what `tx`
    steps, so the tables would get no new state).
    """

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, *, wrt=nnx.Param):
        # the model's unplaced state (eagerly made dense params) and this one's (the step count, adam's moments)
        # go where a jitted step returns them, replicated on the tables' mesh: the step then compiles once
        mesh = tables_mesh(nnx.state(model, EmbeddingTable))
        nnx.update(model, replicate_unplaced(nnx.state(model, nnx.Not(EmbeddingTable)), mesh))
        super().__init__(model, tx, wrt=nnx.All(wrt, nnx.Not(EmbeddingTable)))
        nnx.update(self, replicate_unplaced(nnx.state(self), mesh))
        self.embedding_wrt = nnx.All(wrt, EmbeddingTable)  # the embedding state it trains
        _check_whole_stacks(model, self.embedding_wrt)

    def update(self, model: nnx.Module, grads: nnx.State, /, **kwargs) -> optax.Updates:
        want = nnx.state(model, self.embedding_wrt).flat_state().paths
        new = nnx.state(grads, EmbeddingTable)
        if new.flat_state().paths != want:
            raise ValueError(
                f"Optimizer.update: grads hold embedding state {list(new.flat_state().paths)} but the optimizer's "
                f"wrt selects {list(want)} of the model; take nnx.grad with the wrt given to the optimizer "
                "(default nnx.Param, which includes EmbeddingTable, so the lookup's backward returns the updated "
                "tables; sparse_embed.flax.nnx.DENSE freezes them), not with `optimizer.wrt`: that is its dense "
                "part, the params tx steps."
            )
        nnx.update(model, new)
        return super().update(model, grads, **kwargs)
