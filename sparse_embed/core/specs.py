"""Static configuration: what a table is and which features read it.

Specs are frozen and hashable (they end up inside the jit-static
`EmbeddingPlan`) and are never mutated by the library.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from sparse_embed.core import optimizers as _opt
from sparse_embed.core.initializers import TruncatedNormal, truncated_normal
from sparse_embed.core.pooling import COMBINERS

Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


def default_initializer(embedding_dim: int) -> Initializer:
    """Truncated normal with stddev 1/sqrt(embedding_dim) (the TPUEmbedding default), positional (see initializers)."""
    return truncated_normal(1.0 / math.sqrt(embedding_dim))


def _check_name(kind: str, name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string, got {name!r}.")


def _check_positive_int(what: str, value: Any, most: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{what} must be a positive int, got {value!r}.")
    if most is not None and value > most:
        raise ValueError(f"{what} must be at most {most}, got {value!r}" + (" (int32: steps, counts and rows of a "
                         "raw-id map)." if most == _INT32 else "."))


_INT32 = 2**31 - 1  # steps, counts and rows of a raw-id map are int32 on the device


@dataclasses.dataclass(frozen=True)
class Dynamic:
    """Makes a table keyed by raw 64-bit ids: it maps ids to rows itself (`TableSpec(dynamic=...)`).

    The table's `vocabulary_size` is then its row capacity. Ids are any
    integers in `[0, 2**63)` (int64, or uint64 below 2**63); -1 is padding
    in dense input, as for every table. Each id lives on the shard chosen by
    a hash of the id, which also keeps its map entry (docs/raw_ids.md).

    Attributes:
      admit_after: occurrences (in training batches) before an id gets a row;
        1 = at once. Until then it reads zeros (or `default`) and its gradient is dropped.
      expire_after: steps without a lookup after which an id loses its row
        (None = never); a later occurrence counts as a new id.
      pending_capacity: ids one shard tracks while they wait for admission
        (only with `admit_after > 1`); default: the table's rows per shard.
        When full, the least recently seen waiting ids are forgotten.
      default: what an id without a row reads: None (zeros), a float (every
        element) or a vector of `embedding_dim` floats. It is a constant: no
        gradient reaches it.
      id_bits: the ids are below `2**id_bits` (None: any id below 2**63).
        Preprocessing rejects larger ones. With `id_bits <= 32 +
        log2(rows per shard / 16)` (47 at 10**6 rows per shard) the map keeps
        4-byte keys: 12.25 bytes per row instead of 16.25 (docs/raw_ids.md).
    """

    admit_after: int = 1
    expire_after: int | None = None
    pending_capacity: int | None = None
    default: float | tuple[float, ...] | None = None
    id_bits: int | None = None

    def __post_init__(self):
        _check_positive_int("Dynamic: admit_after", self.admit_after, _INT32)
        if self.expire_after is not None:
            _check_positive_int("Dynamic: expire_after", self.expire_after, _INT32)
        if self.pending_capacity is not None:
            _check_positive_int("Dynamic: pending_capacity", self.pending_capacity, _INT32)
        if self.id_bits is not None:
            _check_positive_int("Dynamic: id_bits", self.id_bits)
            if self.id_bits > 63:
                raise ValueError(f"Dynamic: id_bits must be at most 63 (raw ids are below 2**63), got {self.id_bits}.")
            object.__setattr__(self, "id_bits", int(self.id_bits))
        if self.default is not None:  # a hashable float or tuple of finite floats
            d = np.asarray(self.default, np.float64)
            if d.ndim > 1 or d.size == 0 or not np.isfinite(d).all():
                raise ValueError(f"Dynamic: default must be a finite float or vector, got {self.default!r}.")
            object.__setattr__(self, "default", float(d) if d.ndim == 0 else tuple(float(x) for x in d))

    def default_vector(self, dim: int) -> np.ndarray | None:
        """`[dim]` float32 that an id without a row reads, or None (zeros)."""
        return None if self.default is None else np.broadcast_to(np.asarray(self.default, np.float32), (dim,))


@dataclasses.dataclass(frozen=True)
class Offload:
    """Keeps a table's rows and optimizer slots in a store on disk under a cache of hot rows (`TableSpec(storage=...)`).

    The device holds `cache_rows` rows (and their slots); the step reads and
    updates only those. The host (`sparse_embed.offload.Tiers`) sees each batch's ids
    ahead of the step, reads the missing rows from the store while the device
    trains, and writes evicted rows back if they changed. Results equal the
    in-memory table's (docs/offload.md).

    Attributes:
      path: the store's directory (created if absent; an existing store is reopened), one per table;
        `~` is expanded.
      cache_rows: rows the device holds; at least the distinct ids of one
        batch, or `Tiers.preprocess` refuses the batch naming the table.
    """

    path: str
    cache_rows: int

    def __post_init__(self):
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise ValueError(f"Offload: path must be a directory path, got {self.path!r}.")
        _check_positive_int("Offload: cache_rows", self.cache_rows)
        # "~" is the user's home (else a directory named "~" appeared in the working directory)
        object.__setattr__(self, "path", os.path.expanduser(os.fspath(self.path)))
        object.__setattr__(self, "cache_rows", int(self.cache_rows))


@dataclasses.dataclass(frozen=True, eq=True)
class TableSpec:
    """One embedding table: `[vocabulary_size, embedding_dim]` rows.

    Attributes:
      name: unique table name (a key of `unstack_tables` and checkpoints).
      vocabulary_size: number of valid ids; ids must lie in `[0, vocabulary_size)`.
      embedding_dim: width of a row.
      initializer: `f(key, shape, dtype) -> array` (a `jax.nn.initializers`
        function). It is called once per table with `shape=(vocabulary_size,
        embedding_dim)` inside a jit whose output is sharded, so the table is
        generated shard by shard. Default: truncated normal, stddev
        `1/sqrt(embedding_dim)`.
      optimizer: an optimizer spec from `sparse_embed.optimizers` that the
        lookup's backward applies to touched rows. Default: `SGD(0.01)`.
      combiner: how a sample's ids are pooled: "sum", "mean" (weighted mean)
        or "sqrtn" (sum divided by the L2 norm of the weights).
      max_norm: if set, each looked-up row is scaled down to at most this L2
        norm before it is combined (as `tf.nn.embedding_lookup_sparse`).
      dtype: storage dtype of the table.
      dynamic: a `Dynamic` policy for a table keyed by raw 64-bit ids (its
        `vocabulary_size` is then its row capacity), or None: ids are rows.
      storage: `Offload(path, cache_rows)` keeps the table on disk under a
        device cache of `cache_rows` hot rows (docs/offload.md; a raw-id
        table's ids map to rows as in memory, and those rows are what the
        cache holds); None: the whole table lives in device memory.
    """

    name: str
    vocabulary_size: int
    embedding_dim: int
    initializer: Initializer | None = None
    optimizer: _opt.Optimizer | None = None
    combiner: str = "mean"
    max_norm: float | None = None
    dtype: Any = jnp.float32
    dynamic: Dynamic | None = None
    storage: Offload | None = None

    def __post_init__(self):
        _check_name("Table", self.name)
        if {"", ".", ".."} & set(self.name.split("/")) or "\0" in self.name:  # a path in checkpoints and exports
            raise ValueError(f"Table name {self.name!r} cannot name a directory: a table is a directory of its "
                             "checkpoints (embeddings/<name>/), so no part between slashes may be empty, '.' or '..'.")
        if self.storage is not None:
            _check_storage(self)
        if self.dynamic is not None and not isinstance(self.dynamic, Dynamic):
            raise TypeError(f"Table {self.name!r}: dynamic must be a sparse_embed.Dynamic policy, "
                            f"got {type(self.dynamic).__name__}.")
        if self.dynamic is not None and isinstance(self.dynamic.default, tuple) and \
                len(self.dynamic.default) != self.embedding_dim:
            raise ValueError(f"Table {self.name!r}: the default vector has {len(self.dynamic.default)} values, "
                             f"embedding_dim is {self.embedding_dim}.")
        _check_positive_int(f"Table {self.name!r}: vocabulary_size", self.vocabulary_size)
        _check_positive_int(f"Table {self.name!r}: embedding_dim", self.embedding_dim)
        if self.combiner not in COMBINERS:
            raise ValueError(
                f"Table {self.name!r}: combiner must be one of {COMBINERS}, got {self.combiner!r}."
            )
        if self.max_norm is not None and (isinstance(self.max_norm, (bool, str)) or np.ndim(self.max_norm)
                                          or not np.issubdtype(np.asarray(self.max_norm).dtype, np.number)):
            raise TypeError(f"Table {self.name!r}: max_norm must be a number (the largest L2 norm of a looked-up "
                            f"row) or None, got {self.max_norm!r}.")  # (True would have read as 1.0)
        if self.max_norm is not None and not (float(self.max_norm) > 0):
            raise ValueError(f"Table {self.name!r}: max_norm must be > 0, got {self.max_norm!r}.")
        if self.optimizer is not None and not isinstance(self.optimizer, _opt.Optimizer):
            raise TypeError(
                f"Table {self.name!r}: optimizer must be a sparse_embed.optimizers spec "
                f"(e.g. optimizers.Adagrad(0.05)), got {type(self.optimizer).__name__}. "
                "optax transforms apply to dense params; embedding rows are updated in the backward."
            )
        if not jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating):
            raise ValueError(f"Table {self.name!r}: dtype must be a float dtype, got {self.dtype!r}.")
        if self.initializer is not None and not callable(self.initializer):
            raise TypeError(f"Table {self.name!r}: initializer must be a function f(key, shape, dtype) (e.g. "
                            f"sparse_embed.initializers.truncated_normal(0.01)), got {self.initializer!r}.")
        # Normalise so that equal specs hash equally.
        object.__setattr__(self, "vocabulary_size", int(self.vocabulary_size))
        object.__setattr__(self, "embedding_dim", int(self.embedding_dim))
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        if self.max_norm is not None:
            object.__setattr__(self, "max_norm", float(self.max_norm))

    @property
    def cache_rows(self) -> int:
        """Rows the device holds: `storage.cache_rows` (at most `vocabulary_size`) for a tiered table, else all."""
        return self.vocabulary_size if self.storage is None else min(self.storage.cache_rows, self.vocabulary_size)

    @property
    def resolved_initializer(self) -> Initializer:
        return self.initializer or default_initializer(self.embedding_dim)

    @property
    def resolved_optimizer(self) -> _opt.Optimizer:
        return self.optimizer or _opt.DEFAULT


def _check_storage(t: TableSpec) -> None:
    """What a tiered table needs (docs/offload.md): float32 rows; with static ids, a row-wise initializer."""
    if not isinstance(t.storage, Offload):
        raise TypeError(f"Table {t.name!r}: storage must be a sparse_embed.offload.Offload, got {type(t.storage).__name__}.")
    if jnp.dtype(t.dtype) != jnp.float32:
        raise ValueError(f"Table {t.name!r}: an offloaded table stores float32 rows, got dtype {t.dtype!r}.")
    # a raw-id table's new rows start from their id's values (`id_maps.initial_rows`), any initializer's
    if t.dynamic is None and t.initializer is not None and not isinstance(t.initializer, TruncatedNormal):
        raise ValueError(f"Table {t.name!r}: an offloaded table's rows are generated when first read, so its "
                         "initializer must be positional: sparse_embed.initializers.truncated_normal(stddev) "
                         f"or the default, got {t.initializer!r}.")


@dataclasses.dataclass(frozen=True, eq=True)
class FeatureSpec:
    """One input feature: the ids of each sample, looked up in `table`.

    Attributes:
      name: unique feature name (a key of the `preprocess` input and of the
        `lookup` output).
      table: the `TableSpec` it reads. Several features may share a table.
      batch_size: the *global* batch size of this feature (all devices).
      max_sequence_length: 0 = pooled output `[batch_size, dim]` (the table's
        combiner pools a sample's ids); L > 0 = unpooled output
        `[batch_size, L, dim]`: id `j` of a sample lands at position `j`,
        positions past the sample's length are zero, ids past L are truncated.
    """

    name: str
    table: TableSpec
    batch_size: int
    max_sequence_length: int = 0

    def __post_init__(self):
        _check_name("Feature", self.name)
        if not isinstance(self.table, TableSpec):
            raise TypeError(f"Feature {self.name!r}: table must be a TableSpec, got {type(self.table).__name__}.")
        _check_positive_int(f"Feature {self.name!r}: batch_size", self.batch_size)
        msl = self.max_sequence_length
        if isinstance(msl, bool) or not isinstance(msl, (int, np.integer)) or msl < 0:
            raise ValueError(f"Feature {self.name!r}: max_sequence_length must be an int >= 0, got {msl!r}.")
        object.__setattr__(self, "batch_size", int(self.batch_size))
        object.__setattr__(self, "max_sequence_length", int(msl))

    @property
    def is_sequence(self) -> bool:
        return self.max_sequence_length > 0

    @property
    def output_shape(self) -> tuple[int, ...]:
        """Shape of this feature's activations from `lookup`."""
        if self.is_sequence:
            return (self.batch_size, self.max_sequence_length, self.table.embedding_dim)
        return (self.batch_size, self.table.embedding_dim)
