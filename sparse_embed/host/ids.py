"""Every id input format -> one canonical form per feature, checked with errors that name the feature.

Accepted per feature (`weights` has the same structure, floats):

- 1-D int array `[B]`: one id per sample (-1 = the sample has no id), so a
  flat `[B * L]` array is B * L samples (a batch-size error), never reshaped;
- 2-D int array `[B, L]` (L may be 0): -1 is padding (the column index is the
  sequence position, so a -1 in the middle leaves a zero position);
- ragged: a *list* of B 1-D int arrays, or a *tuple* `(values, row_lengths)`.
  Ragged input has no padding value: every id must be valid.

A list holds one row per sample (all 1-D: ragged) or one id per sample (all
scalars: dense `[B]`); anything else (a 2-D or unevenly nested row, rows
mixed with scalars) is an error naming the sample, as is any input numpy
cannot read as an array. uint64 ids must be < 2**63 (int64 would wrap them).

(`serving_lookup` also takes SparseTensor-style COO; see `io.serving`.)

Two stages. `canonical` checks the structure (types, shapes, batch size)
and turns every format into dense `[B, L]` or ragged `(values, lengths)`
arrays; it works on numpy arrays (host preprocessing) and on jax arrays,
traced ones included (the serving lookup under jit), where only what is
static can be checked. Then `checked` (the C extension) or `flatten`
(numpy) checks every id against the vocabulary and every weight for
NaN/inf, with the same errors.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from sparse_embed.core.specs import FeatureSpec
from sparse_embed.host import native

PADDING_ID = -1
INT64_MAX = 2**63 - 1
_UINT64 = np.dtype(np.uint64)


class FlatIds(NamedTuple):
    """A feature's valid ids, flattened in sample-major order. All `[N]`."""

    ids: np.ndarray  # int64, in [0, vocabulary_size)
    weights: np.ndarray  # float32, finite
    samples: np.ndarray  # int64 sample index in [0, batch)
    positions: np.ndarray  # int64 position within the sample (sequence features)


class CanonicalIds(NamedTuple):
    """A feature's ids after the structure checks: dense `[B, L]` (-1 = padding) or ragged `[N]`.

    Host arrays are C-contiguous, so the C extension reads them in place.
    """

    ids: Any  # int32 or int64 [B, L] or [N]
    weights: Any | None  # float32, the shape of ids; None = all 1
    lengths: Any | None  # int [B] ids per sample (ragged); None = dense

    @property
    def dense(self) -> bool:
        return self.lengths is None

    @property
    def batch(self) -> int:
        return self.ids.shape[0] if self.dense else self.lengths.shape[0]

    def sample_of(self, i: int) -> int:
        """The sample of the i-th id (flat index into `ids`)."""
        if self.dense:
            return i // self.ids.shape[1]
        return int(np.searchsorted(np.cumsum(self.lengths), i, side="right"))


def truncated(feature: FeatureSpec, x: FlatIds | CanonicalIds) -> int:
    """How many of a sequence feature's ids lie past its `max_sequence_length` (a sample's position L and on):
    preprocessing leaves them out of the batch and counts them (`Stats.truncated_ids`); 0 for other features."""
    L = feature.max_sequence_length
    if not feature.is_sequence:
        return 0
    if isinstance(x, FlatIds):
        return int(np.count_nonzero(x.positions >= L))
    if x.dense:
        return int(np.count_nonzero(np.asarray(x.ids)[:, L:] != PADDING_ID))
    return int(np.maximum(np.asarray(x.lengths, np.int64) - L, 0).sum())


class FeatureInputError(ValueError):
    """A feature's input is malformed (the message names the feature and its table)."""


def error(feature: FeatureSpec, msg: str) -> FeatureInputError:
    """A ValueError that names the feature and its table."""
    return FeatureInputError(f"Feature {feature.name!r} (table {feature.table.name!r}): {msg}")


def _bad_id(feature: FeatureSpec, value: int, sample: int, padding_ok: bool) -> ValueError:
    why = "negative ids are not allowed" + (" (only -1 is padding, in dense input)" if padding_ok else " in ragged input")
    if value >= 0:
        why = f"ids must be < vocabulary_size {feature.table.vocabulary_size}"
    return error(feature, f"id {value} in sample {sample} is out of range: {why}.")


def _bad_weight(feature: FeatureSpec, weight: np.float32, sample: int) -> ValueError:
    why = " (weights are float32: past +-3.4e38 they are inf)" if np.isinf(weight) else ""
    return error(feature, f"weight {weight} for sample {sample} is not finite{why}.")


# a float32 running sum of N >= 0 terms rounds up by at most ~N * 6e-8 relative: 1% below float32's max, it is finite
_SUM_LIMIT = 0.99 * float(np.finfo(np.float32).max)


def check_divisors(feature: FeatureSpec, weights: np.ndarray, most: int,
                   entries: Callable[[], tuple[np.ndarray, np.ndarray]]) -> None:
    """mean / sqrtn: each output row's divisor (`Σw`, `√Σw²`) is summed in float32; finite weights whose sum (of
    |w| or w²) passes float32's range would make it inf and the row's activation silently 0: a ValueError.

    `weights`: the feature's finite float32 weights, any shape (padding's too: they only bound the sums);
    `most`: the most ids a sample has; `entries()`: `(w [N], samples [N])` of its ids, taken only when that bound
    says a sum may pass. A sequence feature's rows are its positions: one id each.
    """
    combiner = feature.table.combiner
    if combiner == "sum" or weights.size == 0:
        return
    seq = bool(feature.max_sequence_length)
    top = float(np.max(np.abs(weights)))
    if (top if combiner == "mean" else top * top) * (1 if seq else most) < _SUM_LIMIT:
        return
    w, samples = entries()
    per_id = np.abs(w.astype(np.float64)) if combiner == "mean" else np.square(w.astype(np.float64))
    sums = per_id if seq else np.bincount(samples, per_id)
    if (sums < _SUM_LIMIT).all():
        return
    k = int(np.argmax(sums >= _SUM_LIMIT))
    what = "absolute weights" if combiner == "mean" else "squared weights"
    raise error(feature, f"the {what} of sample {int(samples[k]) if seq else k} sum to {sums[k]:.3g}, past "
                         f"float32's range (the {combiner} combiner divides by that sum, in float32): scale the "
                         "weights down.")


def _concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _read(feature: FeatureSpec, x: Any, what: str, xp) -> Any:
    """x as an array (traced arrays as they are): a named error where numpy or jax can make none of it
    (nested unevenly, say), instead of theirs."""
    if not _concrete(x):
        return x
    try:
        return xp.asarray(x)
    except (ValueError, TypeError, OverflowError) as e:
        raise error(feature, f"{what} could not be read as an array: {e}") from e


def _int_array(feature: FeatureSpec, x: Any, what: str, xp) -> Any:
    """x as int32 or int64 (other integer dtypes become int64; jax arrays keep their int dtype)."""
    return _as_int(feature, _read(feature, x, what, xp), what, xp)


def _as_int(feature: FeatureSpec, a: Any, what: str, xp) -> Any:
    """`_int_array` of an array `_read` made."""
    if a.dtype == object:
        raise error(feature, f"{what} must be integers, got dtype object (values past int64, None or other "
                             "objects; ragged rows go in a list).")
    if a.dtype == bool or not np.issubdtype(a.dtype, np.integer):
        if a.size == 0 and a.dtype in (np.float64, np.float32):  # np.asarray([]) is float64
            return a.astype(np.int32 if xp is not np else np.int64)
        raise error(feature, f"{what} must be integers, got dtype {a.dtype}.")
    return a if xp is not np or a.dtype in (np.int32, np.int64) else a.astype(np.int64)


def _id_array(feature: FeatureSpec, x: Any, what: str, xp, sample: int | None = None) -> Any:
    """`_int_array` for ids: uint64 ids past int64 are out of range (the cast would wrap 2**64 - 1 to -1, padding).

    Costs a pass over the ids only for uint64 input.
    """
    a = _read(feature, x, what, xp)
    top = None
    if a.dtype == _UINT64 and _concrete(a) and a.size:
        top = int(a.max())
    elif a.dtype.kind in "fO" and isinstance(x, (list, tuple)):  # numpy reads Python ints past int64 as floats
        values = python_ints(x)
        top = None if values is None else max(values.flat, default=None)
    if top is not None and top > INT64_MAX:
        if feature.table.dynamic is not None:
            raise error(feature, f"raw id {top} is out of range: raw ids must be < 2**63.")
        where = "" if sample is None else f" in sample {sample}"
        raise error(feature, f"id {top}{where} is out of range: ids must be < vocabulary_size "
                             f"{feature.table.vocabulary_size}.")
    return _as_int(feature, a, what, xp)


def python_ints(x: Any) -> np.ndarray | None:
    """A (nested) list of ints that numpy reads as floats or objects (Python ints past int64 beside others, numpy's
    uint64 beside int64) as an object array of Python ints; None if it holds anything else."""
    try:
        values = np.asarray(x, dtype=object)
    except (ValueError, TypeError):
        return None
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in values.flat):
        return None
    return np.vectorize(int, otypes=[object])(values) if values.size else values


def _float_array(feature: FeatureSpec, x: Any, shape: tuple[int, ...], what: str, xp) -> Any:
    a = _read(feature, x, what, xp)
    if a.dtype == object or a.dtype == bool or not (np.issubdtype(a.dtype, np.floating)
                                                    or np.issubdtype(a.dtype, np.integer)):
        raise error(feature, f"{what} must be numbers, got dtype {a.dtype}.")
    if tuple(a.shape) != tuple(shape):
        raise error(feature, f"{what} have shape {tuple(a.shape)}, but the ids have shape {tuple(shape)}.")
    return a if a.dtype == np.float32 else a.astype(np.float32)


def _row_ndim(row: Any) -> int | None:
    """A list element's number of dimensions as numpy reads it; None if it is nested unevenly."""
    try:
        return np.ndim(row)
    except (ValueError, TypeError):  # numpy: "setting an array element with a sequence... inhomogeneous"
        return None


def _row_kind(row: Any, ndim: int | None) -> str:
    """What a list element that is not a 1-D row is, for the error."""
    if ndim is None:
        return "are nested unevenly"
    return "are a single value, not a row" if ndim == 0 else f"are {ndim}-D, shape {np.shape(row)}"


def structure(feature: FeatureSpec, x: Any, what: str = "ids") -> str:
    """Which input format `x` is: "pair" (a tuple), "list" (ragged rows) or "dense".

    A non-empty list must be all 1-D rows (ragged) or all scalars (dense `[B]`): else a
    ValueError naming the first sample that is neither (numpy's own error names nothing).
    """
    if isinstance(x, tuple):
        return "pair"
    if not isinstance(x, list) or not x:
        return "dense"
    dims = [_row_ndim(r) for r in x]
    if all(d == 1 for d in dims):
        return "list"
    if all(d == 0 for d in dims):
        return "dense"
    want = 1 if 1 in dims else 0  # rows (ragged) if any sample has one, else one id per sample
    i = next(i for i, d in enumerate(dims) if d != want)
    raise error(feature, f"{what} of sample {i} {_row_kind(x[i], dims[i])}: a list holds one 1-D row per sample "
                         "(ragged) or one value per sample.")


def fixed_width(x: Any) -> int | None:
    """Id slots per sample of dense input (`[B]`: 1, `[B, L]`: L); None for ragged input, whose count varies.

    For input `canonical` accepted: it bounds the ids of every batch of that shape. O(1), unlike `structure`
    (which looks at every row of a list): an accepted list is ragged rows, or a dense `[B]` of scalars.
    """
    if isinstance(x, tuple) or (isinstance(x, list) and len(x) > 0 and np.ndim(x[0]) == 1):
        return None
    shape = np.shape(x) if not isinstance(x, list) else (len(x),)
    return 1 if len(shape) == 1 else int(shape[1])


def _check_lengths(feature: FeatureSpec, values: Any, lengths: Any) -> None:
    if lengths.ndim != 1 or values.ndim != 1:
        raise error(feature, "ragged (values, row_lengths) must both be 1-D.")
    if _concrete(lengths):
        if (np.asarray(lengths) < 0).any():
            raise error(feature, "row_lengths must be >= 0.")
        if int(np.asarray(lengths).sum()) != values.shape[0]:
            raise error(feature, f"row_lengths sum to {int(np.asarray(lengths).sum())} but there are "
                                 f"{values.shape[0]} values.")


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
    ext = native.extension()
    if ext is None or not ids or not (weights is None or isinstance(weights, list)):
        return None
    got = ext.concat_rows(ids, "ilq")
    if got is None:
        return None
    w = None
    if weights is not None:
        got_w = ext.concat_rows(weights, "fd") if len(weights) == len(ids) else None
        if got_w is None or got_w[2] != got[2]:
            return None
        w = np.frombuffer(got_w[1], got_w[0]).astype(np.float32, copy=False)
    return np.frombuffer(got[1], got[0]), np.frombuffer(got[2], np.int64), w


def _pair(feature: FeatureSpec, ids: tuple, weights: Any, xp) -> tuple:
    """(values, lengths, weights) of ragged `(values, row_lengths)` input."""
    if len(ids) != 2:
        raise error(feature, f"a ragged tuple must be (values, row_lengths), got a tuple of {len(ids)}.")
    values = _id_array(feature, ids[0], "ids", xp)
    lengths = _int_array(feature, ids[1], "row_lengths", xp)
    if xp is np:
        lengths = lengths.astype(np.int64, copy=False)
    _check_lengths(feature, values, lengths)
    if weights is None:
        return values, lengths, None
    if not isinstance(weights, tuple) or len(weights) != 2:
        raise error(feature, "weights must be (values, row_lengths) like the ids.")
    w_lengths = _int_array(feature, weights[1], "weights' row_lengths", xp)
    if _concrete(w_lengths) and _concrete(lengths) and not np.array_equal(np.asarray(w_lengths), np.asarray(lengths)):
        raise error(feature, "weights' row_lengths differ from the ids' row_lengths.")
    return values, lengths, _float_array(feature, weights[0], values.shape, "weights", xp)


def _list(feature: FeatureSpec, ids: list, weights: Any, xp) -> tuple:
    """(values, lengths, weights) of a ragged list of rows."""
    rows = [_id_array(feature, r, f"ids of sample {i}", xp, i) for i, r in enumerate(ids)]
    lengths = np.array([r.shape[0] for r in rows], np.int64)
    values = xp.concatenate(rows) if rows else xp.zeros((0,), np.int32)
    if weights is None:
        return values, lengths, None
    if len(weights) != len(rows):
        raise error(feature, f"weights have {len(weights)} rows but ids have {len(rows)}.")
    w = [_float_array(feature, wr, r.shape, f"weights of sample {i}", xp) for i, (wr, r) in enumerate(zip(weights, rows))]
    return values, lengths, xp.concatenate(w)


def _dense(feature: FeatureSpec, ids: Any, weights: Any, xp) -> tuple:
    """(values [B] or [B, L], None, weights) of dense input."""
    a = _id_array(feature, ids, "ids", xp)
    if a.ndim not in (1, 2):
        raise error(feature, f"dense ids must be 1-D [batch] or 2-D [batch, L], got shape {tuple(a.shape)}.")
    return a, None, None if weights is None else _float_array(feature, weights, a.shape, "weights", xp)


def _parse(feature: FeatureSpec, ids: Any, weights: Any, xp) -> tuple:
    """(values, lengths, weights) of any input format (lengths None: dense)."""
    fast = _native_rows(ids, weights) if xp is np and isinstance(ids, list) else None  # skips a loop over rows
    if fast is not None:
        return fast
    kind = structure(feature, ids)
    w_kind = kind if weights is None else structure(feature, weights, "weights")
    if w_kind != kind:
        raise error(feature, f"weights are {w_kind} but ids are {kind}; give them the same structure.")
    return {"pair": _pair, "list": _list, "dense": _dense}[kind](feature, ids, weights, xp)


def canonical(feature: FeatureSpec, ids: Any, weights: Any = None, *, xp=np, check_batch: bool = True) -> CanonicalIds:
    """Checks the structure, dtypes and shapes; every id format -> dense `[B, L]` or ragged arrays.

    `xp` is numpy (host) or jax.numpy (the ids may then be traced);
    `check_batch` requires `B == feature.batch_size`. A dense `[B]` becomes
    `[B, 1]`.
    """
    # Weights past float32's range become inf, which the finite checks name: not numpy's overflow warning (an
    # exception under `-W error`). One context for the feature, not one per row.
    with np.errstate(over="ignore"):
        values, lengths, w = _parse(feature, ids, weights, xp)
    one_d = lengths is None and values.ndim == 1
    batch = values.shape[0] if lengths is None else lengths.shape[0]
    if check_batch and batch != feature.batch_size:
        raise error(feature, _batch_size_message(feature, batch, one_d))
    if one_d:  # [B] = [B, 1]
        values, w = values[:, None], None if w is None else w[:, None]
    if xp is np:
        values, w = np.ascontiguousarray(values), None if w is None else np.ascontiguousarray(w)
    return CanonicalIds(values, w, lengths)


def checked(feature: FeatureSpec, ids: Any, weights: Any = None, *, raw: bool = False) -> CanonicalIds:
    """`flatten`'s checks, with the same errors, in C and without flattening: preprocessing's native input.

    Needs the C extension (`native.extension()` is not None). `raw`: as `flatten`'s.
    """
    return validated(feature, canonical(feature, ids, weights), raw=raw)


def validated(feature: FeatureSpec, c: CanonicalIds, *, raw: bool = False) -> CanonicalIds:
    """`checked` of ids `canonical` already read (`raw_ids` adds its own checks in between)."""
    vocab = -1 if raw else feature.table.vocabulary_size  # -1: any id in [0, 2**63)
    bad_id, bad_weight = native.extension().validate(c.ids, c.weights, vocab, c.dense)
    if bad_id >= 0:
        raise _bad_id(feature, int(c.ids.flat[bad_id]), c.sample_of(bad_id), c.dense)
    if bad_weight >= 0:
        raise _bad_weight(feature, c.weights.flat[bad_weight], c.sample_of(bad_weight))
    if c.weights is not None:
        check_divisors(feature, c.weights, c.ids.shape[1] if c.dense else int(c.lengths.max(initial=0)),
                       lambda: _weighted_entries(c))
    return c


def _weighted_entries(c: CanonicalIds) -> tuple[np.ndarray, np.ndarray]:
    """`(weights [N], samples [N])` of the ids that are not padding."""
    if c.dense:
        keep = c.ids != PADDING_ID
        return c.weights[keep], np.nonzero(keep)[0]
    return c.weights, np.repeat(np.arange(c.lengths.size), c.lengths)


def flatten(feature: FeatureSpec, ids: Any, weights: Any = None, *, raw: bool = False) -> FlatIds:
    """Validates one feature's ids (and weights) and flattens them. Batch = `FeatureSpec.batch_size`.

    `raw`: the ids are raw ids of a `dynamic` table (any int64 >= 0), not rows.
    """
    return flattened(feature, canonical(feature, ids, weights), raw=raw)


def flattened(feature: FeatureSpec, c: CanonicalIds, *, raw: bool = False) -> FlatIds:
    """`flatten` of ids `canonical` already read."""
    if c.dense:
        keep = c.ids != PADDING_ID
        samples, positions = np.nonzero(keep)
        values, w = c.ids[keep], None if c.weights is None else c.weights[keep]
    else:
        values, w = c.ids, c.weights
        samples = np.repeat(np.arange(c.lengths.size, dtype=np.int64), c.lengths)
        positions = np.arange(values.size, dtype=np.int64) - np.repeat(np.cumsum(c.lengths) - c.lengths, c.lengths)
    bad = (values < 0) if raw else (values < 0) | (values >= feature.table.vocabulary_size)
    if bad.any():
        i = int(np.argmax(bad))
        raise _bad_id(feature, int(values[i]), int(samples[i]), c.dense)
    if w is None:
        w = np.ones(values.shape, np.float32)
    elif not np.isfinite(w).all():
        i = int(np.argmax(~np.isfinite(w)))
        raise _bad_weight(feature, w[i], int(samples[i]))
    else:
        check_divisors(feature, w, c.ids.shape[1] if c.dense else int(c.lengths.max(initial=0)), lambda: (w, samples))
    return FlatIds(values.astype(np.int64, copy=False), w, samples.astype(np.int64, copy=False),
                   positions.astype(np.int64, copy=False))
