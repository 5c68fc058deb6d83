"""Combiner gains as jax-tpu-embedding computes them: float32 sums in input order. Host numpy.

A mean or sqrtn feature scales each id's weight by its output row's
`Σw` or `√Σw²`. Both are summed in float32, one id at a time in input
order (sqrtn squares each weight in float64 before adding), so the gains,
and so the activations, are the same bits whether the C extension, numpy
or jax-tpu-embedding's preprocessing computes them. A row whose divisor is
0 gets gains 0 (jax-tpu-embedding: inf/NaN).
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def fold(values: np.ndarray, groups: np.ndarray, n: int, step: Callable) -> np.ndarray:
    """float32 `acc = step(acc, value)` from 0 over each of `n` groups' values, in input order: `[n]`."""
    order = np.argsort(groups, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size) - np.searchsorted(groups[order], groups[order])  # index within the group
    acc = np.zeros(n, np.float32)
    for r in range(int(rank.max(initial=-1)) + 1):
        at = rank == r
        acc[groups[at]] = step(acc[groups[at]], values[at])
    return acc


def gains(combiner: str, weights: np.ndarray, rows: np.ndarray, num_rows: int) -> np.ndarray:
    """Each id's float32 gain, `[N]` for float32 weights `[N]` of output rows `[N]`: `w / Σw` (mean),
    `w / √Σw²` (sqrtn) or `w` (sum)."""
    w = np.asarray(weights, np.float32)
    if combiner == "sum":
        return w
    if combiner == "mean":
        divisor = fold(w, rows, num_rows, np.add)
    else:
        divisor = np.sqrt(fold(w, rows, num_rows, lambda acc, x: (acc + x.astype(np.float64) ** 2).astype(np.float32)))
    d = divisor[rows]
    return np.where(d != 0, w / np.where(d != 0, d, np.float32(1)), np.float32(0))
