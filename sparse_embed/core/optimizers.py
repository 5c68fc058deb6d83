"""Embedded optimizers: applied by the lookup's backward to touched rows only.

An optimizer is a small frozen spec (hashable, so it can sit in the
jit-static plan) with two pure pieces:

- `slots(dim)`: `{name: SlotSpec(width, init)}`, the per-row state it keeps
  (`[rows, width]`, same row layout and sharding as the table);
- `rule(rows, slots, grads, step, lr, row_mean)`: its math on the
  `[U, dim]` rows the step touched, where `grads[u]` is row u's gradient
  summed over all its occurrences in the step. Returns `(rows', slots')`.
  A rule that needs a statistic of a whole row takes it from `row_mean`,
  so a row whose columns live on several devices updates as one.

It also declares, once, how a native kernel encodes it: `native()` returns
a `NativeEncoding` (its case in the kernel, its constants and its slots in
the order the case reads them), or None when it runs on the generic kernel
only. So adding an optimizer means its rule, plus a native case only if it
wants one (an entry in `_native_cpu.cc`'s `SPARSE_EMBED_OPTIMIZERS` and its
case in `update_row`); tests/core/test_native_encoding.py fails when a
built-in optimizer declares neither, or a case the C++ code lacks.

`update(rows, slots, grads, step)` wraps `rule` with the options every
optimizer has, in this order:

1. `clip_gradient=(lo, hi)`: `g = clip(g, lo, hi)` (value clipping);
2. `lr = learning_rate(step)` if it is an optax schedule, else the float;
3. `rows', slots' = rule(...)`;
4. `weight_decay=wd`: decoupled, `rows' -= lr * wd * rows` (touched rows only);
5. `clip_weight=(lo, hi)`: `rows' = clip(rows', lo, hi)`.

Slot names and math match jax-tpu-embedding, so tables and slots convert
both ways. `step` is the global step passed to `lookup` (0 for the first
step); optimizers with bias correction require it.

| optimizer | slots `[rows, width]` | update (g: summed row gradient, t: step) |
|---|---|---|
| `SGD` | none | `w -= lr*g` |
| `Adagrad` | `accumulator [dim]` | `acc += g²; w -= lr*g/√acc` |
| `RowwiseAdagrad` | `accumulator [1]` | `acc += mean(g²); w -= lr*g/(√acc + eps)` |
| `Adam` (lazy) | `momentum [dim]`, `velocity [dim]` | `m += (1-b1)(g-m); v += (1-b2)(g²-v); w -= α_t·m/(√v + ε_t)`, `α_t = lr·√(1-b2^(t+1))/(1-b1^(t+1))`, `ε_t = eps·√(1-b2^(t+1))` |
| `AdagradMomentum` | `accumulator [dim]`, `momentum [dim]` | `acc = acc+g²` (β2=1) or `β2·acc+(1-β2)g²`; `p = (acc+eps)^(-1/exponent)`; `m = μ·m + p·g`; `w -= lr·(μ·m + p·g if nesterov else m)` |
| `FTRL` | `accumulator [dim]`, `linear [dim]` | FTRL-Proximal as TF's `tf.tpu.experimental.embedding.FTRL` (see `FTRL`) |
| `LaProp` | `mu [dim]`, `nu [dim]` | `d = b2(1-b2^t)/(1-b2^(t+1)); nu = d·nu + (1-d)(g²+eps); mu = b1·mu + √(1-b1²)·g/√nu; w -= lr·mu` |
| `Custom` | yours | `fn(rows, slots, grads, step)` |
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Callable, Mapping, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np

Schedule = Callable[[jax.Array], jax.Array]
LearningRate = Union[float, Schedule]
Slots = dict[str, jax.Array]
Range = tuple[float, float]
RowMean = Callable[[jax.Array], jax.Array]  # [U, dim] -> [U, 1]: the mean over each whole row


def _local_mean(x: jax.Array) -> jax.Array:
    return jnp.mean(x, axis=-1, keepdims=True)


class SlotSpec(NamedTuple):
    """A per-row optimizer state: `[rows, width]` filled with `init`."""

    width: int
    init: float


def _check_learning_rate(name: str, lr) -> LearningRate:
    if callable(lr):
        return lr
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real):  # numpy's scalars too (np.float32 is no float)
        raise TypeError(f"{name}: learning_rate must be a float or an optax schedule, got {lr!r}.")
    if not 0 <= float(lr) < np.inf:  # a NaN or infinite rate trained every touched row into NaN, silently
        raise ValueError(f"{name}: learning_rate must be finite and >= 0, got {lr!r}.")
    return float(lr)


def _check_range(name: str, what: str, r) -> Range | None:
    if r is None:
        return None
    try:
        lo, hi = (float(x) for x in r)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: {what} must be a (min, max) pair, got {r!r}.") from None
    if not lo <= hi:
        raise ValueError(f"{name}: {what} needs min <= max, got {r!r}.")
    return (lo, hi)


@dataclasses.dataclass(frozen=True)
class NativeEncoding:
    """How a native kernel encodes an optimizer: what `Optimizer.native()` returns (see the module docstring).

    The options every optimizer has (clip_gradient, weight_decay, clip_weight) are encoded by the kernel
    itself; this is what is the optimizer's own.

    Attributes:
      case: the name of its case in the native kernel (`optimizers()` of `core/kernels/_native_cpu.cc`).
      hyper: its constants, in the order the case reads them (`h[0]`, `h[1]`, ...), as float32.
      slots: its slot names in the order the case reads them (`s0`, `s1`).
      step_factors: `(step, lr) -> (f1, ...)`, the factors that depend on the step, which the case reads
        after the learning rate (`scalars[1:]`); None: the learning rate only.
    """

    case: str
    hyper: tuple[float, ...] = ()
    slots: tuple[str, ...] = ()
    step_factors: Callable[[jax.Array | None, jax.Array], tuple[jax.Array, ...]] | None = None


def _require_step(name: str, step):
    if step is None:
        raise ValueError(f"{name} needs the global step for bias correction: pass lookup(plan, batch, tables, step).")
    return jnp.asarray(step, jnp.float32)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """Base class: the options every optimizer has (keyword-only)."""

    clip_gradient: Range | None = dataclasses.field(default=None, kw_only=True)
    clip_weight: Range | None = dataclasses.field(default=None, kw_only=True)
    weight_decay: float = dataclasses.field(default=0.0, kw_only=True)

    def __post_init__(self):
        name = type(self).__name__
        set_ = lambda k, v: object.__setattr__(self, k, v)
        set_("learning_rate", _check_learning_rate(name, self.learning_rate))
        set_("clip_gradient", _check_range(name, "clip_gradient", self.clip_gradient))
        set_("clip_weight", _check_range(name, "clip_weight", self.clip_weight))
        self._non_negative(weight_decay=self.weight_decay)
        self._check()

    def _check(self) -> None:
        """Validates the optimizer's own hyperparameters."""

    def _positive(self, **values) -> None:
        for k, v in values.items():
            if isinstance(v, bool) or not 0 < float(v) < np.inf:
                raise ValueError(f"{type(self).__name__}: {k} must be finite and > 0, got {v!r}.")
            object.__setattr__(self, k, float(v))

    def _non_negative(self, **values) -> None:
        for k, v in values.items():
            if isinstance(v, bool) or not 0 <= float(v) < np.inf:
                raise ValueError(f"{type(self).__name__}: {k} must be finite and >= 0, got {v!r}.")
            object.__setattr__(self, k, float(v))

    def _decay_rates(self, *names: str) -> None:
        for k in names:
            v = getattr(self, k)
            if isinstance(v, bool) or not 0 <= float(v) < 1:
                raise ValueError(f"{type(self).__name__}: {k} must be in [0, 1), got {v!r}.")
            object.__setattr__(self, k, float(v))

    def learning_rate_at(self, step: jax.Array | None) -> jax.Array:
        """The learning rate at `step` (schedules need a step)."""
        lr = self.learning_rate
        if callable(lr):
            if step is None:
                raise ValueError(
                    f"{type(self).__name__} has a learning-rate schedule: pass the global step, "
                    "lookup(plan, batch, tables, step)."
                )
            return jnp.asarray(lr(step), jnp.float32)
        return jnp.asarray(lr, jnp.float32)

    def slots(self, dim: int) -> dict[str, SlotSpec]:
        return {}

    def native(self) -> NativeEncoding | None:
        """How a native kernel encodes this optimizer, or None: it runs on the generic kernel only.

        Each optimizer class declares its own (`native_encoding` reads it only from the object's own class: a
        subclass may change the rule, so it does not inherit its parent's case).
        """
        return None

    def rule(self, rows: jax.Array, slots: Slots, grads: jax.Array, step, lr: jax.Array,
             row_mean: RowMean) -> tuple[jax.Array, Slots]:
        raise NotImplementedError

    def update(self, rows: jax.Array, slots: Slots, grads: jax.Array, step,
               row_mean: RowMean | None = None, lr: jax.Array | None = None) -> tuple[jax.Array, Slots]:
        """The full row update: `rows [U, dim]`, `slots {name: [U, width]}`, summed `grads [U, dim]`.

        `row_mean(x [U, dim]) -> [U, 1]`: the mean over each whole row (default: over the last axis; a
        "column" kernel's also sums over the devices that hold the row's other columns). `lr`: the
        learning rate at `step`, if the caller has it (default `learning_rate_at(step)`).
        """
        if self.clip_gradient is not None:
            grads = jnp.clip(grads, *self.clip_gradient)
        lr = self.learning_rate_at(step) if lr is None else lr
        new_rows, new_slots = self.rule(rows, slots, grads, step, lr, row_mean or _local_mean)
        if self.weight_decay:
            new_rows = new_rows - lr * self.weight_decay * rows
        if self.clip_weight is not None:
            new_rows = jnp.clip(new_rows, *self.clip_weight)
        return new_rows, new_slots

    @property
    def elementwise(self) -> bool:
        """True if each element of a row updates from its own gradient and slot elements only."""
        return True

    @property
    def splits_columns(self) -> bool:
        """True if the rule reads across a row only through `row_mean`.

        Then a row's columns can live on different devices ("column"
        placement) and the kernel sums the mean's partial sums across them;
        otherwise ("Custom") it gathers each touched row whole for the rule.
        """
        return True

    @property
    def is_linear(self) -> bool:
        """True if the update is `rows + linear_delta(g)`, linear in g, with no slots.

        Such an update can be scatter-added per occurrence, which skips
        combining duplicate ids first.
        """
        return False

    def linear_delta(self, grads: jax.Array, step) -> jax.Array:
        raise NotImplementedError(f"{type(self).__name__} has no linear update.")


@dataclasses.dataclass(frozen=True)
class SGD(Optimizer):
    """`w -= lr * g`. No slots."""

    learning_rate: LearningRate = 0.01

    def native(self):
        return NativeEncoding("sgd")

    def rule(self, rows, slots, grads, step, lr, row_mean):
        return rows - lr * grads, slots

    @property
    def is_linear(self):
        return self.clip_gradient is None and self.clip_weight is None and not self.weight_decay

    def linear_delta(self, grads, step):
        return -self.learning_rate_at(step) * grads


@dataclasses.dataclass(frozen=True)
class Adagrad(Optimizer):
    """`acc += g²; w -= lr * g / sqrt(acc)` (accumulator first, no epsilon). Slot `accumulator [dim]`."""

    learning_rate: LearningRate = 0.01
    initial_accumulator_value: float = 0.1

    def _check(self):
        self._positive(initial_accumulator_value=self.initial_accumulator_value)

    def slots(self, dim):
        return {"accumulator": SlotSpec(dim, self.initial_accumulator_value)}

    def native(self):
        return NativeEncoding("adagrad", slots=("accumulator",))

    def rule(self, rows, slots, grads, step, lr, row_mean):
        acc = slots["accumulator"] + grads * grads
        return rows - lr * grads * jax.lax.rsqrt(acc), {"accumulator": acc}


@dataclasses.dataclass(frozen=True)
class RowwiseAdagrad(Optimizer):
    """One accumulator per row: `acc += mean(g²); w -= lr * g / (sqrt(acc) + eps)`. Slot `accumulator [1]`.

    The memory-saving default of DLRM-style training (FBGEMM's exact row-wise Adagrad).
    """

    learning_rate: LearningRate = 0.01
    initial_accumulator_value: float = 0.1
    epsilon: float = 1e-8

    def _check(self):
        self._positive(initial_accumulator_value=self.initial_accumulator_value)
        self._non_negative(epsilon=self.epsilon)

    def slots(self, dim):
        return {"accumulator": SlotSpec(1, self.initial_accumulator_value)}

    def native(self):
        return NativeEncoding("rowwise_adagrad", (self.epsilon,), ("accumulator",))

    @property
    def elementwise(self) -> bool:
        return False  # the accumulator averages over the whole row

    def rule(self, rows, slots, grads, step, lr, row_mean):
        acc = slots["accumulator"] + row_mean(grads * grads)
        # One division per row, not per element (the native kernel's order too): a division costs several multiplies.
        return rows - grads * (lr / (jnp.sqrt(acc) + self.epsilon)), {"accumulator": acc}


@dataclasses.dataclass(frozen=True)
class Adam(Optimizer):
    """Lazy Adam (touched rows only), bias-corrected at the global step. Slots `momentum`, `velocity` `[dim]`."""

    learning_rate: LearningRate = 0.001
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def _check(self):
        self._decay_rates("b1", "b2")
        self._positive(eps=self.eps)

    def slots(self, dim):
        return {"momentum": SlotSpec(dim, 0.0), "velocity": SlotSpec(dim, 0.0)}

    def native(self):
        return NativeEncoding("adam", (1.0 - self.b1, 1.0 - self.b2), ("momentum", "velocity"),
                              self.bias_corrected)

    def bias_corrected(self, step, lr) -> tuple[jax.Array, jax.Array]:
        """`(alpha_t, eps_t)`: the step size and epsilon with the bias correction of step t folded in."""
        t1 = _require_step("Adam", step) + 1.0
        c2 = jnp.sqrt(1.0 - self.b2**t1)
        return lr * c2 / (1.0 - self.b1**t1), self.eps * c2

    def rule(self, rows, slots, grads, step, lr, row_mean):
        alpha, eps_hat = self.bias_corrected(step, lr)
        m = slots["momentum"] + (1.0 - self.b1) * (grads - slots["momentum"])
        v = slots["velocity"] + (1.0 - self.b2) * (grads * grads - slots["velocity"])
        return rows - alpha * m / (jnp.sqrt(v) + eps_hat), {"momentum": m, "velocity": v}


@dataclasses.dataclass(frozen=True)
class AdagradMomentum(Optimizer):
    """Adagrad with (Nesterov) momentum. Slots `accumulator`, `momentum` `[dim]`."""

    learning_rate: LearningRate = 0.01
    momentum: float = 0.9
    beta2: float = 1.0
    epsilon: float = 1e-10
    exponent: float = 2.0
    use_nesterov: bool = False
    initial_accumulator_value: float = 0.1

    def _check(self):
        if not 0 < float(self.beta2) <= 1:
            raise ValueError(f"AdagradMomentum: beta2 must be in (0, 1], got {self.beta2!r}.")
        if float(self.beta2) < 1 and not float(self.epsilon) > 0:  # (acc + eps)^(-1/exponent): inf, a NaN row
            raise ValueError(f"AdagradMomentum: with beta2 < 1 the accumulator decays towards 0, so epsilon must be "
                             f"finite and > 0, got {self.epsilon!r}.")
        self._positive(exponent=self.exponent)
        self._non_negative(momentum=self.momentum)
        if not 0 < float(self.initial_accumulator_value) + float(self.epsilon) < np.inf:
            raise ValueError("AdagradMomentum: initial_accumulator_value + epsilon must be finite and > 0.")
        object.__setattr__(self, "use_nesterov", bool(self.use_nesterov))

    def slots(self, dim):
        return {"accumulator": SlotSpec(dim, self.initial_accumulator_value), "momentum": SlotSpec(dim, 0.0)}

    def native(self):
        hyper = (self.momentum, self.beta2, 1.0 - self.beta2, self.epsilon, -1.0 / self.exponent,
                 float(self.use_nesterov))
        return NativeEncoding("adagrad_momentum", hyper, ("accumulator", "momentum"))

    def rule(self, rows, slots, grads, step, lr, row_mean):
        g2 = grads * grads
        acc = slots["accumulator"]
        acc = acc + g2 if self.beta2 == 1.0 else self.beta2 * acc + (1.0 - self.beta2) * g2
        p = (acc + self.epsilon) ** (-1.0 / self.exponent)
        m = self.momentum * slots["momentum"] + p * grads
        step_dir = self.momentum * m + p * grads if self.use_nesterov else m
        return rows - lr * step_dir, {"accumulator": acc, "momentum": m}


@dataclasses.dataclass(frozen=True)
class FTRL(Optimizer):
    """FTRL-Proximal, as TF's `tf.tpu.experimental.embedding.FTRL`. Slots `accumulator`, `linear` `[dim]`.

    With `k = -learning_rate_power`, `acc' = acc + g²`, `Δp = acc'^k - acc^k`:

    - `linear += g - Δp/lr * w` (or `linear += lr*g - Δp*w` with `multiply_linear_by_learning_rate`);
    - `w = (clip(linear, -l1s, l1s) - linear) / denom` (`-linear/denom` when l1 = 0), with
      `l1s = l1` (or `lr*l1`) and `denom = (acc'^k + beta)/lr + 2*l2` (or `acc'^k + beta + 2*lr*l2`).
    """

    learning_rate: LearningRate = 0.01
    learning_rate_power: float = -0.5
    l1: float = 0.0
    l2: float = 0.0
    beta: float = 0.0
    initial_accumulator_value: float = 0.1
    multiply_linear_by_learning_rate: bool = False

    def _check(self):
        if not float(self.learning_rate_power) <= 0:
            raise ValueError(f"FTRL: learning_rate_power must be <= 0, got {self.learning_rate_power!r}.")
        self._non_negative(l1=self.l1, l2=self.l2, beta=self.beta)
        self._positive(initial_accumulator_value=self.initial_accumulator_value)
        object.__setattr__(self, "multiply_linear_by_learning_rate", bool(self.multiply_linear_by_learning_rate))

    def slots(self, dim):
        return {"accumulator": SlotSpec(dim, self.initial_accumulator_value), "linear": SlotSpec(dim, 0.0)}

    def native(self):
        hyper = (-self.learning_rate_power, self.l1, self.l2, self.beta, float(self.multiply_linear_by_learning_rate))
        return NativeEncoding("ftrl", hyper, ("accumulator", "linear"))

    def rule(self, rows, slots, grads, step, lr, row_mean):
        k = -self.learning_rate_power
        acc = slots["accumulator"]
        acc_new = acc + grads * grads
        p_new = acc_new**k
        delta_p = p_new - acc**k
        if self.multiply_linear_by_learning_rate:
            linear = slots["linear"] + lr * grads - delta_p * rows
            l1, denom = lr * self.l1, p_new + self.beta + 2.0 * lr * self.l2
        else:  # linear in units of 1/lr: at a rate of 0 (a schedule's warmup) the row and slots stay as they are
            moves = lr != 0
            lr = jnp.where(moves, lr, 1.0)
            linear = slots["linear"] + grads - delta_p / lr * rows
            l1, denom = self.l1, (p_new + self.beta) / lr + 2.0 * self.l2
        numer = -linear if self.l1 == 0 else jnp.clip(linear, -l1, l1) - linear
        new = numer / denom, {"accumulator": acc_new, "linear": linear}
        if self.multiply_linear_by_learning_rate:
            return new
        return jax.tree.map(lambda a, b: jnp.where(moves, a, b), new, (rows, dict(slots)))


@dataclasses.dataclass(frozen=True)
class LaProp(Optimizer):
    """LaProp (Adam with decoupled momentum and adaptivity). Slots `mu`, `nu` `[dim]`."""

    learning_rate: LearningRate = 0.001
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-30

    def _check(self):
        self._decay_rates("b1", "b2")
        self._positive(eps=self.eps)  # 0: a row whose gradient is 0 (a weight of 0) would be 0 * rsqrt(0) = NaN

    def slots(self, dim):
        return {"mu": SlotSpec(dim, 0.0), "nu": SlotSpec(dim, 0.0)}

    def native(self):
        # sqrt(1 - b1^2) rounded as the generic rule's f32 arithmetic rounds it
        hyper = (self.b1, float(np.sqrt(np.float32(1.0 - self.b1**2))), self.eps)
        return NativeEncoding("laprop", hyper, ("mu", "nu"), self._decays)

    def _decays(self, step, lr) -> tuple[jax.Array, jax.Array]:
        """`(d, 1 - d)` at step t: the native case's step factors."""
        d = self.nu_decay(step)
        return d, 1.0 - d

    def nu_decay(self, step) -> jax.Array:
        """`d`, the decay of `nu` at step t that keeps it a bias-corrected average."""
        t = _require_step("LaProp", step)
        return self.b2 * (1.0 - self.b2**t) / (1.0 - self.b2 ** (t + 1.0))

    def rule(self, rows, slots, grads, step, lr, row_mean):
        d = self.nu_decay(step)
        nu = d * slots["nu"] + (1.0 - d) * (grads * grads + self.eps)
        mu = self.b1 * slots["mu"] + jnp.sqrt(1.0 - self.b1**2) * grads * jax.lax.rsqrt(nu)
        return rows - lr * mu, {"mu": mu, "nu": nu}


@dataclasses.dataclass(frozen=True)
class Custom(Optimizer):
    """A user-defined optimizer: `fn(rows, slots, grads, step) -> (rows', slots')`, any jax function.

    `slot_specs` maps slot name -> `SlotSpec(width, init)`. `fn` must be
    hashable (a plain function is) since the spec is a static jit argument.
    `learning_rate` only scales `weight_decay`.
    """

    fn: Callable[[jax.Array, Slots, jax.Array, jax.Array | None], tuple[jax.Array, Slots]] = None
    slot_specs: Mapping[str, SlotSpec] | tuple = ()
    learning_rate: LearningRate = 1.0

    def _check(self):
        if not callable(self.fn):
            raise TypeError(f"Custom: fn must be a function (rows, slots, grads, step) -> (rows, slots), got {self.fn!r}.")
        specs = dict(self.slot_specs)
        for name, s in specs.items():
            if not isinstance(s, SlotSpec):
                raise TypeError(f"Custom: slot {name!r} must be a SlotSpec(width, init), got {s!r}.")
        object.__setattr__(self, "slot_specs", tuple(sorted(specs.items())))

    def slots(self, dim):
        return dict(self.slot_specs)

    def native(self):
        return None  # fn is any jax function: the generic kernel only

    @property
    def elementwise(self) -> bool:
        return False  # fn sees whole rows

    @property
    def splits_columns(self) -> bool:
        return False  # fn sees whole rows: "column" placement gathers them for it

    def rule(self, rows, slots, grads, step, lr, row_mean):
        name = getattr(self.fn, "__name__", self.fn)
        shapes = lambda r, s: f"rows {tuple(r.shape)}, slots {({k: tuple(s[k].shape) for k in sorted(s)})}"  # noqa: E731
        given = f"{shapes(rows, slots)}, grads {tuple(grads.shape)}"
        try:
            new_rows, new_slots = self.fn(rows, slots, grads, step)
        except (TypeError, ValueError) as e:  # (a slot width that does not fit fn: name what it was given)
            raise type(e)(f"Custom optimizer {name!r} failed on {given} (slot widths from its slot_specs): {e}") from e
        if set(new_slots) != set(slots):
            raise ValueError(f"Custom optimizer {self.fn!r} returned slots {sorted(new_slots)}, expected {sorted(slots)}.")
        if shapes(new_rows, new_slots) != shapes(rows, slots):
            raise ValueError(f"Custom optimizer {name!r} was given {given} and returned {shapes(new_rows, new_slots)}: "
                             "each must keep its shape.")
        return new_rows, new_slots


DEFAULT: Optimizer = SGD(learning_rate=0.01)


def native_encoding(o: Optimizer) -> NativeEncoding | None:
    """`o.native()` if `o`'s own class declares it, else None (the generic kernel only).

    A subclass of a built-in optimizer may change its rule, so it runs on the generic kernel until it declares
    its own encoding.
    """
    return o.native() if "native" in vars(type(o)) else None


__all__ = [
    "Optimizer", "SlotSpec", "NativeEncoding", "SGD", "Adagrad", "RowwiseAdagrad", "Adam", "AdagradMomentum", "FTRL",
    "LaProp", "Custom", "DEFAULT", "native_encoding",
]
