"""Which tables `plan(memory_budget=..., offload_to=...)` keeps on disk, and how large their caches are.

When the tables and slots (on the default row placement) need more memory
per device than the budget, the largest tables that can be offloaded are
moved to stores under `offload_to`, one at a time, until the rest fits with
room for caches; the room left is then shared among the offloaded tables'
caches in proportion to their sizes (a larger cache, a higher hit rate). A
table already declared with `storage=` keeps it as declared, cache and all
(its cache counts against the budget).
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from sparse_embed.core.initializers import TruncatedNormal
from sparse_embed.core.specs import Offload, TableSpec

_SLOT_ITEMSIZE = 4


def row_bytes(t: TableSpec) -> int:
    """Bytes of one row and its optimizer slots."""
    slots = t.resolved_optimizer.slots(t.embedding_dim).values()
    return t.embedding_dim * np.dtype(t.dtype).itemsize + sum(s.width for s in slots) * _SLOT_ITEMSIZE


def per_device(rows: int, t: TableSpec, num_shards: int) -> int:
    """Bytes per device of `rows` rows of `t` spread over `num_shards` devices by rows."""
    return math.ceil(rows / num_shards) * row_bytes(t)


def offloadable(t: TableSpec) -> bool:
    """What an offloaded table needs (`specs.Offload`): static ids, float32, a positional initializer."""
    return (t.dynamic is None and np.dtype(t.dtype) == np.float32
            and (t.initializer is None or isinstance(t.initializer, TruncatedNormal)))


def offload_to_fit(tables: dict[str, TableSpec], budget: int, where: str, num_shards: int) -> dict[str, TableSpec]:
    """`tables` with the largest offloadable ones given `storage=Offload(where/<name>, cache_rows)` so that the
    rest, and the caches, fit `budget` bytes per device (on row placement). Unchanged if they fit already."""
    size = {n: per_device(t.cache_rows, t, num_shards) for n, t in tables.items()}
    if sum(size.values()) <= budget:
        return tables
    candidates = sorted((n for n, t in tables.items() if t.storage is None and offloadable(t)),
                        key=lambda n: (-size[n], n))
    declared = sorted(n for n, t in tables.items() if t.storage is not None)  # their caches as declared
    fixed = sum(size[n] for n in declared)
    in_memory = sum(s for n, s in size.items() if n not in declared)
    offloaded: list[str] = []
    for n in candidates:
        if in_memory + fixed < budget and (offloaded or declared):
            break
        offloaded.append(n)
        in_memory -= size[n]
    room = budget - in_memory - fixed
    kept = f"the tables kept in memory need {in_memory}" + (
        f", the declared caches of {declared} {fixed}" if declared else "")
    if not offloaded:
        raise ValueError(f"memory_budget={budget} bytes per device is too small: {kept}, and no other table can be "
                         "offloaded; give a larger budget or more devices.")
    full = {n: per_device(tables[n].vocabulary_size, tables[n], num_shards) for n in offloaded}
    out = dict(tables)
    for n in offloaded:
        t = tables[n]
        share = room * full[n] / sum(full.values())
        rows = min(t.vocabulary_size, int(share // row_bytes(t)) * num_shards) if room > 0 else 0
        if rows < 1:
            raise ValueError(f"memory_budget={budget} bytes per device leaves no room for table {n!r}'s cache "
                             f"even with {sorted(offloaded)} offloaded ({kept}); give a larger budget or more "
                             "devices.")
        out[n] = dataclasses.replace(t, storage=Offload(os.path.join(where, n), cache_rows=rows))
    return out
