"""The SparseCore backend's preprocessing hook: each SparseCore stack's COO batch and its CSR input. Host numpy/C.

`add_inputs` is what `preprocess` runs for the stacks of the SparseCore
backend (`core.sparsecore`), after their COO batches are built; a plan
without such stacks never calls it. It turns each stack's batch into a
`SparseCoreBatch`: the COO arrays and the same entries in the CSR format of
jax-tpu-embedding's primitives (`from_coo`), sized by a limit every process
agrees on (`max_ids_per_partition`, a high-water mark over the plan's
batches, `plan_state.PlanState.high_water`), and reports what each batch
needed (`Stats.sparsecore_ids_per_partition`).

The format: a batch for `num_slices` SparseCores (each one slice of the
samples) and `num_sc` partitions (the SparseCores that own rows) is one flat
array per field, slice after slice. In a slice, entries are grouped by
partition `p = 0 .. num_sc-1`, each group sorted by `(embedding_id,
sample_id)` and starting at a multiple of 8; `row_pointers[p]` is the end of
group p (relative to the slice; the pointers past `num_sc`, up to 8, repeat
the end rounded up to 8), and the gaps hold `PAD_ID` / NaN (`pack_csr`).
This is what jax-tpu-embedding's own preprocessing produces.
"""

from __future__ import annotations

import numpy as np

from sparse_embed.core.batch import ShardedCooMatrix
from sparse_embed.core.planning import EmbeddingPlan, StackPlan, round_up
from sparse_embed.core.sparsecore.batch import PAD_ID, CsrBatch, SparseCoreBatch
from sparse_embed.host import distributed, gains, native, plan_state


def rows_per_slice(num_sc: int) -> int:
    """Row pointers of one slice: one per partition, at least 8."""
    return max(num_sc, 8)


def entries_per_slice(num_sc: int, max_ids_per_partition: int) -> int:
    """COO entries of one slice: `round_up(max_ids_per_partition, 8)` per partition."""
    return round_up(max_ids_per_partition, 8) * num_sc


def pack_csr(stack: str, q, p, eid, sid, gain, num_slices: int, num_sc: int, max_ids: int, max_unique: int
             ) -> CsrBatch:
    """Entries `(slice q, partition p, embedding_id, sample_id, gain)` (deduplicated) laid out as in the module
    docstring. A partition with more than `max_ids` entries or `max_unique` distinct ids is a ValueError
    naming the stack."""
    order = np.lexsort((sid, eid, p, q))
    q, p, eid, sid, gain = q[order], p[order], eid[order], sid[order], gain[order]
    n = num_slices * num_sc
    counts = np.bincount(q * num_sc + p, minlength=n).reshape(num_slices, num_sc)
    first = np.ones(q.size, bool)
    first[1:] = (q[1:] != q[:-1]) | (p[1:] != p[:-1]) | (eid[1:] != eid[:-1])
    unique = np.bincount((q * num_sc + p)[first], minlength=n).reshape(num_slices, num_sc)
    for what, c, limit in (("ids", counts, max_ids), ("distinct ids", unique, max_unique)):
        if c.max(initial=0) > limit:
            sc, part = np.unravel_index(int(np.argmax(c)), c.shape)
            raise ValueError(f"Stack {stack!r}: SparseCore {sc} sends partition {part} {int(c.max())} {what}, more "
                             f"than max_{what.replace(' ', '_').replace('distinct_', 'unique_')}_per_partition={limit}.")
    starts = np.zeros_like(counts)  # [slice, partition]: each group's first position, a multiple of 8
    for j in range(1, num_sc):
        starts[:, j] = round_up(starts[:, j - 1] + counts[:, j - 1], 8)
    ends = starts + counts
    rp_len, size = rows_per_slice(num_sc), entries_per_slice(num_sc, max_ids)
    row_pointers = np.repeat(round_up(ends[:, -1:], 8), rp_len, axis=1)
    row_pointers[:, :num_sc] = ends
    rank = np.arange(q.size) - np.repeat(np.cumsum(counts.reshape(-1)) - counts.reshape(-1), counts.reshape(-1))
    at = q * size + starts[q, p] + rank
    arrays = [np.full(num_slices * size, PAD_ID, np.int32), np.full(num_slices * size, PAD_ID, np.int32),
              np.full(num_slices * size, np.nan, np.float32)]
    for a, v in zip(arrays, (eid, sid, gain)):
        a[at] = v
    return CsrBatch(row_pointers.astype(np.int32).reshape(-1), *arrays)


def _sizes(stack: StackPlan, coo: ShardedCooMatrix):
    """`(S, D, N, R, b, cap)`: SparseCores per device, this process's devices, partitions, rows per SparseCore
    shard, rows per slice, and the COO's capacity."""
    S = stack.sparsecores
    return S, coo.col_ids.shape[0], stack.num_shards * S, stack.rows_per_shard // S, stack.slice_rows, coo.capacity


def _buckets(stack: StackPlan, coo: ShardedCooMatrix):
    """numpy: every real entry's `(slice q, partition p, embedding_id, sample_id, gain)`, in COO order."""
    S, D, N, R, b, cap = _sizes(stack, coo)
    seg = np.arange(coo.col_ids.shape[1]) // cap
    real = np.arange(coo.col_ids.shape[1])[None] < np.take_along_axis(
        coo.shard_ends, np.broadcast_to(seg, (D, seg.size)), axis=1)
    device, at = np.nonzero(real)
    col, row = coo.col_ids[device, at], coo.row_ids[device, at]
    return device * S + row // b, seg[at] * S + col // R, col % R, row % b, coo.values[device, at]


def needed(stack: StackPlan, coo: ShardedCooMatrix) -> int:
    """The most entries (before merging duplicates) any SparseCore partition of this batch gets from one slice:
    the `max_ids_per_partition` it needs."""
    S, D, N, R, b, cap = _sizes(stack, coo)
    ext = native.extension()
    if ext is not None:
        empty = (np.empty(0, np.int32), np.empty(0, np.int32), np.empty(0, np.int32), np.empty(0, np.float32))
        return ext.csr(*_coo_arrays(coo), S, N, R, b, cap, 0, *empty)
    q, p, *_ = _buckets(stack, coo)
    return int(np.bincount(q * N + p, minlength=1).max())


def _coo_arrays(coo: ShardedCooMatrix):
    return tuple(np.ascontiguousarray(x) for x in (coo.col_ids, coo.row_ids, coo.values, coo.shard_ends))


def from_coo(stack: StackPlan, coo: ShardedCooMatrix, limit: int) -> CsrBatch:
    """A SparseCore stack's CSR input, `[L, ...]` per field, from its COO batch of this process's L devices.

    Device d's output rows are its S SparseCores' slices of `slice_rows`
    rows, each with its share of every feature (`FeatureLayout.out_rows`):
    row r is sample `r % b` of slice `d * S + r // b`. A received row `l`
    of shard e is row `l % R` of SparseCore `e * S + l // R` (`R =
    sc_rows`), in the plan's layout, which is jax-tpu-embedding's. Entries
    of one sample and row are merged (gains summed in float32, in COO
    order, as it does).
    `limit` (>= `needed`) is `max_ids_per_partition` and
    `max_unique_ids_per_partition`. In C if the extension is built
    (`native`), else numpy: the same bits.
    """
    S, D, N, R, b, cap = _sizes(stack, coo)
    ext = native.extension()
    if ext is None:
        q, p, eid, sid, gain = _buckets(stack, coo)
        key, where = np.unique(((q * N + p) * R + eid) * b + sid, return_inverse=True)
        gain = gains.fold(gain, where.reshape(-1), key.size, np.add)
        key, sid = np.divmod(key, b)
        key, eid = np.divmod(key, R)
        q, p = np.divmod(key, N)
        out = pack_csr(stack.name, q, p, eid, sid, gain, D * S, N, limit, limit)
    else:
        size = D * S * entries_per_slice(N, limit)
        out = CsrBatch(np.empty(D * S * rows_per_slice(N), np.int32), np.full(size, PAD_ID, np.int32),
                       np.full(size, PAD_ID, np.int32), np.full(size, np.nan, np.float32))
        most = ext.csr(*_coo_arrays(coo), S, N, R, b, cap, limit, *out)
        if most > limit:
            raise ValueError(f"Stack {stack.name!r}: a SparseCore partition gets {most} ids, more than the limit "
                             f"{limit}.")
    return CsrBatch(*(x.reshape(D, -1) for x in out))


def _limit(state: plan_state.PlanState, stack: StackPlan, needed: int, capacity: int) -> int:
    """A stack's `max_ids_per_partition` for its next batch: a high-water mark grown to `needed` like an auto
    capacity, at most `capacity` (which bounds every SparseCore partition)."""
    return state.high_water(("sparsecore", stack.name), needed,
                            lambda n: min(plan_state.auto_capacity_for(n), capacity))


def add_inputs(plan: EmbeddingPlan, stacks: list[StackPlan], batch: dict, several: bool) -> dict[str, dict]:
    """The hook: each of `stacks`' COO batch (numpy, this process's devices) -> a `SparseCoreBatch`, in place,
    its limit agreed by every process. Returns the `Stats` fields it fills: `sparsecore_ids_per_partition`."""
    state = plan_state.of(plan)
    needs = [needed(s, batch[s.name]) for s in stacks]
    if several:
        needs = distributed.allgather_ints(distributed.mesh_processes(plan.mesh), needs, name=state.tag,
                                           n=state.next_exchange()).max(axis=0).tolist()
    for s, need in zip(stacks, needs):
        coo = batch[s.name]
        batch[s.name] = SparseCoreBatch(*coo, from_coo(s, coo, _limit(state, s, need, coo.capacity)), layout=coo.layout)
    return {"sparsecore_ids_per_partition": {s.name: int(n) for s, n in zip(stacks, needs)}}
