"""The input format of jax-tpu-embedding's SparseCore primitives, built from sparse_embed features. Host numpy.

On G devices with S SparseCores each (`num_sc = G * S`), a stack's batch
is cut into `num_sc` slices: SparseCore `q` (device `q // S`) gets samples
`[q * b_f, (q + 1) * b_f)` of every feature `f` (`b_f = batch_f / num_sc`),
stacked by feature name (`sample_id` = the feature's offset in the slice +
the sample's index in it). Each id goes to the SparseCore that owns its
row: with the table's `JteTableLayout`, `r = id + row_offset_in_shard *
num_sc`, partition `p = (r % num_sc + shard_rotation) % num_sc`, local row
`embedding_id = r // num_sc`.

A slice's entries are grouped by partition `p = 0 .. num_sc-1`, each group
sorted by `(embedding_id, sample_id)` and starting at a multiple of 8;
`row_pointers[p]` is the end of group p (padding pointers up to 8 repeat
the end, rounded up to 8), and the gaps hold `PAD_ID` / NaN. Duplicate ids
of one sample are one entry whose gain is the sum of theirs; the gains
carry the combiner, in float32 as jax-tpu-embedding computes them (so
bitwise equal; `host.gains`), except that a sample whose divisor (`Σw` or
`√Σw²`) is 0 gets gains 0 (jax-tpu-embedding: inf/NaN).

A sequence feature (batch B, length L) is B * L samples of one id each:
position j of sample i is sample `i * L + j`; ids past L are dropped.

This is what jax-tpu-embedding's own preprocessing produces (a test
compares them); the ids are validated as `preprocess` validates them.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from sparse_embed.core.specs import FeatureSpec
from sparse_embed.host.csr import CsrBatch, pack_csr
from sparse_embed.host.gains import fold
from sparse_embed.host.gains import gains as combiner_gains
from sparse_embed.host.ids import flatten
from sparse_embed.integrations.jte import JteTableLayout


def _rows(feature: FeatureSpec) -> int:
    """Samples of a feature in the SparseCore input: a sequence feature's B * L positions are samples."""
    return feature.batch_size * max(feature.max_sequence_length, 1)


def _entries(feature: FeatureSpec, t: JteTableLayout, ids: Any, weights: Any, num_sc: int, offset: int) -> tuple:
    """One feature's entries after in-sample deduplication: `(slice, partition, embedding_id, sample_id, gain)`.

    A sequence feature of batch B and length L is B * L samples of one id
    each: position j of sample i is sample `i * L + j` (ids past L are
    dropped, as `preprocess` drops them). Its slice holds `offset` samples
    of the stack's features before it.
    """
    if feature.table.dynamic is not None:
        raise ValueError(f"Feature {feature.name!r}: table {feature.table.name!r} is keyed by raw ids (dynamic=); "
                         "the SparseCore input takes rows.")
    if feature.table.vocabulary_size != t.vocabulary_size:
        raise ValueError(f"Feature {feature.name!r}: table {t.name!r} has {feature.table.vocabulary_size} rows, "
                         f"its layout {t.vocabulary_size}.")
    n = _rows(feature)
    if n % num_sc:
        raise ValueError(f"Feature {feature.name!r}: {n} samples are not a multiple of {num_sc} SparseCores.")
    flat = flatten(feature, ids, weights)
    samples, natural, w = flat.samples, flat.ids, flat.weights
    if feature.is_sequence:
        L, keep = feature.max_sequence_length, flat.positions < feature.max_sequence_length
        samples, natural, w = samples[keep] * L + flat.positions[keep], natural[keep], w[keep]
    key, where = np.unique(samples * t.padded_vocab_size + natural, return_inverse=True)
    gains = fold(combiner_gains(feature.table.combiner, w, samples, n), where.reshape(-1), key.size, np.add)
    samples, rows = np.divmod(key, t.padded_vocab_size)
    rows = rows + t.row_offset_in_shard * num_sc
    b = n // num_sc
    return samples // b, (rows % num_sc + t.shard_rotation) % num_sc, rows // num_sc, offset + samples % b, gains


def sparsecore_csr(features: Mapping[str, FeatureSpec], layout: Sequence[JteTableLayout], ids: Mapping[str, Any],
                   weights: Mapping[str, Any] | None = None, *, num_devices: int, sc_per_device: int,
                   max_ids_per_partition: int, max_unique_ids_per_partition: int | None = None
                   ) -> dict[str, CsrBatch]:
    """`{stack: CsrBatch}` for the global batch `ids` (`{feature: ids}` in any input format `preprocess` takes).

    `layout`: the tables' `JteTableLayout`s for `num_devices * sc_per_device`
    shards (`jte_layout(..., rotation=sc_per_device)` or
    `jte_layout_from_specs`). The ids are validated as `preprocess` does,
    with its errors. A partition with more entries (or distinct ids) than
    the limits is a ValueError naming the stack.
    """
    weights = weights or {}
    where = {t.name: t for t in layout}
    missing = sorted({f.table.name for f in features.values()} - set(where))
    if missing:
        raise ValueError(f"sparsecore_csr: the layout has no tables {missing}.")
    missing = sorted(set(features) - set(ids))
    if missing:
        raise ValueError(f"sparsecore_csr: no ids for features {missing}.")
    num_sc = num_devices * sc_per_device
    out = {}
    for stack in dict.fromkeys(t.stack_name for t in layout):
        feats = sorted((f for f in features.values() if where[f.table.name].stack_name == stack), key=lambda f: f.name)
        if not feats:
            continue
        parts, offset = [], 0
        for f in feats:
            parts.append(_entries(f, where[f.table.name], ids[f.name], weights.get(f.name), num_sc, offset))
            offset += _rows(f) // num_sc
        q, p, eid, sid, gain = (np.concatenate(x) for x in zip(*parts))
        out[stack] = pack_csr(stack, q, p, eid, sid, gain, num_sc, num_sc, max_ids_per_partition,
                              max_ids_per_partition if max_unique_ids_per_partition is None
                              else max_unique_ids_per_partition)
    return out
