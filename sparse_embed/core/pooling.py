"""How a sample's rows are pooled: combiner gains and `max_norm` clipping, for every path.

Host preprocessing (numpy), the device lookup and the serving lookup (jnp)
share these definitions; the C preprocess kernel mirrors `gains` (and is
tested bit for bit against it).
"""

from __future__ import annotations

from typing import Any, Callable

COMBINERS = ("sum", "mean", "sqrtn")

SegmentSum = Callable[[Any, Any, int], Any]  # (values [N], segment ids [N], num_segments) -> [num_segments]


def gains(combiner: str, weights, rows, num_rows: int, segment_sum: SegmentSum, xp) -> Any:
    """Folds the combiner into each id's weight: `[N]` gains for weights `[N]` of output rows `[N]`.

    mean: `w / Σw`, sqrtn: `w / √Σw²` (sums over each output row), sum: `w`.
    A row whose denominator is 0 gets gains 0 (a zero activation). `xp` is
    numpy or jax.numpy; the arithmetic runs in the weights' dtype.
    """
    if combiner == "sum":
        return weights
    if combiner == "mean":
        denom = segment_sum(weights, rows, num_rows)[rows]
    else:
        denom = xp.sqrt(segment_sum(weights * weights, rows, num_rows))[rows]
    nonzero = denom != 0
    return xp.where(nonzero, weights / xp.where(nonzero, denom, 1.0), 0.0)


def max_norm_scale(rows, max_norm: float, xp, total=None):
    """`(scale, norm)`, `[..., 1]` each: the factor that brings each row's L2 norm to at most max_norm.

    `total`: adds a row's partial sums `[..., 1]` across the devices that hold its other columns
    ("column" placement); by default a row is all here.
    """
    norm = xp.sqrt(_total(total, xp.sum(rows * rows, axis=-1, keepdims=True)))
    return xp.where(norm > max_norm, max_norm / xp.where(norm > 0, norm, 1.0), 1.0), norm


def max_norm_vjp(rows, grads, max_norm: float, xp, total=None):
    """The gradient w.r.t. rows `[N, dim]` through `rows * max_norm_scale(rows)`, given `grads [N, dim]`."""
    sums = _total(total, xp.concatenate([xp.sum(rows * rows, axis=-1, keepdims=True),
                                         xp.sum(rows * grads, axis=-1, keepdims=True)], axis=-1))
    norm = xp.sqrt(sums[..., :1])
    clipped = norm > max_norm
    scale = xp.where(clipped, max_norm / xp.where(norm > 0, norm, 1.0), 1.0)
    radial = sums[..., 1:] / xp.where(clipped, norm * norm, 1.0)
    return scale * (grads - xp.where(clipped, radial * rows, 0.0))


def _total(total, partial):
    return partial if total is None else total(partial)
