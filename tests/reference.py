"""An independent dense numpy reference for lookup and training.

Works on raw samples (a list, per sample, of `(id, weight)` pairs) and
per-table `[vocab, dim]` arrays; shares no code with sparse_embed.
"""

from __future__ import annotations

import numpy as np

Samples = list[list[tuple[int, float]]]


# ---------------------------------------------------------------- data
def random_samples(rng, batch: int, vocab: int, max_len: int, *, weighted: bool, min_len: int = 0,
                   id_pool: int | None = None) -> Samples:
    """Random multi-hot samples; `id_pool` restricts ids to a few values (many duplicates)."""
    out = []
    for _ in range(batch):
        n = int(rng.integers(min_len, max_len + 1))
        hi = vocab if id_pool is None else min(vocab, id_pool)
        ids = rng.integers(0, hi, n)
        w = rng.uniform(0.2, 2.0, n) if weighted else np.ones(n)
        out.append([(int(i), float(x)) for i, x in zip(ids, w)])
    return out


def render(samples: Samples, fmt: str, width: int | None = None):
    """Samples -> (ids, weights) in one of sparse_embed's input formats."""
    if fmt == "dense":
        width = width or max([len(s) for s in samples] + [1])
        ids = np.full((len(samples), width), -1, np.int64)
        w = np.full((len(samples), width), np.nan, np.float32)  # padding weights must be ignored
        for b, s in enumerate(samples):
            for j, (i, x) in enumerate(s):
                ids[b, j], w[b, j] = i, x
        return ids, w
    if fmt == "1d":
        assert all(len(s) <= 1 for s in samples)
        ids = np.array([s[0][0] if s else -1 for s in samples], np.int32)
        w = np.array([s[0][1] if s else 0.0 for s in samples], np.float32)
        return ids, w
    if fmt == "list":
        return ([np.array([i for i, _ in s], np.int64) for s in samples],
                [np.array([x for _, x in s], np.float32) for s in samples])
    if fmt == "pair":
        flat = [p for s in samples for p in s]
        lengths = np.array([len(s) for s in samples], np.int64)
        return ((np.array([i for i, _ in flat], np.int64), lengths),
                (np.array([x for _, x in flat], np.float32), lengths))
    raise ValueError(fmt)


# ---------------------------------------------------------------- math
def _gains(weights: np.ndarray, combiner: str) -> np.ndarray:
    w = np.asarray(weights, np.float64)
    if combiner == "sum":
        return w
    denom = w.sum() if combiner == "mean" else np.sqrt((w * w).sum())
    return np.zeros_like(w) if denom == 0 else w / denom


def _clip(row: np.ndarray, max_norm: float | None) -> np.ndarray:
    if max_norm is None:
        return row
    n = np.linalg.norm(row)
    return row * (max_norm / n) if n > max_norm else row


def _clip_vjp(row: np.ndarray, g: np.ndarray, max_norm: float | None) -> np.ndarray:
    """d(clip(row))/d(row)^T g."""
    if max_norm is None:
        return g
    n = np.linalg.norm(row)
    if n <= max_norm:
        return g
    return (max_norm / n) * (g - row * (row @ g) / (n * n))


def _entries(samples: Samples, combiner: str, seq_len: int):
    """(sample, position or None, id, gain) for every id that contributes."""
    for b, s in enumerate(samples):
        if seq_len:
            for p, (i, x) in enumerate(s[:seq_len]):
                yield b, p, i, _gains(np.array([x]), combiner)[0]
        elif s:
            gains = _gains(np.array([x for _, x in s]), combiner)
            for (i, _), g in zip(s, gains):
                yield b, None, i, g


def lookup(W: np.ndarray, samples: Samples, *, combiner: str, seq_len: int = 0,
           max_norm: float | None = None) -> np.ndarray:
    """Activations `[B, dim]` (pooled) or `[B, seq_len, dim]`."""
    dim = W.shape[1]
    out = np.zeros((len(samples), seq_len, dim) if seq_len else (len(samples), dim))
    for b, p, i, g in _entries(samples, combiner, seq_len):
        v = g * _clip(W[i].astype(np.float64), max_norm)
        if seq_len:
            out[b, p] += v
        else:
            out[b] += v
    return out


def row_grads(W: np.ndarray, samples: Samples, ct: np.ndarray, *, combiner: str, seq_len: int = 0,
              max_norm: float | None = None) -> dict[int, np.ndarray]:
    """{row id: d(sum(activations * ct))/d(row)}, for every touched row."""
    grads: dict[int, np.ndarray] = {}
    for b, p, i, g in _entries(samples, combiner, seq_len):
        up = ct[b, p] if seq_len else ct[b]
        d = _clip_vjp(W[i].astype(np.float64), g * up, max_norm)
        grads[i] = grads.get(i, 0.0) + d
    return grads


def sgd(w, slots, g, lr):
    return w - lr * g, slots


def adagrad(w, slots, g, lr):
    acc = slots["accumulator"] + g * g
    return w - lr * g / np.sqrt(acc), {"accumulator": acc}


def apply(update, state: dict[str, np.ndarray], grads: dict[int, np.ndarray], lr: float) -> None:
    """Applies a row update in place to `state = {"table": W, slot: ...}` for the touched rows."""
    for r, g in grads.items():
        slots = {k: v[r].astype(np.float64) for k, v in state.items() if k != "table"}
        w, slots = update(state["table"][r].astype(np.float64), slots, g, lr)
        state["table"][r] = w
        for k, v in slots.items():
            state[k][r] = v
