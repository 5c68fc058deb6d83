"""Host-side id formats -> one flat, validated form per feature.

Accepted per feature (`weights` has the same structure, floats):

- 1-D int array `[B]`: one id per sample (-1 = the sample has no id), so a
  flat `[B * L]` array is B * L samples (a batch-size error), never reshaped;
- 2-D int array `[B, L]` (L may be 0): -1 is padding (the column index is the
  sequence position, so a -1 in the middle leaves a zero position);
- ragged: a *list* of B 1-D int arrays, or a *tuple* `(values, row_lengths)`.
  Ragged input has no padding value: every id must be valid.

Every id is checked against the feature's vocabulary and every weight for
NaN/inf; errors name the feature, the table and the offending sample.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from sparse_embed.specs import FeatureSpec

PADDING_ID = -1


class FlatIds(NamedTuple):
    """A feature's valid ids, flattened in sample-major order. All `[N]`."""

    ids: np.ndarray  # int64, in [0, vocabulary_size)
    weights: np.ndarray  # float32, finite
    samples: np.ndarray  # int64 sample index in [0, batch)
    positions: np.ndarray  # int64 position within the sample (sequence features)


def _err(feature: FeatureSpec, msg: str) -> ValueError:
    return ValueError(f"Feature {feature.name!r} (table {feature.table.name!r}): {msg}")


def _int_array(feature: FeatureSpec, x: Any, what: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype == object:
        raise _err(feature, f"{what} could not be read as an integer array (ragged rows must be a list of arrays).")
    if a.dtype == bool or not np.issubdtype(a.dtype, np.integer):
        if a.size == 0 and a.dtype == np.float64:  # np.asarray([]) is float64
            return a.astype(np.int64)
        raise _err(feature, f"{what} must be integers, got dtype {a.dtype}.")
    return a.astype(np.int64, copy=False)


def _float_array(feature: FeatureSpec, x: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype == object or not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)) or a.dtype == bool:
        raise _err(feature, f"{what} must be numbers, got dtype {a.dtype}.")
    if a.shape != shape:
        raise _err(feature, f"{what} have shape {a.shape}, but the ids have shape {shape}.")
    return a.astype(np.float32, copy=False)


def _is_ragged_list(x: Any) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(np.ndim(r) == 1 for r in x)


def _structure(x: Any) -> str:
    if isinstance(x, tuple):
        return "pair"
    if _is_ragged_list(x):
        return "list"
    return "dense"


def _from_lengths(feature: FeatureSpec, values: np.ndarray, lengths: np.ndarray):
    if lengths.ndim != 1 or values.ndim != 1:
        raise _err(feature, "ragged (values, row_lengths) must both be 1-D.")
    if (lengths < 0).any():
        raise _err(feature, "row_lengths must be >= 0.")
    if int(lengths.sum()) != values.size:
        raise _err(feature, f"row_lengths sum to {int(lengths.sum())} but there are {values.size} values.")
    samples = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    starts = np.cumsum(lengths) - lengths
    positions = np.arange(values.size, dtype=np.int64) - np.repeat(starts, lengths)
    return samples, positions


def _batch_size_message(feature: FeatureSpec, batch: int, one_d: bool) -> str:
    msg = f"got {batch} samples, but the FeatureSpec's batch_size is {feature.batch_size}."
    if one_d and batch > feature.batch_size and batch % feature.batch_size == 0:
        msg += (" A 1-D array is one id per sample: reshape flat ids to [batch, L] (-1 padded), "
                "or pass them ragged as (values, row_lengths).")
    return msg


def flatten(feature: FeatureSpec, ids: Any, weights: Any = None) -> FlatIds:
    """Validates one feature's ids (and weights) and flattens them. Batch = `FeatureSpec.batch_size`."""
    kind, one_d = _structure(ids), False
    if weights is not None and _structure(weights) != kind:
        raise _err(feature, f"weights are {_structure(weights)} but ids are {kind}; give them the same structure.")
    if kind == "pair":
        if len(ids) != 2:
            raise _err(feature, f"a ragged tuple must be (values, row_lengths), got a tuple of {len(ids)}.")
        values = _int_array(feature, ids[0], "ids")
        lengths = _int_array(feature, ids[1], "row_lengths")
        samples, positions = _from_lengths(feature, values, lengths)
        batch, padding_ok = lengths.size, False
        w = None
        if weights is not None:
            if len(weights) != 2:
                raise _err(feature, "weights must be (values, row_lengths) like the ids.")
            if not np.array_equal(np.asarray(weights[1]), lengths):
                raise _err(feature, "weights' row_lengths differ from the ids' row_lengths.")
            w = _float_array(feature, weights[0], values.shape, "weights")
    elif kind == "list":
        rows = [_int_array(feature, r, f"ids of sample {i}") for i, r in enumerate(ids)]
        lengths = np.array([r.size for r in rows], np.int64)
        values = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        samples, positions = _from_lengths(feature, values, lengths)
        batch, padding_ok = len(rows), False
        w = None
        if weights is not None:
            if len(weights) != len(rows):
                raise _err(feature, f"weights have {len(weights)} rows but ids have {len(rows)}.")
            w = np.concatenate(
                [_float_array(feature, wr, r.shape, f"weights of sample {i}") for i, (wr, r) in enumerate(zip(weights, rows))]
            )
    else:
        a = _int_array(feature, ids, "ids")
        if a.ndim not in (1, 2):
            raise _err(feature, f"dense ids must be 1-D [batch] or 2-D [batch, L], got shape {a.shape}.")
        w = None if weights is None else _float_array(feature, weights, a.shape, "weights")
        a2, one_d = (a, False) if a.ndim == 2 else (a[:, None], True)
        batch, padding_ok = a2.shape[0], True
        keep = a2 != PADDING_ID
        samples, positions = np.nonzero(keep)
        values = a2[keep]
        if w is not None:
            w = w.reshape(a2.shape)[keep]
    if batch != feature.batch_size:
        raise _err(feature, _batch_size_message(feature, batch, one_d))
    vocab = feature.table.vocabulary_size
    bad = (values < 0) | (values >= vocab)
    if bad.any():
        i = int(np.argmax(bad))
        why = "negative ids are not allowed" + (" (only -1 is padding, in dense input)" if padding_ok else " in ragged input")
        if values[i] >= 0:
            why = f"ids must be < vocabulary_size {vocab}"
        raise _err(feature, f"id {int(values[i])} in sample {int(samples[i])} is out of range: {why}.")
    if w is None:
        w = np.ones(values.shape, np.float32)
    elif not np.isfinite(w).all():
        i = int(np.argmax(~np.isfinite(w)))
        raise _err(feature, f"weight {w[i]} for sample {int(samples[i])} is not finite.")
    return FlatIds(values, w, samples.astype(np.int64, copy=False), positions.astype(np.int64, copy=False))
