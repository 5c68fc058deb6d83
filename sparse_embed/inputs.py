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

Two stages: `_canonical` checks the structure (types, shapes, batch size)
and turns every format into dense `[B, L]` or ragged `(values, lengths)`
arrays; then `flatten` (numpy) or `checked` (the C extension, for
`preprocess`) checks every id and weight, with the same errors.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import numpy as np

from sparse_embed.specs import FeatureSpec

try:  # the optional C kernels (sparse_embed/_native.c, built by `pip install`)
    from sparse_embed import _native
except ImportError:  # not built (e.g. no C compiler): numpy only
    _native = None
if os.environ.get("SPARSE_EMBED_NATIVE") == "0":  # force the numpy path
    _native = None

PADDING_ID = -1


class FlatIds(NamedTuple):
    """A feature's valid ids, flattened in sample-major order. All `[N]`."""

    ids: np.ndarray  # int64, in [0, vocabulary_size)
    weights: np.ndarray  # float32, finite
    samples: np.ndarray  # int64 sample index in [0, batch)
    positions: np.ndarray  # int64 position within the sample (sequence features)


class CanonicalIds(NamedTuple):
    """A feature's ids after the structure checks: dense `[B, L]` (-1 = padding) or ragged `[N]`.

    Arrays are C-contiguous, so the C extension reads them in place.
    """

    ids: np.ndarray  # int32 or int64
    weights: np.ndarray | None  # float32, the shape of ids; None = all 1
    lengths: np.ndarray | None  # int64 [B] ids per sample (ragged); None = dense

    @property
    def dense(self) -> bool:
        return self.lengths is None

    def sample_of(self, i: int) -> int:
        """The sample of the i-th id (flat index into `ids`)."""
        if self.dense:
            return i // self.ids.shape[1]
        return int(np.searchsorted(np.cumsum(self.lengths), i, side="right"))


def _err(feature: FeatureSpec, msg: str) -> ValueError:
    return ValueError(f"Feature {feature.name!r} (table {feature.table.name!r}): {msg}")


def _bad_id(feature: FeatureSpec, value: int, sample: int, padding_ok: bool) -> ValueError:
    why = "negative ids are not allowed" + (" (only -1 is padding, in dense input)" if padding_ok else " in ragged input")
    if value >= 0:
        why = f"ids must be < vocabulary_size {feature.table.vocabulary_size}"
    return _err(feature, f"id {value} in sample {sample} is out of range: {why}.")


def _bad_weight(feature: FeatureSpec, weight: np.float32, sample: int) -> ValueError:
    return _err(feature, f"weight {weight} for sample {sample} is not finite.")


def _int_array(feature: FeatureSpec, x: Any, what: str) -> np.ndarray:
    """x as int32 or int64 (other integer dtypes become int64)."""
    a = np.asarray(x)
    if a.dtype == object:
        raise _err(feature, f"{what} could not be read as an integer array (ragged rows must be a list of arrays).")
    if a.dtype == bool or not np.issubdtype(a.dtype, np.integer):
        if a.size == 0 and a.dtype == np.float64:  # np.asarray([]) is float64
            return a.astype(np.int64)
        raise _err(feature, f"{what} must be integers, got dtype {a.dtype}.")
    return a if a.dtype in (np.int32, np.int64) else a.astype(np.int64)


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


def _check_lengths(feature: FeatureSpec, values: np.ndarray, lengths: np.ndarray) -> None:
    if lengths.ndim != 1 or values.ndim != 1:
        raise _err(feature, "ragged (values, row_lengths) must both be 1-D.")
    if (lengths < 0).any():
        raise _err(feature, "row_lengths must be >= 0.")
    if int(lengths.sum()) != values.size:
        raise _err(feature, f"row_lengths sum to {int(lengths.sum())} but there are {values.size} values.")


def _batch_size_message(feature: FeatureSpec, batch: int, one_d: bool) -> str:
    msg = f"got {batch} samples, but the FeatureSpec's batch_size is {feature.batch_size}."
    if one_d and batch > feature.batch_size and batch % feature.batch_size == 0:
        msg += (" A 1-D array is one id per sample: reshape flat ids to [batch, L] (-1 padded), "
                "or pass them ragged as (values, row_lengths).")
    return msg


def _native_rows(ids: list, weights: Any) -> tuple | None:
    """A list of contiguous 1-D int32/int64 rows (float32/64 weight rows of the same lengths), joined in C.

    Returns `(values, lengths, weights)`, or None for anything else (the numpy
    code then decides, and names what is wrong). Saves a Python loop over rows.
    """
    if _native is None or not ids or not (weights is None or isinstance(weights, list)):
        return None
    got = _native.concat_rows(ids, "ilq")
    if got is None:
        return None
    w = None
    if weights is not None:
        got_w = _native.concat_rows(weights, "fd") if len(weights) == len(ids) else None
        if got_w is None or got_w[2] != got[2]:
            return None
        w = np.frombuffer(got_w[1], got_w[0]).astype(np.float32, copy=False)
    return np.frombuffer(got[1], got[0]), np.frombuffer(got[2], np.int64), w


def _pair(feature: FeatureSpec, ids: tuple, weights: Any) -> tuple:
    """(values, lengths, weights) of ragged `(values, row_lengths)` input."""
    if len(ids) != 2:
        raise _err(feature, f"a ragged tuple must be (values, row_lengths), got a tuple of {len(ids)}.")
    values = _int_array(feature, ids[0], "ids")
    lengths = _int_array(feature, ids[1], "row_lengths").astype(np.int64, copy=False)
    _check_lengths(feature, values, lengths)
    if weights is None:
        return values, lengths, None
    if len(weights) != 2:
        raise _err(feature, "weights must be (values, row_lengths) like the ids.")
    if not np.array_equal(np.asarray(weights[1]), lengths):
        raise _err(feature, "weights' row_lengths differ from the ids' row_lengths.")
    return values, lengths, _float_array(feature, weights[0], values.shape, "weights")


def _list(feature: FeatureSpec, ids: list, weights: Any) -> tuple:
    """(values, lengths, weights) of a ragged list of rows."""
    rows = [_int_array(feature, r, f"ids of sample {i}") for i, r in enumerate(ids)]
    lengths = np.array([r.size for r in rows], np.int64)
    if weights is None:
        return np.concatenate(rows), lengths, None
    if len(weights) != len(rows):
        raise _err(feature, f"weights have {len(weights)} rows but ids have {len(rows)}.")
    w = [_float_array(feature, wr, r.shape, f"weights of sample {i}") for i, (wr, r) in enumerate(zip(weights, rows))]
    return np.concatenate(rows), lengths, np.concatenate(w)


def _dense(feature: FeatureSpec, ids: Any, weights: Any) -> tuple:
    """(values [B] or [B, L], None, weights) of dense input."""
    a = _int_array(feature, ids, "ids")
    if a.ndim not in (1, 2):
        raise _err(feature, f"dense ids must be 1-D [batch] or 2-D [batch, L], got shape {a.shape}.")
    return a, None, None if weights is None else _float_array(feature, weights, a.shape, "weights")


def _canonical(feature: FeatureSpec, ids: Any, weights: Any = None) -> CanonicalIds:
    """Checks the structure, dtypes, shapes and batch size; every id format -> dense or ragged arrays."""
    fast = _native_rows(ids, weights) if isinstance(ids, list) else None  # skips _structure's loop over rows
    if fast is not None:
        values, lengths, w = fast
    else:
        kind = _structure(ids)
        if weights is not None and _structure(weights) != kind:
            raise _err(feature, f"weights are {_structure(weights)} but ids are {kind}; give them the same structure.")
        values, lengths, w = {"pair": _pair, "list": _list, "dense": _dense}[kind](feature, ids, weights)
    one_d = lengths is None and values.ndim == 1
    batch = values.shape[0] if lengths is None else lengths.size
    if batch != feature.batch_size:
        raise _err(feature, _batch_size_message(feature, batch, one_d))
    if one_d:  # [B] = [B, 1]
        values, w = values[:, None], None if w is None else w[:, None]
    return CanonicalIds(np.ascontiguousarray(values), None if w is None else np.ascontiguousarray(w), lengths)


def checked(feature: FeatureSpec, ids: Any, weights: Any = None) -> CanonicalIds:
    """`flatten`'s checks, with the same errors, in C and without flattening: `preprocess`'s native input.

    Needs the C extension (`_native` is not None).
    """
    c = _canonical(feature, ids, weights)
    bad_id, bad_weight = _native.validate(c.ids, c.weights, feature.table.vocabulary_size, c.dense)
    if bad_id >= 0:
        raise _bad_id(feature, int(c.ids.flat[bad_id]), c.sample_of(bad_id), c.dense)
    if bad_weight >= 0:
        raise _bad_weight(feature, c.weights.flat[bad_weight], c.sample_of(bad_weight))
    return c


def flatten(feature: FeatureSpec, ids: Any, weights: Any = None) -> FlatIds:
    """Validates one feature's ids (and weights) and flattens them. Batch = `FeatureSpec.batch_size`."""
    c = _canonical(feature, ids, weights)
    if c.dense:
        keep = c.ids != PADDING_ID
        samples, positions = np.nonzero(keep)
        values, w = c.ids[keep], None if c.weights is None else c.weights[keep]
    else:
        values, w = c.ids, c.weights
        samples = np.repeat(np.arange(c.lengths.size, dtype=np.int64), c.lengths)
        positions = np.arange(values.size, dtype=np.int64) - np.repeat(np.cumsum(c.lengths) - c.lengths, c.lengths)
    bad = (values < 0) | (values >= feature.table.vocabulary_size)
    if bad.any():
        i = int(np.argmax(bad))
        raise _bad_id(feature, int(values[i]), int(samples[i]), c.dense)
    if w is None:
        w = np.ones(values.shape, np.float32)
    elif not np.isfinite(w).all():
        i = int(np.argmax(~np.isfinite(w)))
        raise _bad_weight(feature, w[i], int(samples[i]))
    return FlatIds(values.astype(np.int64, copy=False), w, samples.astype(np.int64, copy=False),
                   positions.astype(np.int64, copy=False))
