"""Offloaded tables under several processes (`jax.distributed`): every process makes the same cache decisions.

Each process preprocesses its own rows of a batch, but the cache's decisions
(which rows come in, where, which go out and are written back) must be the
same on every process: the swap is one program over the whole mesh. So,
before admitting a batch, each process sends the distinct rows its ids read
of every offloaded table to the others (through the coordination service's
key-value store, as `preprocess` agrees on its capacities:
`host.distributed`), and every process admits their union.

The store is sharded by row: process `i` of `P` keeps the rows `r` with
`r % P == i` in its own store, `<path>/process<i>of<P>` (a store like any
other, over the whole vocabulary, holding only its rows). It reads its own
misses and writes back its own evicted rows; the swap adds the processes'
rows up on the devices (`core.row_swap`: each row comes from its owner
only, added as integers, so exactly). One process (`P == 1`) keeps the
store at `<path>` itself.
"""

from __future__ import annotations

import threading
import zlib
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparse_embed.core.planning import EmbeddingPlan
from sparse_embed.host import distributed, plan_state
from sparse_embed.tiers.store import stored_shards

_SERIES: dict[str, int] = {}  # plan tag -> how many `Tiers` of such a plan this process made (exchange names)
_LOCK = threading.Lock()


def check_layout(table: str, path: str, count: int) -> None:
    """A clear error when the store at `path` was written by another number of processes than `count`."""
    stored = stored_shards(path)
    if stored is not None and stored != count:
        raise ValueError(f"Table {table!r}: the store at {path!r} was written by {stored} process(es) (each keeps "
                         f"its rows r % {stored}), but this run has {count}: train it with {stored} processes, or "
                         "read it whole with sparse_embed.offload.store_state and write it anew (write_store) "
                         "with one.")


class Processes:
    """This process's place among the processes of a plan's mesh, and the exchanges of one `Tiers`."""

    def __init__(self, plan: EmbeddingPlan) -> None:
        self.processes = distributed.mesh_processes(plan.mesh)
        me = jax.process_index()
        if me not in self.processes:
            raise ValueError(f"sparse_embed.offload.Tiers: process {me} has no device of the plan's mesh.")
        self.index, self.count = self.processes.index(me), len(self.processes)
        self.plan = plan
        self.local = distributed.local_positions(plan) if self.count > 1 else list(range(plan.num_shards))
        tag = plan_state.of(plan).tag
        with _LOCK:  # the same on every process: each makes the same Tiers in the same order
            _SERIES[tag] = _SERIES.get(tag, 0) + 1
            self.name = f"tiers.{tag}.{_SERIES[tag]}"
        self._exchanges: dict[str, int] = {}
        self._sharding = NamedSharding(plan.mesh, P(plan.axis_name))

    @property
    def several(self) -> bool:
        return self.count > 1

    def owned(self, rows: np.ndarray) -> np.ndarray:
        """bool: which of the table rows `rows` this process's store keeps."""
        return rows % self.count == self.index

    def _gather(self, what: str, data: bytes) -> list[bytes]:
        n = self._exchanges.get(what, 0)
        self._exchanges[what] = n + 1
        return distributed.allgather_bytes(self.processes, data, name=f"{self.name}.{what}", n=n)

    def union(self, rows: Mapping[str, np.ndarray], counts: Mapping[str, tuple[int, int]], flushes: int,
              failed: bool) -> tuple[dict[str, tuple[np.ndarray, int, int]], int]:
        """Every process's distinct `rows[table]` (sorted int64) and `counts[table]` (lookups, hits) of one batch,
        and the fewest `flushes` any process has made: `({table: (rows of every process, in process order;
        lookups; hits, summed)}, flushes)`. Raises on every other process if one `failed` (that one raises its
        own error). Sent as the gaps between the sorted rows, compressed (zlib, fastest): 4-5x fewer bytes for
        Zipf-like ids, and the key-value store moves a few MB/s."""
        names = sorted(rows)
        header = [int(failed), flushes] + [v for n in names for v in (rows[n].size, *counts[n])]
        gaps = [np.diff(rows[n], prepend=0).astype(self._gap_type(n)) for n in names]
        sent = zlib.compress(b"".join([np.asarray(header, np.int64).tobytes()] + [g.tobytes() for g in gaps]), 1)
        parts = [zlib.decompress(b) for b in self._gather("rows", sent)]
        heads = [np.frombuffer(p, np.int64, 2 + 3 * len(names)) for p in parts]
        bad = [self.processes[i] for i, h in enumerate(heads) if h[0]]
        if failed:
            return {}, 0
        if bad:
            raise ValueError(f"sparse_embed.offload.Tiers.preprocess failed on process(es) {bad} (see their error); "
                             f"this process ({jax.process_index()}) raises too, so that no process runs a step the "
                             "others skip.")
        out = {name: ([], 0, 0) for name in names}
        for p, h in zip(parts, heads):
            at = h.nbytes
            for i, name in enumerate(names):
                n, lookups, hits = (int(v) for v in h[2 + 3 * i:5 + 3 * i])
                gap = np.frombuffer(p, self._gap_type(name), n, at)
                got, total, hit = out[name]
                out[name] = (got + [np.cumsum(gap, dtype=np.int64)], total + lookups, hit + hits)
                at += gap.nbytes
        union = {name: (np.concatenate(r), total, hit) for name, (r, total, hit) in out.items()}
        return union, min(int(h[1]) for h in heads)

    def agree(self, failure: BaseException | None) -> None:
        """Raises `failure` here, and on every other process when one of them has one (a batch no process runs)."""
        if self.several:
            bad = [self.processes[i] for i, b in enumerate(self._gather("failed", bytes([failure is not None])))
                   if b[0]]
            if bad and failure is None:
                raise ValueError(f"sparse_embed.offload.Tiers.preprocess failed on process(es) {bad} (see their "
                                 f"error); this process ({jax.process_index()}) raises too.")
        if failure is not None:
            raise failure

    def _gap_type(self, table: str) -> type:
        return np.uint32 if self.plan.tiered_tables[table].vocabulary_size <= 1 << 32 else np.int64

    def place(self, arrays: Any) -> Any:
        """Each `[n, ...]` numpy leaf as this process's block of a `[S * n, ...]` array over the plan's axis: on
        the first of its devices, zeros on its others (what `swap_rows(..., per_process=True)` adds up)."""
        L, S = len(self.local), self.plan.num_shards

        def one(x: np.ndarray) -> jax.Array:
            local = np.zeros((L * x.shape[0],) + x.shape[1:], x.dtype)
            local[:x.shape[0]] = x
            return jax.make_array_from_process_local_data(self._sharding, local, (S * x.shape[0],) + x.shape[1:])

        return jax.tree.map(one, arrays)
