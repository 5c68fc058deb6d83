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


def initial_rows(rng, vocab: int, dim: int) -> np.ndarray:
    """`[vocab, dim]` float32 rows drawn as sparse_embed's default initializer draws them: a normal of stddev
    1/sqrt(dim), cut at 2 stddevs."""
    z = rng.standard_normal((vocab, dim))
    while (far := np.abs(z) > 2).any():
        z[far] = rng.standard_normal(int(far.sum()))
    return (z / np.sqrt(dim)).astype(np.float32)


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


# Optimizers: update(w, slots, g, lr, step) -> (w, slots), float64 rows [dim].
def sgd(w, slots, g, lr, step):
    return w - lr * g, slots


def adagrad(w, slots, g, lr, step):
    acc = slots["accumulator"] + g * g
    return w - lr * g / np.sqrt(acc), {"accumulator": acc}


def rowwise_adagrad(eps):
    def update(w, slots, g, lr, step):
        acc = slots["accumulator"] + np.mean(g * g)
        return w - lr * g / (np.sqrt(acc) + eps), {"accumulator": acc}
    return update


def adam(b1, b2, eps):
    def update(w, slots, g, lr, step):
        m = b1 * slots["momentum"] + (1 - b1) * g
        v = b2 * slots["velocity"] + (1 - b2) * g * g
        t = step + 1
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        return w - lr * m_hat / (np.sqrt(v_hat) + eps), {"momentum": m, "velocity": v}
    return update


def adagrad_momentum(momentum, beta2, eps, exponent, nesterov):
    def update(w, slots, g, lr, step):
        acc = slots["accumulator"] + g * g if beta2 == 1 else beta2 * slots["accumulator"] + (1 - beta2) * g * g
        p = (acc + eps) ** (-1.0 / exponent)
        m = momentum * slots["momentum"] + p * g
        d = momentum * m + p * g if nesterov else m
        return w - lr * d, {"accumulator": acc, "momentum": m}
    return update


def ftrl(power, l1, l2, beta, mult_lr):
    """Written from the FTRL-Proximal paper's per-coordinate form (sigma, z, n)."""
    def update(w, slots, g, lr, step):
        n, z = slots["accumulator"], slots["linear"]
        n_new = n + g * g
        sigma = (n_new ** -power - n ** -power) / lr
        if mult_lr:
            z_new = z + lr * (g - sigma * w)
            zz, quad = z_new / lr, (n_new ** -power + beta) / lr + 2 * l2
        else:
            z_new = z + g - sigma * w
            zz, quad = z_new, (n_new ** -power + beta) / lr + 2 * l2
        w_new = np.where(np.abs(zz) <= l1, 0.0, -(zz - np.sign(zz) * l1) / quad)
        return w_new, {"accumulator": n_new, "linear": z_new}
    return update


def laprop(b1, b2, eps):
    def update(w, slots, g, lr, step):
        # nu is the bias-corrected EMA of g^2 (+eps): nu_t = sum_i b2^(t-i) (g_i^2+eps) (1-b2) / (1-b2^(t+1))
        d = b2 * (1 - b2**step) / (1 - b2 ** (step + 1))
        nu = d * slots["nu"] + (1 - d) * (g * g + eps)
        mu = b1 * slots["mu"] + np.sqrt(1 - b1 * b1) * g / np.sqrt(nu)
        return w - lr * mu, {"mu": mu, "nu": nu}
    return update


def with_options(update, clip_gradient=None, clip_weight=None, weight_decay=0.0):
    def wrapped(w, slots, g, lr, step):
        if clip_gradient is not None:
            g = np.clip(g, *clip_gradient)
        w_new, slots = update(w, slots, g, lr, step)
        w_new = w_new - lr * weight_decay * w
        if clip_weight is not None:
            w_new = np.clip(w_new, *clip_weight)
        return w_new, slots
    return wrapped


def apply(update, state: dict[str, np.ndarray], grads: dict[int, np.ndarray], lr: float, step: int = 0) -> None:
    """Applies a row update in place to `state = {"table": W, slot: ...}` for the touched rows."""
    for r, g in grads.items():
        slots = {k: v[r].astype(np.float64) for k, v in state.items() if k != "table"}
        w, slots = update(state["table"][r].astype(np.float64), slots, np.asarray(g, np.float64), lr, step)
        state["table"][r] = w
        for k, v in slots.items():
            state[k][r] = v

