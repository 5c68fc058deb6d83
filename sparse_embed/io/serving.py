"""Single-device, jit-able lookup over per-table `{name: [vocab, dim]}` arrays, for exported models.

It computes what `lookup` computes (same combiners, weights, max_norm and
sequence features) without a plan, a mesh or host preprocessing, so it can be
jitted and exported with `jax.export`. Ids may be, per feature:

- dense `[B]` or `[B, L]` int arrays, `-1` = padding (the column is the sequence position);
- a ragged list of B 1-D arrays, or a `(values [N], row_lengths [B])` tuple;
- SparseTensor-style COO `(indices [N, 2], values [N], dense_shape)`: `indices[:, 0]`
  is the sample, `indices[:, 1]` the position; the batch size is
  `dense_shape[0]`, or `FeatureSpec.batch_size` when `dense_shape` is traced.

`weights` has the same structure (for COO, the weights' `values` are used).
Otherwise the batch size is the input's, not `FeatureSpec.batch_size`.

Out-of-vocabulary ids (`< 0` other than dense padding, or `>= vocabulary_size`)
follow a per-table policy, as a serving parameter server's default vector:

- `"error"` (default; a raw-id table whose `Dynamic.default` is set reads
  that vector instead, as `lookup` does): an eager call raises a ValueError naming the feature,
  table, id and sample; inside `jit` (values unknown) the activations of the
  affected samples are NaN, so they cannot pass unnoticed;
- `"zero"`: the id looks up a zero vector (its weight still counts in the
  combiner, as a default vector of zeros would);
- a `[dim]` array: the id looks up that default vector.

A default vector is read as given: `max_norm` clips the table's rows, not
it (as `lookup` reads a raw-id table's `Dynamic.default`).

Example (export, serialise, reload, run):

    >>> import jax, numpy as np, sparse_embed as se
    >>> t = se.TableSpec("items", 100, 4, combiner="sum")
    >>> features = {"clicked": se.FeatureSpec("clicked", t, batch_size=2)}
    >>> tables = {"items": np.ones((100, 4), np.float32)}
    >>> fn = jax.jit(lambda tables, ids: se.serving_lookup(features, tables, ids, oov="zero"))
    >>> ids = {"clicked": np.array([[3, 7], [5, -1]], np.int32)}
    >>> exported = jax.export.export(fn)(tables, ids)
    >>> reloaded = jax.export.deserialize(exported.serialize())
    >>> np.asarray(reloaded.call(tables, ids)["clicked"])[:, 0].tolist()
    [2.0, 1.0]
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparse_embed.core import pooling
from sparse_embed.core.specs import FeatureSpec, TableSpec
from sparse_embed.host.ids import PADDING_ID, canonical, check_divisors, error, python_ints
from sparse_embed.io.quantize import bits_of, dequantize, fused_width

OOV_POLICIES = ("error", "zero")


class Entries(NamedTuple):
    """One feature's ids as flat entries, all `[N]` (padding entries have `valid == False`)."""

    ids: jax.Array
    weights: jax.Array
    samples: jax.Array
    positions: jax.Array
    valid: jax.Array
    batch: int  # static
    poison: jax.Array | None = None  # under jit, COO entries outside the batch: the whole output reads NaN


def _coo_entries(feature: FeatureSpec, ids: tuple, weights: Any) -> Entries:
    """SparseTensor-style `(indices [N, 2], values [N], dense_shape)`; the weights' `values` are used."""
    indices, values, dense_shape = ids
    for what, a in (("indices", indices), ("values", values)):
        dtype = np.dtype(a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype)
        if dtype.kind not in "iu":
            raise error(feature, f"COO {what} must be integers, got {dtype}.")
    indices, values = jnp.asarray(indices), jnp.asarray(values)
    if indices.ndim != 2 or indices.shape[1] != 2 or values.shape != indices.shape[:1]:
        raise error(feature, f"COO ids need indices [N, 2] and values [N], got {indices.shape} and {values.shape}.")
    traced = any(isinstance(d, jax.core.Tracer) for d in jax.tree.leaves(dense_shape))
    batch = feature.batch_size if traced else int(np.asarray(dense_shape)[0])
    samples, positions = indices[:, 0], indices[:, 1]
    outside = (samples < 0) | (samples >= batch) | (positions < 0)  # would be dropped, or read as another sample's
    poison = None
    if isinstance(outside, jax.core.Tracer):
        poison = jnp.any(outside)
    elif np.any(outside):
        i = int(np.argmax(np.asarray(outside)))
        raise error(feature, f"COO entry {i} is at (sample {int(samples[i])}, position {int(positions[i])}): "
                             f"outside the batch's samples [0, {batch}) or at a negative position.")
    w = jnp.ones(values.shape, jnp.float32)
    if weights is not None:
        w = jnp.asarray(weights[1] if isinstance(weights, tuple) else weights, jnp.float32)
        if w.shape != values.shape:
            raise error(feature, f"weights have shape {w.shape}, but the ids have shape {values.shape}.")
    return Entries(values, w, samples, positions, ~outside, batch, poison)


def entries(feature: FeatureSpec, ids: Any, weights: Any = None) -> Entries:
    """Any supported id format -> `Entries` (jit-compatible except that shapes must be static)."""
    if isinstance(ids, tuple) and len(ids) == 3:
        return _coo_entries(feature, ids, weights)
    c = canonical(feature, ids, weights, xp=jnp, check_batch=False)
    w = jnp.ones(c.ids.shape, jnp.float32) if c.weights is None else c.weights
    if c.dense:
        B, L = c.ids.shape
        return Entries(c.ids.reshape(-1), w.reshape(-1), jnp.repeat(jnp.arange(B), L), jnp.tile(jnp.arange(L), B),
                       c.ids.reshape(-1) != PADDING_ID, B)
    n, lengths = c.ids.shape[0], jnp.asarray(c.lengths)
    samples = jnp.repeat(jnp.arange(lengths.shape[0]), lengths, total_repeat_length=n)
    positions = jnp.arange(n) - (jnp.cumsum(lengths) - lengths)[samples]
    return Entries(c.ids, w, samples, positions, jnp.ones((n,), bool), lengths.shape[0])


def _check_oov_eagerly(feature: FeatureSpec, e: Entries) -> None:
    if isinstance(e.ids, jax.core.Tracer) or isinstance(e.valid, jax.core.Tracer):
        return
    ids, valid = np.asarray(e.ids), np.asarray(e.valid)
    bad = valid & ((ids < 0) | (ids >= feature.table.vocabulary_size))
    if bad.any():
        i = int(np.argmax(bad))
        raise error(feature, f"id {int(ids[i])} in sample {int(np.asarray(e.samples)[i])} is out of vocabulary "
                            f"[0, {feature.table.vocabulary_size}); pass oov='zero' or a default vector to serve it.")


def _take(table: jax.Array, ids: jax.Array) -> jax.Array:
    """`table[ids]`; a quantized table's rows are gathered as 32-bit words where their width allows (XLA:CPU's
    gather loops over elements, so a row moved as a quarter as many words goes faster than as bytes)."""
    if table.dtype != jnp.uint8 or table.shape[1] % 4:
        return jnp.take(table, ids, axis=0)
    words = jax.lax.bitcast_convert_type(table.reshape(table.shape[0], -1, 4), jnp.uint32)
    return jax.lax.bitcast_convert_type(jnp.take(words, ids, axis=0), jnp.uint8).reshape(ids.shape[0], -1)


def _rows(table: jax.Array, dim: int, ids: jax.Array, oov: Any, max_norm: float | None) -> jax.Array:
    """Looked-up rows `[N, dim]`: f32 (quantized ones dequantized), clipped to max_norm, OOV ids replaced per
    policy (a default vector is read as given, unclipped: `lookup` adds a raw-id table's default so)."""
    vocab = table.shape[0]
    in_vocab = (ids >= 0) & (ids < vocab)
    rows = _take(table, jnp.where(in_vocab, ids, 0))
    rows = dequantize(rows, dim, jnp) if table.dtype == jnp.uint8 else rows.astype(jnp.float32)
    if isinstance(oov, str):
        default = jnp.full((dim,), jnp.nan if oov == "error" else 0.0, jnp.float32)
    else:
        default = jnp.asarray(oov, jnp.float32)
    if max_norm is not None:
        rows = rows * pooling.max_norm_scale(rows, max_norm, jnp)[0]
    return jnp.where(in_vocab[:, None], rows, default[None, :])


def _resolve_oov(oov: Any, table: str, dim: int) -> Any:
    policy = oov.get(table, "error") if isinstance(oov, Mapping) else oov
    if isinstance(policy, str):
        if policy not in OOV_POLICIES:
            raise ValueError(f"Table {table!r}: oov must be 'error', 'zero' or a [dim] vector, got {policy!r}.")
        return policy
    if np.shape(policy) != (dim,):
        raise ValueError(f"Table {table!r}: the default vector has shape {np.shape(policy)}, expected ({dim},).")
    return policy


def lookup_feature(feature: FeatureSpec, table: jax.Array, ids: Any, weights: Any = None, *,
                   oov: Any = "error") -> jax.Array:
    """One feature's activations: `[B, dim]` pooled, or `[B, max_sequence_length, dim]` (float32).

    `table`: `[vocab, dim]` floats, or a row-wise quantized table's fused rows (`uint8 [vocab, width]`,
    `io.quantize`), dequantized row by row before max_norm and pooling.
    """
    t = feature.table
    quantized = table.dtype == jnp.uint8 and bits_of(table.shape[-1], t.embedding_dim) is not None
    floats = jnp.issubdtype(table.dtype, jnp.floating) and table.shape[1:] == (t.embedding_dim,)  # (not int8 codes)
    if table.ndim != 2 or table.shape[0] != t.vocabulary_size or not (quantized or floats):
        v, d = t.vocabulary_size, t.embedding_dim
        raise error(feature, f"the table array is {table.dtype} {tuple(table.shape)}, expected a float {(v, d)} or a "
                             f"quantized uint8 {(v, fused_width(d, 8))} (int8) or {(v, fused_width(d, 4))} (int4).")
    oov = _resolve_oov(oov, t.name, t.embedding_dim)
    e = entries(feature, _each_array(ids, lambda a: _narrowed(feature, a, oov)), weights)
    if isinstance(oov, str) and oov == "error":
        _check_oov_eagerly(feature, e)
    if weights is not None and not isinstance(e.weights, jax.core.Tracer):  # (under jit: the row reads 0)
        valid = np.asarray(e.valid)
        bad = valid & ~np.isfinite(np.asarray(e.weights))  # as preprocess refuses them (padding's may be anything)
        if bad.any():
            i = int(np.argmax(bad))
            raise error(feature, f"weight {np.asarray(e.weights)[i]} for sample {int(np.asarray(e.samples)[i])} is "
                                 "not finite.")
        check_divisors(feature, np.asarray(e.weights), valid.size,
                       lambda: (np.asarray(e.weights)[valid], np.asarray(e.samples)[valid]))
    L = feature.max_sequence_length
    valid = e.valid & (e.positions < L) if L else e.valid
    n_rows = e.batch * max(L, 1)
    out_row = jnp.where(valid, e.samples * L + e.positions if L else e.samples, n_rows)  # n_rows: dropped
    w = jnp.where(valid, e.weights, 0.0)
    rows = _rows(table, t.embedding_dim, e.ids, oov, t.max_norm)
    gains = pooling.gains(t.combiner, w, out_row, n_rows + 1, jax.ops.segment_sum, jnp)  # row n_rows: dropped
    contrib = rows * gains[:, None]
    contrib = jnp.where(valid[:, None], contrib, 0.0)  # padding never contributes (even NaN rows)
    out = jax.ops.segment_sum(contrib, out_row, n_rows + 1)[:n_rows]
    out = out if e.poison is None else jnp.where(e.poison, jnp.nan, out)
    return out.reshape((e.batch, L, t.embedding_dim) if L else (e.batch, t.embedding_dim))


def _each_array(ids: Any, fn: Callable[[Any], Any]) -> Any:
    """`ids` in any format (dense, a list of rows, `(values, lengths)`, COO `(indices, values, dense_shape)`)
    with `fn` applied to its id arrays (COO: `values`, not the indices)."""
    if isinstance(ids, tuple) and len(ids) == 3:
        return (ids[0], fn(ids[1]), ids[2])
    if isinstance(ids, tuple):
        return (fn(ids[0]), *ids[1:])
    if isinstance(ids, list):
        return [fn(r) for r in ids]
    return fn(ids)


def _narrowed(feature: FeatureSpec, a: Any, oov: Any) -> Any:
    """Host ids wider than int32 (jax takes them as int32 and would wrap 2**32 + 5 to row 5, 2**64 - 1 to -1
    padding): an error naming the id (`oov="error"`), else the first id past the table (out of vocabulary,
    served by the policy). Traced ids, and ids of other dtypes, as they are."""
    vocab, top = feature.table.vocabulary_size, np.iinfo(np.int32).max
    if isinstance(a, (list, tuple, int)):  # Python ints: as numpy reads them, or (past int64) one by one
        try:
            read = np.asarray(a)
        except (ValueError, TypeError, OverflowError):
            return a  # (malformed: the reader names it)
        if read.dtype.kind in "iu":
            a = read  # (then as any host array, below)
        elif (values := python_ints(a)) is None:
            return a
        else:
            bad = np.vectorize(lambda v: not -top <= v <= top, otypes=[bool])(values)
            if np.any(bad) and isinstance(oov, str) and oov == "error":
                raise error(feature, f"id {values[bad].ravel()[0]} is out of vocabulary [0, {vocab}); pass "
                                     "oov='zero' or a default vector to serve it.")
            return np.where(bad, vocab, values).astype(np.int64)
    if isinstance(a, jax.core.Tracer) or not isinstance(a, (np.ndarray, np.integer)):
        return a
    if a.dtype.kind not in "iu" or (a.dtype.itemsize < 4 or a.dtype == np.int32):
        return a
    bad = (a > top) if a.dtype.kind == "u" else ((a < -top) | (a > top))  # (the others: checked as int32)
    if not np.any(bad):
        return a
    if isinstance(oov, str) and oov == "error":
        v = a[bad].ravel()[0]
        raise error(feature, f"id {int(v)} is out of vocabulary [0, {vocab}); pass oov='zero' or a default vector "
                             "to serve it.")
    return np.where(bad, vocab, a).astype(np.int64)


def _raw_rows(feature: FeatureSpec, known: np.ndarray, ids: Any, policy: Any) -> Any:
    """Raw ids (host arrays, any format) -> rows of the served table, same structure; unknown -> vocabulary_size.

    `known` are the table's ids, sorted: row k holds `known[k]`.
    """
    def on_host(a) -> np.ndarray:
        if isinstance(a, jax.core.Tracer):
            raise error(feature, "the table is keyed by raw ids, which are mapped to its rows on the host: call "
                                 "serving_lookup outside jit (under jit, look up the rows: io.serving.lookup_feature).")
        return np.asarray(a)

    narrow = isinstance(known, jax.Array) and known.dtype.itemsize < 8  # (jax without x64: int64 ids kept 32 bits)
    if narrow and not isinstance(known, jax.core.Tracer):  # (under jit: on_host says why it cannot be)
        raise error(feature, f"the table's raw ids are a jax {known.dtype} array: jax without x64 keeps 32 bits of "
                             "int64 ids (2**32 + 7 reads as 7), so ids would find other ids' rows or none. Give them "
                             "as load_serving returns them, a numpy int64 array (move only the table's array).")
    known = on_host(known).astype(np.int64)

    def rows(a):
        a = on_host(a)
        if a.dtype.kind not in "iu":
            raise error(feature, f"ids must be integers, got dtype {a.dtype}.")
        if a.dtype.kind == "u" and a.dtype.itemsize == 8 and (a >= 2**63).any():  # would wrap (2**64 - 1 to padding)
            raise error(feature, f"raw id {int(a[a >= 2**63].ravel()[0])} is out of range: raw ids must be < 2**63.")
        a = a.astype(np.int64)
        if known.size:
            pos = np.minimum(np.searchsorted(known, a), known.size - 1)
            found = known[pos] == a
        else:
            pos, found = np.zeros(a.shape, np.int64), np.zeros(a.shape, bool)
        if isinstance(policy, str) and policy == "error" and not (found | (a == PADDING_ID)).all():
            bad = a[~(found | (a == PADDING_ID))][0]
            raise error(feature, f"raw id {int(bad)} is not in the table (oov='error'; use 'zero' or a default "
                                 "vector for ids the table has not seen).")
        return np.where(a == PADDING_ID, PADDING_ID, np.where(found, pos, feature.table.vocabulary_size))

    return _each_array(ids, rows)


def serving_lookup(
    features: Mapping[str, FeatureSpec] | Sequence[FeatureSpec],
    tables: Mapping[str, jax.Array],
    ids: Mapping[str, Any],
    weights: Mapping[str, Any] | None = None,
    *,
    oov: Any = None,
) -> dict[str, jax.Array]:
    """`{feature: activations}` from per-table `{table: [vocab, dim]}` arrays, on one device.

    Args:
      features: the FeatureSpecs (static; their tables give combiner,
        max_norm and vocabulary).
      tables: `{table_name: [vocabulary_size, dim]}` arrays (any float dtype,
        or an int8 / int4 table's fused `uint8 [vocabulary_size, width]` rows);
        a raw-id table as `(ids, array)` from `load_serving` (its raw ids then
        must be host arrays: int64 does not survive jax without x64).
      ids / weights: `{feature: ids}` in any format of this module's doc.
      oov: "error", "zero", a `[dim]` default vector, or `{table: policy}`.
        A table it does not set (None, or a mapping without it) gets
        "error", or, a raw-id table whose `Dynamic.default` is set, that
        default vector (what `lookup` reads for ids without a row).

    Returns `[B, dim]` or `[B, max_sequence_length, dim]` float32 per feature,
    equal to `lookup` on the same tables and ids (a quantized table: on its
    dequantized rows).
    """
    feats = dict(features) if isinstance(features, Mapping) else {f.name: f for f in features}
    unknown, missing = sorted(set(ids) - set(feats)), sorted(set(feats) - set(ids))
    if unknown or missing:
        parts = [f"unknown features {unknown}"] * bool(unknown) + [f"no ids for features {missing}"] * bool(missing)
        raise ValueError(f"ids have {' and '.join(parts)}; the features are {sorted(feats)}.")
    weights = weights or {}
    if set(weights) - set(feats):
        raise ValueError(f"weights have unknown features {sorted(set(weights) - set(feats))}; features are "
                         f"{sorted(feats)}.")
    if isinstance(oov, Mapping) and set(oov) - set(tables):  # (a misspelt table would keep its default silently)
        raise ValueError(f"oov sets policies for tables {sorted(set(oov) - set(tables), key=str)} that are not in "
                         f"tables (it has {sorted(tables)}).")
    out = {}
    for name, f in feats.items():
        if f.table.name not in tables:
            raise error(f, f"no array for the table in tables (it has {sorted(tables)}).")
        table, x, policy = tables[f.table.name], ids[name], _policy(f.table, oov)
        if f.table.dynamic is not None:
            if not (isinstance(table, tuple) and len(table) == 2):
                raise error(f, "the table is keyed by raw ids: give it as (ids, array), as load_serving returns it.")
            x = _raw_rows(f, table[0], x, policy)
            table = table[1]
        elif isinstance(table, tuple):
            raise error(f, "the table is given as (ids, array), as load_serving returns a raw-id table, but its "
                           "TableSpec is not keyed by raw ids (no dynamic=): look it up with the spec load_serving "
                           "returns for it.")
        out[name] = lookup_feature(f, jnp.asarray(table), x, weights.get(name), oov=policy)
    return out


def _policy(t: TableSpec, oov: Any) -> Any:
    """Table `t`'s out-of-vocabulary policy: the one `oov` sets for it, else a raw-id table's `Dynamic.default`
    vector (as `lookup` reads it), else "error"."""
    given = oov.get(t.name) if isinstance(oov, Mapping) else oov
    if given is None and t.dynamic is not None and t.dynamic.default is not None:
        given = t.dynamic.default_vector(t.embedding_dim)
    return _resolve_oov("error" if given is None else given, t.name, t.embedding_dim)
