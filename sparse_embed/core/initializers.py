"""Table initializers whose values depend only on the key and each element's (row, column).

`truncated_normal(stddev)` is the default initializer of every table. It
draws each element from a counter-based hash of `(key, row, column)`
(two rounds of a 32-bit multiply-xorshift mixer, "lowbias32") turned into
a normal truncated at ±2 standard deviations by the inverse error function,
as `jax.nn.initializers.truncated_normal` does (same distribution and
scaling, other values). Because an element needs nothing but its position,
`init_tables` generates every device's rows where they live, in the
stacked layout, in one pass: no relayout, no temporary copy of a table, and
cheaper bits than JAX's default threefry (two multiply-xorshift rounds
where threefry runs twenty). For embedding initialisation the hash's
statistical quality is ample (it is not a cryptographic or
simulation-grade generator).

Any other `f(key, shape, dtype)` initializer works too; `init_tables`
then generates each table whole and moves its rows to their shards.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

_TRUNCATION = 2.0  # in standard deviations, as jax.nn.initializers.truncated_normal


def mix32(x: jax.Array) -> jax.Array:
    """lowbias32: a 32-bit integer hash with low bias (multiply-xorshift)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def seeds(key: jax.Array) -> jax.Array:
    """Two uint32 seeds from a JAX key (any implementation)."""
    return jax.random.bits(key, (2,), jnp.uint32)


def uniform_rows(seed: jax.Array, rows: jax.Array, dim: int) -> jax.Array:
    """`[len(rows), dim]` uniform in (0, 1) from (seed, row, column); `seed` `[2]` or `[len(rows), 2]` uint32."""
    seed = jnp.broadcast_to(seed, rows.shape + (2,))
    cols = jax.lax.broadcasted_iota(jnp.uint32, rows.shape + (dim,), rows.ndim)
    h = mix32(rows.astype(jnp.uint32) + seed[..., 0])[..., None]
    h = mix32(h ^ (cols * jnp.uint32(0x9E3779B9) + seed[..., 1:2]))
    return (h >> 8).astype(jnp.float32) * (1.0 / (1 << 24)) + (0.5 / (1 << 24))


def truncated_normal_rows(seed: jax.Array, rows: jax.Array, dim: int, stddev, dtype) -> jax.Array:
    """`[len(rows), dim]`: `TruncatedNormal(stddev)`'s values at those rows."""
    lo = math.erf(-_TRUNCATION / math.sqrt(2))
    u = uniform_rows(seed, rows, dim)
    z = math.sqrt(2) * jax.lax.erf_inv(lo + u * (-2 * lo))
    z = jnp.clip(z, -_TRUNCATION, _TRUNCATION)
    scale = jnp.asarray(stddev, jnp.float32)
    return (z * (scale[..., None] if jnp.ndim(scale) else scale)).astype(dtype)


@dataclasses.dataclass(frozen=True)
class TruncatedNormal:
    """`stddev` times a unit normal truncated at ±2 (stddev of the untruncated normal, as TF and
    `jax.nn.initializers.truncated_normal`); positional: see the module doc."""

    stddev: float

    def __post_init__(self):
        x = self.stddev
        if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)) or not 0 < x < math.inf:
            raise ValueError(f"stddev must be a finite number > 0, got {x!r}.")
        object.__setattr__(self, "stddev", float(x))  # (1 and 1.0: one initializer, as stores record it)

    def __call__(self, key: jax.Array, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
        if len(shape) != 2:
            raise ValueError(f"TruncatedNormal initialises 2-D tables [rows, dim], got shape {shape}.")
        return truncated_normal_rows(seeds(key), jnp.arange(shape[0], dtype=jnp.uint32), shape[1], self.stddev, dtype)


def truncated_normal(stddev: float) -> TruncatedNormal:
    """The default table initializer with another stddev (the default is `1/sqrt(dim)`)."""
    return TruncatedNormal(stddev)
