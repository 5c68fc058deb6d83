"""Synthetic click logs in Criteo's format, with a signal a model can learn (for the demo, tests and benchmarks).

Each line: a label, 13 integers (Poisson counts, some missing, a few
negative) and 26 categorical values (8-digit hex of 32-bit hashes, Zipf
over `vocabulary` distinct values per feature, some missing), tab-separated.
The label is a click drawn from a logistic model of the first four
categorical features and the first dense one, so AUC well above 0.5 is
reachable.

    python -m sparse_embed.examples.criteo_data day_0.txt --lines 100000 [--gzip]
"""

from __future__ import annotations

import argparse
import gzip
from typing import Sequence

import numpy as np

NUM_DENSE, NUM_CATEGORICAL, CHUNK = 13, 26, 100_000
_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)
_DIGITS = np.frombuffer(b"0123456789", np.uint8)


def _hex_fields(values: np.ndarray) -> np.ndarray:
    """uint32 `[...]` -> their 8 hex digits, `[..., 8]` uint8."""
    shifts = np.arange(28, -1, -4, dtype=np.uint64)
    return _HEX[(values[..., None].astype(np.uint64) >> shifts) & np.uint64(15)]


def _decimal_fields(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative ints < 10**8 `[...]` -> (digits left-aligned `[..., 8]` uint8, lengths `[...]`)."""
    digits = _DIGITS[(values[..., None] // 10 ** np.arange(7, -1, -1)) % 10]  # right-aligned, leading zeros
    lengths = np.maximum(1, np.floor(np.log10(np.maximum(values, 1))).astype(np.int64) + 1)
    src = np.minimum(8 - lengths[..., None] + np.arange(8), 7)
    return np.take_along_axis(digits, src, -1), lengths


def _lines(rng: np.random.Generator, n: int, weights: np.ndarray, hashes: np.ndarray, missing: float) -> bytes:
    """`n` lines, assembled as fixed-width fields cut to their lengths (one boolean mask, no Python loop)."""
    vocab = hashes.shape[1]
    ranks = np.minimum(rng.zipf(1.2, (n, NUM_CATEGORICAL)) - 1, vocab - 1)
    cats = hashes[np.arange(NUM_CATEGORICAL), ranks]  # [n, 26]
    counts = rng.poisson(3.0, (n, NUM_DENSE)) * rng.integers(1, 50, (1, NUM_DENSE))
    logit = weights[np.arange(4), ranks[:, :4]].sum(1) + 0.3 * np.log1p(counts[:, 0]) - 1.5
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    fields = np.zeros((n, 1 + NUM_DENSE + NUM_CATEGORICAL, 10), np.uint8)
    lengths = np.zeros((n, 1 + NUM_DENSE + NUM_CATEGORICAL), np.int64)
    fields[:, 0, 0], lengths[:, 0] = _DIGITS[labels], 1
    fields[:, 1:14, :8], lengths[:, 1:14] = _decimal_fields(counts)
    negative = rng.random((n, NUM_DENSE)) < 0.01  # a few -1s, as the real logs have
    fields[:, 1:14, 0][negative], fields[:, 1:14, 1][negative], lengths[:, 1:14][negative] = ord("-"), ord("1"), 2
    fields[:, 14:, :8], lengths[:, 14:] = _hex_fields(cats), 8
    lengths[:, 1:][rng.random((n, NUM_DENSE + NUM_CATEGORICAL)) < missing] = 0
    np.put_along_axis(fields, lengths[..., None], ord("\t"), -1)
    fields[:, -1][np.arange(n), lengths[:, -1]] = ord("\n")
    return fields[np.arange(10) <= lengths[..., None]].tobytes()


def write_criteo(path: str, lines: int, *, seed: int = 0, vocabulary: int = 10_000, missing: float = 0.1,
                 compress: bool = False) -> str:
    """Writes `lines` synthetic lines to `path` (gzip with `compress`); returns the path."""
    rng = np.random.default_rng(seed)
    hashes = np.random.default_rng([seed, 1]).integers(0, 2**32, (NUM_CATEGORICAL, vocabulary), dtype=np.uint64)
    weights = np.random.default_rng([seed, 2]).normal(0.0, 1.0, (4, vocabulary))
    with (gzip.open(path, "wb", compresslevel=1) if compress else open(path, "wb")) as f:
        for start in range(0, lines, CHUNK):
            f.write(_lines(rng, min(CHUNK, lines - start), weights, hashes, missing))
    return path


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sparse_embed.examples.criteo_data", description=__doc__.split("\n")[0])
    p.add_argument("path")
    p.add_argument("--lines", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocabulary", type=int, default=10_000, help="distinct values per categorical feature")
    p.add_argument("--gzip", action="store_true")
    args = p.parse_args(argv)
    write_criteo(args.path, args.lines, seed=args.seed, vocabulary=args.vocabulary, compress=args.gzip)
    print(f"{args.lines} lines written to {args.path}")


if __name__ == "__main__":
    main()
