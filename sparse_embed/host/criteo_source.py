"""Criteo files as a grain random-access source: record `i` is this process's rows of global batch `i`.

A record is a whole batch, not one example: grain's per-record overhead
(a few microseconds) would cost more than parsing a line, so the source
reads and parses `batch_size / processes` lines at once. Under several
processes (`jax.distributed`), process `p` reads rows
`[p * b, (p + 1) * b)` of each global batch of `B = P * b` rows, the rows
`preprocess` expects from it (`se.distributed.process_rows`): together the
processes train on the same global batches as one process would.
Shuffling (`MapDataset.shuffle`) permutes whole batches, the same way on
every process given the same seed.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Sequence

import jax
import numpy as np

from sparse_embed.host.criteo import FIELD_NAMES, NUM_CATEGORICAL, hash_ids
from sparse_embed.host.criteo_files import CriteoFiles


class CriteoBatch(NamedTuple):
    """This process's rows of one batch of Criteo examples (b rows)."""

    labels: np.ndarray  # [b] float32
    dense: np.ndarray  # [b, 13] float32, log1p(max(x, 0)), missing 0
    categorical: np.ndarray  # [b, 26] int64: raw ids (missing: MISSING_ID), or rows with `vocabulary`


CATEGORICAL_NAMES = FIELD_NAMES[-NUM_CATEGORICAL:]  # "C1" .. "C26"


def criteo_ids(batch: CriteoBatch, names: Sequence[str] = CATEGORICAL_NAMES) -> dict[str, np.ndarray]:
    """The ids mapping of a `CriteoBatch` for `preprocess`: `{"C1": [b], ..., "C26": [b]}` (or `names`, in order)."""
    if len(names) != NUM_CATEGORICAL:
        raise ValueError(f"names must name the {NUM_CATEGORICAL} categorical features, got {len(names)} names.")
    return {name: np.ascontiguousarray(batch.categorical[:, i]) for i, name in enumerate(names)}


def _vocabularies(vocabulary: int | Sequence[int] | None) -> np.ndarray | None:
    if vocabulary is None:
        return None
    sizes = [vocabulary] * NUM_CATEGORICAL if isinstance(vocabulary, (int, np.integer)) else list(vocabulary)
    if len(sizes) != NUM_CATEGORICAL or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1
                                            for v in sizes):
        raise ValueError(f"vocabulary must be an int >= 1 or {NUM_CATEGORICAL} of them (one per categorical "
                         f"feature), got {vocabulary!r}.")
    return np.asarray(sizes, np.int64)


class CriteoSource:
    """Criteo-format files as a grain `RandomAccessDataSource` of `CriteoBatch`es.

    Args:
      paths: one file or several (plain or gzip), read as one sequence of lines.
      batch_size: the global batch (every process's rows together).
      vocabulary: None: categorical values are raw ids (for raw-id tables,
        `se.Dynamic`); an int (or 26 ints): each value is hashed to a row
        of a static table of that many rows (`criteo.hash_ids`).
      on_malformed: "error" or "skip" (`CriteoFiles`).
      process_index, process_count: default `jax.process_index()` / `jax.process_count()`.

    Opening reads and checks every line once (`CriteoFiles`).
    """

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], batch_size: int, *,
                 vocabulary: int | Sequence[int] | None = None, on_malformed: str = "error",
                 process_index: int | None = None, process_count: int | None = None) -> None:
        self.process_count = jax.process_count() if process_count is None else int(process_count)
        self.process_index = jax.process_index() if process_index is None else int(process_index)
        if not 0 <= self.process_index < self.process_count:
            raise ValueError(f"process_index {self.process_index} is not in [0, {self.process_count}).")
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1 \
                or batch_size % self.process_count:
            raise ValueError(f"batch_size must be a positive multiple of the {self.process_count} processes, got "
                             f"{batch_size!r}.")
        self.batch_size, self.vocabulary = int(batch_size), _vocabularies(vocabulary)
        self.files = CriteoFiles(paths, self.batch_size // self.process_count, on_malformed=on_malformed)

    def __len__(self) -> int:
        """The whole global batches in the files."""
        return len(self.files) // self.process_count

    def __getitem__(self, index: int) -> CriteoBatch:
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} is out of range: the files hold {len(self)} batches of "
                             f"{self.batch_size} examples.")
        parsed = self.files.read(int(index) * self.process_count + self.process_index)
        categorical = parsed.categorical
        if self.vocabulary is not None:
            categorical = hash_ids(categorical, self.vocabulary)
        return CriteoBatch(parsed.labels, parsed.dense, categorical)

    def __repr__(self) -> str:
        return (f"CriteoSource({len(self.files.paths)} file(s), {len(self)} batches of {self.batch_size}, "
                f"process {self.process_index} of {self.process_count}, skipped {self.files.skipped})")
