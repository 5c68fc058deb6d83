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

- `"error"` (default): an eager call raises a ValueError naming the feature,
  table, id and sample; inside `jit` (values unknown) the activations of the
  affected samples are NaN, so they cannot pass unnoticed;
- `"zero"`: the id looks up a zero vector (its weight still counts in the
  combiner, as a default vector of zeros would);
- a `[dim]` array: the id looks up that default vector.

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

from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparse_embed.inputs import PADDING_ID
from sparse_embed.specs import FeatureSpec

OOV_POLICIES = ("error", "zero")


class Entries(NamedTuple):
    """One feature's ids as flat entries, all `[N]` (padding entries have `valid == False`)."""

    ids: jax.Array
    weights: jax.Array
    samples: jax.Array
    positions: jax.Array
    valid: jax.Array
    batch: int  # static


def _err(feature: FeatureSpec, msg: str) -> ValueError:
    return ValueError(f"Feature {feature.name!r} (table {feature.table.name!r}): {msg}")


def _weights_values(feature: FeatureSpec, weights: Any, kind: str, n_shape) -> jax.Array:
    if weights is None:
        return jnp.ones(n_shape, jnp.float32)
    if kind == "coo":
        weights = weights[1] if isinstance(weights, tuple) else weights
    elif kind == "pair":
        weights = weights[0] if isinstance(weights, tuple) else weights
    elif kind == "list":
        weights = jnp.concatenate([jnp.asarray(w, jnp.float32).reshape(-1) for w in weights])
    w = jnp.asarray(weights, jnp.float32)
    if w.shape != tuple(n_shape):
        raise _err(feature, f"weights have shape {w.shape}, but the ids have shape {tuple(n_shape)}.")
    return w


def entries(feature: FeatureSpec, ids: Any, weights: Any = None) -> Entries:
    """Any supported id format -> `Entries` (jit-compatible except that shapes must be static)."""
    if isinstance(ids, tuple) and len(ids) == 3:  # COO
        indices, values, dense_shape = ids
        indices, values = jnp.asarray(indices), jnp.asarray(values)
        if indices.ndim != 2 or indices.shape[1] != 2 or values.shape != indices.shape[:1]:
            raise _err(feature, f"COO ids need indices [N, 2] and values [N], got {indices.shape} and {values.shape}.")
        traced = any(isinstance(d, jax.core.Tracer) for d in jax.tree.leaves(dense_shape))
        batch = feature.batch_size if traced else int(np.asarray(dense_shape)[0])
        w = _weights_values(feature, weights, "coo", values.shape)
        return Entries(values, w, indices[:, 0], indices[:, 1], jnp.ones(values.shape, bool), batch)
    if isinstance(ids, tuple):
        if len(ids) != 2:
            raise _err(feature, f"a ragged tuple must be (values, row_lengths), got a tuple of {len(ids)}.")
        values, lengths = jnp.asarray(ids[0]), jnp.asarray(ids[1])
        n = values.shape[0]
        samples = jnp.repeat(jnp.arange(lengths.shape[0]), lengths, total_repeat_length=n)
        starts = jnp.cumsum(lengths) - lengths
        positions = jnp.arange(n) - starts[samples]
        w = _weights_values(feature, weights, "pair", values.shape)
        return Entries(values, w, samples, positions, jnp.ones((n,), bool), lengths.shape[0])
    if isinstance(ids, list):
        lengths = np.array([np.shape(r)[0] for r in ids], np.int32)
        values = jnp.concatenate([jnp.asarray(r).reshape(-1) for r in ids]) if ids else jnp.zeros((0,), jnp.int32)
        e = entries(feature, (values, lengths), None)
        return e._replace(weights=_weights_values(feature, weights, "list", values.shape))
    a = jnp.asarray(ids)
    if a.ndim not in (1, 2) or not jnp.issubdtype(a.dtype, jnp.integer):
        raise _err(feature, f"dense ids must be an int [B] or [B, L] array, got {a.dtype} {a.shape}.")
    w = _weights_values(feature, weights, "dense", a.shape).reshape(-1)
    a2 = a.reshape(a.shape[0], -1)
    B, L = a2.shape
    return Entries(a2.reshape(-1), w, jnp.repeat(jnp.arange(B), L), jnp.tile(jnp.arange(L), B),
                   a2.reshape(-1) != PADDING_ID, B)


def _check_oov_eagerly(feature: FeatureSpec, e: Entries) -> None:
    if isinstance(e.ids, jax.core.Tracer) or isinstance(e.valid, jax.core.Tracer):
        return
    ids, valid = np.asarray(e.ids), np.asarray(e.valid)
    bad = valid & ((ids < 0) | (ids >= feature.table.vocabulary_size))
    if bad.any():
        i = int(np.argmax(bad))
        raise _err(feature, f"id {int(ids[i])} in sample {int(np.asarray(e.samples)[i])} is out of vocabulary "
                            f"[0, {feature.table.vocabulary_size}); pass oov='zero' or a default vector to serve it.")


def _rows(table: jax.Array, ids: jax.Array, oov: Any, max_norm: float | None) -> jax.Array:
    """Looked-up rows `[N, dim]`: f32, OOV ids replaced per policy, clipped to max_norm."""
    vocab = table.shape[0]
    in_vocab = (ids >= 0) & (ids < vocab)
    rows = jnp.take(table, jnp.where(in_vocab, ids, 0), axis=0).astype(jnp.float32)
    if isinstance(oov, str):
        default = jnp.full((table.shape[1],), jnp.nan if oov == "error" else 0.0, jnp.float32)
    else:
        default = jnp.asarray(oov, jnp.float32)
    rows = jnp.where(in_vocab[:, None], rows, default[None, :])
    if max_norm is not None:
        norm = jnp.sqrt(jnp.sum(rows * rows, axis=-1, keepdims=True))
        rows = rows * jnp.where(norm > max_norm, max_norm / jnp.where(norm > 0, norm, 1.0), 1.0)
    return rows


def _gains(combiner: str, w: jax.Array, out_row: jax.Array, n_rows: int) -> jax.Array:
    if combiner == "sum":
        return w
    if combiner == "mean":
        denom = jax.ops.segment_sum(w, out_row, n_rows + 1)[out_row]
    else:
        denom = jnp.sqrt(jax.ops.segment_sum(w * w, out_row, n_rows + 1))[out_row]
    return jnp.where(denom != 0, w / jnp.where(denom != 0, denom, 1.0), 0.0)


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
    """One feature's activations: `[B, dim]` pooled, or `[B, max_sequence_length, dim]` (float32)."""
    t = feature.table
    if tuple(table.shape) != (t.vocabulary_size, t.embedding_dim):
        raise _err(feature, f"the table array has shape {tuple(table.shape)}, expected "
                            f"{(t.vocabulary_size, t.embedding_dim)}.")
    oov = _resolve_oov(oov, t.name, t.embedding_dim)
    e = entries(feature, ids, weights)
    if isinstance(oov, str) and oov == "error":
        _check_oov_eagerly(feature, e)
    L = feature.max_sequence_length
    valid = e.valid & (e.positions < L) if L else e.valid
    n_rows = e.batch * max(L, 1)
    out_row = jnp.where(valid, e.samples * L + e.positions if L else e.samples, n_rows)  # n_rows: dropped
    w = jnp.where(valid, e.weights, 0.0)
    rows = _rows(table, e.ids, oov, t.max_norm)
    contrib = rows * _gains(t.combiner, w, out_row, n_rows)[:, None]
    contrib = jnp.where(valid[:, None], contrib, 0.0)  # padding never contributes (even NaN rows)
    out = jax.ops.segment_sum(contrib, out_row, n_rows + 1)[:n_rows]
    return out.reshape((e.batch, L, t.embedding_dim) if L else (e.batch, t.embedding_dim))


def serving_lookup(
    features: Mapping[str, FeatureSpec] | Sequence[FeatureSpec],
    tables: Mapping[str, jax.Array],
    ids: Mapping[str, Any],
    weights: Mapping[str, Any] | None = None,
    *,
    oov: Any = "error",
) -> dict[str, jax.Array]:
    """`{feature: activations}` from per-table `{table: [vocab, dim]}` arrays, on one device.

    Args:
      features: the FeatureSpecs (static; their tables give combiner,
        max_norm and vocabulary).
      tables: `{table_name: [vocabulary_size, dim]}` arrays (any float dtype).
      ids / weights: `{feature: ids}` in any format of this module's doc.
      oov: "error", "zero", a `[dim]` default vector, or `{table: policy}`
        (tables not named get "error").

    Returns `[B, dim]` or `[B, max_sequence_length, dim]` float32 per feature,
    equal to `lookup` on the same tables and ids.
    """
    feats = dict(features) if isinstance(features, Mapping) else {f.name: f for f in features}
    unknown, missing = sorted(set(ids) - set(feats)), sorted(set(feats) - set(ids))
    if unknown or missing:
        raise ValueError(f"ids have unknown features {unknown} and lack {missing}; features are {sorted(feats)}.")
    weights = weights or {}
    out = {}
    for name, f in feats.items():
        if f.table.name not in tables:
            raise _err(f, f"no array for the table in tables (it has {sorted(tables)}).")
        out[name] = lookup_feature(f, jnp.asarray(tables[f.table.name]), ids[name], weights.get(name), oov=oov)
    return out
