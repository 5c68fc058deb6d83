"""A stack's trainable state, `EmbeddingVariables(table, slots)`, and the checks that it fits a plan and is
looked up once per differentiated function."""

from __future__ import annotations

import weakref
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparse_embed.core.planning import EmbeddingPlan

SLOT_DTYPE = jnp.float32

try:  # jax.grad traces with LinearizeTracer, which jax (0.10) does not export; test_lookup fails if this misses it
    from jax._src.interpreters.ad import JVPTracer, LinearizeTracer

    AD_TRACERS: tuple[type, ...] = (JVPTracer, LinearizeTracer)
except ImportError:  # another jax: its public JVP tracer
    from jax.interpreters.ad import JVPTracer

    AD_TRACERS = (JVPTracer,)
# id(tracer) -> weakref, for every differentiated table array looked up in a trace still alive
_looked_up: dict[int, weakref.ref] = {}


class EmbeddingVariables(NamedTuple):
    """A stack's trainable state: `table [rows, dim]` and optimizer `slots {name: [rows, width]}`."""

    table: jax.Array
    slots: dict[str, jax.Array]


def check_state(plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables]) -> None:
    """Raises a ValueError naming the stack if `tables` do not have the plan's stacks, shapes, dtypes and slots."""
    if not isinstance(tables, Mapping):
        raise TypeError(f"tables must be the {{stack: EmbeddingVariables}} mapping that init_tables (or stack_tables) "
                        f"makes, got {type(tables).__name__}.")
    missing = sorted(set(plan.stack_names) - set(tables))
    unknown = sorted(set(tables) - set(plan.stack_names))
    if missing or unknown:
        raise ValueError(
            f"tables do not match the plan: stacks missing {missing}, unknown {unknown}; "
            f"the plan has {list(plan.stack_names)}."
        )
    for s in plan.stacks:
        v = tables[s.name]
        if not isinstance(v, EmbeddingVariables):
            raise TypeError(f"Stack {s.name!r}: expected the EmbeddingVariables init_tables (or stack_tables) made, "
                            f"got {type(v).__name__}.")
        shape = tuple(v.table.shape)
        if shape != (s.array_rows, s.array_dim):
            raise ValueError(f"Stack {s.name!r}: table has shape {shape}, the plan expects {(s.array_rows, s.array_dim)}.")
        if jnp.dtype(v.table.dtype) != jnp.dtype(s.dtype):  # (bf16 tables on a f32 plan would train in bf16)
            raise ValueError(f"Stack {s.name!r}: table has dtype {jnp.dtype(v.table.dtype)}, the plan's TableSpec says "
                             f"{jnp.dtype(s.dtype)}; build the tables with the plan (init_tables, stack_tables), or "
                             "set TableSpec(dtype=...).")
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
            if jnp.dtype(a.dtype) != jnp.dtype(SLOT_DTYPE):  # (native failed naming nothing; generic did bf16 math)
                raise ValueError(f"Stack {s.name!r}: slot {name!r} has dtype {jnp.dtype(a.dtype)}, optimizer slots "
                                 f"are {jnp.dtype(SLOT_DTYPE)}; build the tables with the plan (init_tables, "
                                 "stack_tables).")


def check_trainable(stack, variables: EmbeddingVariables) -> None:
    """Raises a ValueError naming the stack if its state lacks the optimizer's slots (made for inference)."""
    want = sorted(stack.optimizer.slots(stack.embedding_dim))
    if sorted(variables.slots) != want:
        raise ValueError(
            f"Stack {stack.name!r} cannot be trained: its {type(stack.optimizer).__name__} optimizer needs "
            f"slots {want} but the tables have {sorted(variables.slots)} (created with with_slots=False for "
            "inference?). Create them with slots, e.g. init_tables(plan, rng) or stack_tables(plan, arrays)."
        )


def check_once_per_trace(plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables]) -> None:
    """Raises when a differentiated table array reaches `lookup` a second time in one trace.

    Its "gradient" is the updated state, and `jax.grad` adds the cotangents of
    every use: two lookups would return every row doubled. A table array that
    is not being differentiated (a jit forward, an eval step) may be looked up
    any number of times.
    """
    for name, state in tables.items():
        for leaf in jax.tree.leaves(state):
            if not isinstance(leaf, AD_TRACERS):
                continue
            key, ref = id(leaf), _looked_up.get(id(leaf))
            if ref is not None and ref() is leaf:
                feats = sorted(lay.feature.name for lay in plan.stack(name).features)
                raise ValueError(
                    f"Stack {name!r} (features {feats}) is looked up a second time in one differentiated function. "
                    "The gradient lookup returns for the tables is their updated state, so jax.grad would add the "
                    "two updated states and double every row. Put every feature in one batch and call lookup once "
                    "per loss; for a lookup that must not train the tables, pass jax.lax.stop_gradient(tables).")
            _looked_up[key] = weakref.ref(leaf, lambda r, key=key: _looked_up.pop(key) if _looked_up.get(key) is r
                                          else None)


def checked_step(step: Any, what: str) -> jax.Array:
    """The global step as an integer scalar array; TypeError for another dtype or shape (a float or bool step
    would silently feed the schedules, bias corrections and id maps another count), ValueError for a negative
    host one (Adam's bias correction at step -1 is 0 / 0). A device array's value is not read: that would wait for
    it on every step."""
    a = jnp.asarray(step)
    if a.shape != () or not jnp.issubdtype(a.dtype, jnp.integer):
        raise TypeError(f"{what}: step must be an integer scalar (the global step), got {a.dtype} of shape {a.shape}.")
    if isinstance(step, (int, np.integer, np.ndarray)) and int(step) < 0:
        raise ValueError(f"{what}: step must be >= 0, got {int(step)}.")
    return a
