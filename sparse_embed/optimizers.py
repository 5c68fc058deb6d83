"""Embedded optimizers: applied by the lookup's backward to touched rows only.

An optimizer here is a small frozen spec (hashable, so it can sit in the
jit-static plan) with two pure pieces:

- `slots(dim)`: name -> `SlotSpec(width, init)`, the per-row state it keeps
  (`[rows, width]`, same row layout and sharding as the table);
- `update(rows, slots, grads, lr)`: the row update on the `[U, dim]` rows
  that the step touched, where `grads[u]` is row u's gradient summed over all
  its occurrences in the step. Returns `(rows', slots')`.

The learning rate is a float or an optax schedule (a callable of the global
step), evaluated on device at the step passed to `lookup`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Union

import jax
import jax.numpy as jnp

Schedule = Callable[[jax.Array], jax.Array]
LearningRate = Union[float, Schedule]
Slots = dict[str, jax.Array]


class SlotSpec(NamedTuple):
    """A per-row optimizer state: `[rows, width]` filled with `init`."""

    width: int
    init: float


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """Base class of embedded optimizer specs."""

    learning_rate: LearningRate

    def __post_init__(self):
        lr = self.learning_rate
        if not callable(lr):
            if isinstance(lr, bool) or not isinstance(lr, (int, float)):
                raise TypeError(
                    f"{type(self).__name__}: learning_rate must be a float or an optax schedule, got {lr!r}."
                )
            object.__setattr__(self, "learning_rate", float(lr))

    @property
    def needs_step(self) -> bool:
        """True if the update depends on the global step (schedules)."""
        return callable(self.learning_rate)

    def learning_rate_at(self, step: jax.Array | None) -> jax.Array:
        if callable(self.learning_rate):
            if step is None:
                raise ValueError(
                    f"{type(self).__name__} has a learning-rate schedule: pass the global step, "
                    "lookup(plan, batch, tables, step)."
                )
            return jnp.asarray(self.learning_rate(step), jnp.float32)
        return jnp.asarray(self.learning_rate, jnp.float32)

    def slots(self, dim: int) -> dict[str, SlotSpec]:
        return {}

    def update(self, rows: jax.Array, slots: Slots, grads: jax.Array, lr: jax.Array) -> tuple[jax.Array, Slots]:
        raise NotImplementedError

    def linear_delta(self, grads: jax.Array, lr: jax.Array) -> jax.Array | None:
        """If the update is `rows + delta(g)` with delta linear in g and no slots, that delta.

        Such an update can be scatter-added per occurrence, which skips
        combining duplicate ids first. None (the default) means it cannot.
        """
        return None


@dataclasses.dataclass(frozen=True)
class SGD(Optimizer):
    """`w -= lr * g`. No slots."""

    def update(self, rows, slots, grads, lr):
        return rows - lr * grads, slots

    def linear_delta(self, grads, lr):
        return -lr * grads


@dataclasses.dataclass(frozen=True)
class Adagrad(Optimizer):
    """`acc += g*g; w -= lr * g / sqrt(acc)` (accumulator first, no epsilon).

    Slots: `accumulator` `[rows, dim]`, initialised to
    `initial_accumulator_value` (must be > 0, so the division is defined).
    """

    initial_accumulator_value: float = 0.1

    def __post_init__(self):
        super().__post_init__()
        if not float(self.initial_accumulator_value) > 0:
            raise ValueError(
                f"Adagrad: initial_accumulator_value must be > 0, got {self.initial_accumulator_value!r}."
            )
        object.__setattr__(self, "initial_accumulator_value", float(self.initial_accumulator_value))

    def slots(self, dim):
        return {"accumulator": SlotSpec(dim, self.initial_accumulator_value)}

    def update(self, rows, slots, grads, lr):
        acc = slots["accumulator"] + grads * grads
        return rows - lr * grads * jax.lax.rsqrt(acc), {"accumulator": acc}


DEFAULT: Optimizer = SGD(learning_rate=0.01)

__all__ = ["Optimizer", "SlotSpec", "SGD", "Adagrad", "DEFAULT"]
del Any
