"""A stack's trainable state, `EmbeddingVariables(table, slots)`, and the check that it fits a plan."""

from __future__ import annotations

from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp

from sparse_embed.core.planning import EmbeddingPlan

SLOT_DTYPE = jnp.float32


class EmbeddingVariables(NamedTuple):
    """A stack's trainable state: `table [rows, dim]` and optimizer `slots {name: [rows, width]}`."""

    table: jax.Array
    slots: dict[str, jax.Array]


def check_state(plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables]) -> None:
    """Raises a ValueError naming the stack if `tables` do not have the plan's stacks, shapes and slots."""
    missing = sorted(set(plan.stack_names) - set(tables))
    unknown = sorted(set(tables) - set(plan.stack_names))
    if missing or unknown:
        raise ValueError(
            f"tables do not match the plan: stacks missing {missing}, unknown {unknown}; "
            f"the plan has {list(plan.stack_names)}."
        )
    for s in plan.stacks:
        v = tables[s.name]
        shape = tuple(v.table.shape)
        if shape != (s.array_rows, s.array_dim):
            raise ValueError(f"Stack {s.name!r}: table has shape {shape}, the plan expects {(s.array_rows, s.array_dim)}.")
        specs = s.slot_widths()
        if v.slots and set(v.slots) != set(specs):
            raise ValueError(
                f"Stack {s.name!r}: slots {sorted(v.slots)} do not match its {type(s.optimizer).__name__} "
                f"optimizer's {sorted(specs)}."
            )
        for name, a in v.slots.items():
            if tuple(a.shape) != (s.array_rows, specs[name]):
                raise ValueError(
                    f"Stack {s.name!r}: slot {name!r} has shape {tuple(a.shape)}, "
                    f"the plan expects {(s.array_rows, specs[name])}."
                )


def check_trainable(stack, variables: EmbeddingVariables) -> None:
    """Raises a ValueError naming the stack if its state lacks the optimizer's slots (made for inference)."""
    want = sorted(stack.optimizer.slots(stack.embedding_dim))
    if sorted(variables.slots) != want:
        raise ValueError(
            f"Stack {stack.name!r} cannot be trained: its {type(stack.optimizer).__name__} optimizer needs "
            f"slots {want} but the tables have {sorted(variables.slots)} (created with with_slots=False for "
            "inference?). Create them with slots, e.g. init_tables(plan, rng) or stack_tables(plan, arrays)."
        )
