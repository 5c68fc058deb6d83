"""jax-tpu-embedding's stacked-and-sharded table layout (and so Keras-RS's), and its SparseCore primitives' input.

In that layout a stack is `[num_shards * rows_per_shard, stack_dim]` (or
`[num_shards, rows_per_shard, stack_dim]`): each table is padded to
`round_up(vocab, 8 * num_shards)` rows (padding rows hold `pad_value`) and
`round_up(dim, 8)` columns, MOD-sharded (id `i` -> shard `i % num_shards`,
local row `i // num_shards`), its shards rotated by `shard_rotation`, and
placed at `row_offset_in_shard` inside every shard. `JteTableLayout` records
this per table; build it from jax-tpu-embedding's own prepared `TableSpec`s
(`jte_layout_from_specs`) or compute it the way its `stack_tables` does
(`jte_layout`). Host numpy; the package itself is not needed.

    arrays = se.unstack_tables(plan, tables)                 # {table: [vocab, dim]}
    stacked = se.jte.to_jte(layout, arrays, num_shards=8)    # {stack: [8 * rows, stack_dim]}
    back = se.jte.from_jte(layout, stacked, num_shards=8)    # == arrays

`sparsecore_csr` builds the input of its SparseCore primitives for such a
layout, from sparse_embed features, without a plan (a plan with
`sparsecores=S` builds the same in `preprocess`: `host.sparsecore_input`).

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

import dataclasses
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from sparse_embed.core.planning import round_up
from sparse_embed.core.sparsecore.batch import CsrBatch
from sparse_embed.core.specs import FeatureSpec, TableSpec
from sparse_embed.core.tables import host_array
from sparse_embed.host.gains import fold
from sparse_embed.host.gains import gains as combiner_gains
from sparse_embed.host.ids import flatten
from sparse_embed.host.sparsecore_input import pack_csr


@dataclasses.dataclass(frozen=True)
class JteTableLayout:
    """Where one table lives in a jax-tpu-embedding stack."""

    name: str
    vocabulary_size: int
    embedding_dim: int
    stack_name: str
    padded_vocab_size: int  # multiple of 8 * num_shards
    stack_vocab_size: int  # rows of the whole stack (all shards)
    stack_embedding_dim: int  # multiple of 8
    row_offset_in_shard: int
    shard_rotation: int


def jte_layout_from_specs(table_specs: Iterable[Any] | Mapping[str, Any], num_shards: int
                          ) -> tuple[JteTableLayout, ...]:
    """Layouts from jax-tpu-embedding `TableSpec`s (after its `stack_tables`/`auto_stack_tables`), or the
    `{name: TableSpec}` its `embedding.get_table_specs(feature_specs)` returns."""
    out = []
    for t in table_specs.values() if isinstance(table_specs, Mapping) else table_specs:
        if not hasattr(t, "setting_in_stack"):
            raise TypeError(f"jte_layout_from_specs takes jax-tpu-embedding TableSpecs, got a {type(t).__name__} "
                            f"({t!r:.80}); for its FeatureSpecs pass embedding.get_table_specs(feature_specs).")
        # jax-tpu-embedding's `stacked_table_spec` property asserts on unstacked tables: read the field.
        st, sis = getattr(t, "_stacked_table_spec", None), t.setting_in_stack
        if st is None:  # an unstacked table: jax-tpu-embedding's default placement
            padded = round_up(t.vocabulary_size, 8 * num_shards)
            out.append(JteTableLayout(t.name, t.vocabulary_size, t.embedding_dim, t.name, padded, padded,
                                      round_up(t.embedding_dim, 8), 0, 0))
            continue
        out.append(JteTableLayout(t.name, t.vocabulary_size, t.embedding_dim, st.stack_name,
                                  sis.padded_vocab_size, st.stack_vocab_size, st.stack_embedding_dim,
                                  sis.row_offset_in_shard, sis.shard_rotation))
    return tuple(out)


def _check_shards(num_shards: Any, what: str = "num_shards") -> int:
    if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
        raise ValueError(f"{what} must be a positive int, got {num_shards!r}.")
    return int(num_shards)


def jte_layout(tables: Mapping[str, TableSpec] | Sequence[TableSpec], num_shards: int, *,
               stacking: Sequence[Sequence[str]] | None = None, rotation: int | None = None
               ) -> tuple[JteTableLayout, ...]:
    """The layout jax-tpu-embedding's `stack_tables(features, group, ...)` gives each group.

    `stacking`: groups of table names, in stack order (default: one stack per
    table, named by the table, as its `prepare_feature_specs_for_training`
    names a table it was not asked to stack); stacks are named by joining
    their tables' names with "_" (names longer than 50 characters are
    shortened by its `stack_tables`: pass its specs to `jte_layout_from_specs`
    instead). `rotation` is its shard
    rotation step, needed for a stack of several tables (its default there:
    SparseCores per device, which `num_shards` does not say).
    """
    num_shards = _check_shards(num_shards)
    specs = dict(tables) if isinstance(tables, Mapping) else {t.name: t for t in tables}
    if stacking is not None and (isinstance(stacking, str) or any(isinstance(g, str) or not list(g) for g in stacking)):
        raise ValueError(f"stacking must be a list of non-empty lists of table names, got {stacking!r}.")
    groups = [list(g) for g in stacking] if stacking is not None else [[n] for n in sorted(specs)]
    if rotation is None and any(len(g) > 1 for g in groups):
        raise ValueError("A stack of several tables needs rotation= (jax-tpu-embedding's stack_tables rotates its "
                         "tables' shards by SparseCores per device by default: pass that).")
    if rotation is not None and (isinstance(rotation, bool) or not isinstance(rotation, (int, np.integer))):
        raise ValueError(f"rotation must be an int (the shard rotation step), got {rotation!r}.")
    rotation = 1 if rotation is None else int(rotation)
    listed = [n for g in groups for n in g]
    if sorted(listed) != sorted(specs):
        raise ValueError(f"stacking must name every table once; it names {listed}, the tables are {sorted(specs)}.")
    out = []
    for g in groups:
        name = "_".join(g)
        if len(name) > 50 and stacking is not None:
            raise ValueError(f"Stack {name[:50]}...: names over 50 characters are hashed by jax-tpu-embedding; "
                             "use jte_layout_from_specs with its prepared TableSpecs.")
        padded = {n: round_up(specs[n].vocabulary_size, 8 * num_shards) for n in g}
        dim = max(round_up(specs[n].embedding_dim, 8) for n in g)
        offset, rot = 0, 0
        for n in g:
            out.append(JteTableLayout(n, specs[n].vocabulary_size, specs[n].embedding_dim, name, padded[n],
                                      sum(padded.values()), dim, offset, rot))
            offset += padded[n] // num_shards
            rot = (rot + rotation) % num_shards
    return tuple(out)


def _stacks(layout: Sequence[JteTableLayout], num_shards: int) -> dict[str, list[JteTableLayout]]:
    """The layout's stacks, checked against `num_shards` (a layout is made for one number of shards: its tables'
    padding and their offsets in a shard follow from it)."""
    out: dict[str, list[JteTableLayout]] = {}
    for t in layout:
        out.setdefault(t.stack_name, []).append(t)
    for stack, members in out.items():
        offset = 0
        for t in sorted(members, key=lambda t: t.row_offset_in_shard):
            if t.padded_vocab_size % (8 * num_shards) or t.row_offset_in_shard != offset:
                raise ValueError(f"Table {t.name!r} (stack {stack!r}): its layout was not made for num_shards="
                                 f"{num_shards} (padded to {t.padded_vocab_size} rows at row {t.row_offset_in_shard} "
                                 "of a shard); pass the num_shards it was made for.")
            offset += t.padded_vocab_size // num_shards
        if offset * num_shards != members[0].stack_vocab_size:
            raise ValueError(f"Stack {stack!r}: its tables fill {offset * num_shards} of its "
                             f"{members[0].stack_vocab_size} rows with num_shards={num_shards}; pass the num_shards "
                             "its layout was made for.")
    return out


def to_jte(layout: Sequence[JteTableLayout], arrays: Mapping[str, np.ndarray], num_shards: int, *,
           pad_value: float = np.nan) -> dict[str, np.ndarray]:
    """`{table: [vocab, dim]}` -> `{stack: [num_shards * rows_per_shard, stack_dim]}` float32.

    Padding rows/columns of a table hold `pad_value` (jax-tpu-embedding's
    default is NaN); rows of a stack no table uses are 0.
    """
    missing = sorted({t.name for t in layout} - set(arrays))
    if missing:
        raise ValueError(f"to_jte: no arrays for tables {missing}.")
    num_shards, out = _check_shards(num_shards), {}
    for stack, members in _stacks(layout, num_shards).items():
        first = members[0]
        buf = np.zeros((num_shards, first.stack_vocab_size // num_shards, first.stack_embedding_dim), np.float32)
        for t in members:
            a = host_array(t.name, "array", arrays[t.name], (t.vocabulary_size, t.embedding_dim))
            padded = np.full((t.padded_vocab_size, t.stack_embedding_dim), pad_value, np.float32)
            padded[: t.vocabulary_size, : t.embedding_dim] = a
            shards = padded.reshape(-1, num_shards, t.stack_embedding_dim).swapaxes(0, 1)  # [S, rows, dim]
            rows = t.padded_vocab_size // num_shards
            buf[:, t.row_offset_in_shard : t.row_offset_in_shard + rows] = np.roll(shards, t.shard_rotation, axis=0)
        out[stack] = buf.reshape(-1, first.stack_embedding_dim)
    return out


def from_jte(layout: Sequence[JteTableLayout], stacked: Mapping[str, np.ndarray], num_shards: int
             ) -> dict[str, np.ndarray]:
    """`{stack: [num_shards * rows, stack_dim]}` (or `[num_shards, rows, stack_dim]`) -> `{table: [vocab, dim]}`."""
    num_shards, out = _check_shards(num_shards), {}
    _stacks(layout, num_shards)
    for t in layout:
        if t.stack_name not in stacked:
            raise ValueError(f"Table {t.name!r}: its stack {t.stack_name!r} is not among {sorted(stacked)}.")
        s = np.asarray(stacked[t.stack_name])
        want = (t.stack_vocab_size, t.stack_embedding_dim)
        if s.shape not in (want, (num_shards, t.stack_vocab_size // num_shards, t.stack_embedding_dim)):
            raise ValueError(f"Stack {t.stack_name!r}: array of shape {s.shape}, but its layout is {want} (or "
                             f"{(num_shards, want[0] // num_shards, want[1])}) with num_shards={num_shards}.")
        s = s.reshape(num_shards, -1, t.stack_embedding_dim)
        rows = t.padded_vocab_size // num_shards
        shards = np.roll(s[:, t.row_offset_in_shard : t.row_offset_in_shard + rows], -t.shard_rotation, axis=0)
        out[t.name] = shards.swapaxes(0, 1).reshape(-1, t.stack_embedding_dim)[: t.vocabulary_size, : t.embedding_dim]
    return out


# ------------------------------------------------------------------ the SparseCore primitives' input
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
    weights = {} if weights is None else weights
    for what, given in (("features", features), ("ids", ids), ("weights", weights)):
        if not isinstance(given, Mapping):
            raise TypeError(f"sparsecore_csr: {what} must be a mapping keyed by feature name, got "
                            f"{type(given).__name__}.")
    for key, f in features.items():  # (ids and weights are looked up by key, a feature's place by its name)
        if key != f.name:
            raise ValueError(f"sparsecore_csr: feature key {key!r} differs from its FeatureSpec name {f.name!r}.")
    where = {t.name: t for t in layout}
    missing = sorted({f.table.name for f in features.values()} - set(where))
    if missing:
        raise ValueError(f"sparsecore_csr: the layout has no tables {missing}.")
    missing = sorted(set(features) - set(ids))
    if missing:
        raise ValueError(f"sparsecore_csr: no ids for features {missing}.")
    for what, given in (("ids", ids), ("weights", weights)):  # a misspelt key would be ignored: unweighted gains
        unknown = sorted(set(given) - set(features), key=str)
        if unknown:
            raise ValueError(f"sparsecore_csr: {what} has unknown features {unknown}; the features are "
                             f"{sorted(features)}.")
    num_sc = _check_shards(num_devices, "num_devices") * _check_shards(sc_per_device, "sc_per_device")
    max_ids_per_partition = _check_shards(max_ids_per_partition, "max_ids_per_partition")
    if max_unique_ids_per_partition is not None:
        max_unique_ids_per_partition = _check_shards(max_unique_ids_per_partition, "max_unique_ids_per_partition")
    _stacks(layout, num_sc)
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
