"""A SparseCore stack's batch: its COO entries and the same entries as the primitives' CSR input.

The CSR is built on the host (`sparse_embed.host.sparsecore_input`); its
format is jax-tpu-embedding's own preprocessing output (docs/sparsecore.md).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from sparse_embed.core.batch import capacity_of, marked

PAD_ID = 2**31 - 1  # a CSR's embedding and sample ids in its alignment gaps (jax-tpu-embedding's PADDING_VALUE)


class CsrBatch(NamedTuple):
    """A SparseCore stack's input in the CSR format of jax-tpu-embedding's primitives.

    Every SparseCore's slice, one after the other (device d's S slices together).
    """

    row_pointers: Any  # int32 [num_slices * max(num_sc, 8)]
    embedding_ids: Any  # int32 [num_slices * round_up(max_ids_per_partition, 8) * num_sc]
    sample_ids: Any  # int32, like embedding_ids
    gains: Any  # float32, like embedding_ids


@marked
class SparseCoreBatch(NamedTuple):
    """A SparseCore stack's batch. Leading axis = device (sharded over the plan's axis).

    The COO arrays of `ShardedCooMatrix` (what the usual kernels read off TPU), and `csr`, a `CsrBatch` whose
    fields are `[D, ...]`: the same entries for the primitives on TPU.
    """

    shard_starts: Any
    shard_ends: Any
    col_ids: Any
    row_ids: Any
    values: Any
    csr: CsrBatch

    capacity = property(capacity_of)
