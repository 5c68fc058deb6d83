"""Raw-id tables in a checkpoint: stored in id order with their ids, restored onto any plan.

A raw-id table `t` is stored in the table store like any table (`t/table`
and `t/<slot>`, `[vocabulary_size, width]`), but row k holds the k-th live
id in increasing order (then zeros), and beside them: `t/ids` `[vocab, 2]`
int32 words (-1: unused row), `t/last` `[vocab, 1]` int32, `t/seed` `[1, 2]`
uint32, and the ids waiting for admission in `t.pending/ids`, `/counts`,
`/last` (`[max(n, 1), ...]`). Every array has a checksum. Restoring places
the ids onto the new plan's owner shards (`id_tables.load_id_tables`).
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax
import numpy as np

from sparse_embed.core.id_maps import IdMap, dynamic_stacks
from sparse_embed.core.planning import EmbeddingPlan
from sparse_embed.core.raw_keys import join_words, split_words
from sparse_embed.core.relayout import TABLE_KEY
from sparse_embed.core.state import EmbeddingVariables
from sparse_embed.io import store
from sparse_embed.io.id_tables import IdTable, id_table_contents, load_id_tables

PENDING = ".pending"  # suffix of the store group holding a table's waiting ids
IDS_KEY = "ids"
RAW_KEYS = ((IDS_KEY, ""), ("last", ""), ("seed", ""), (IDS_KEY, PENDING), ("counts", PENDING), ("last", PENDING))


def raw_layout(key: str, suffix: str, vocab: int) -> store.Layout:
    """What a raw-id table's stored array `key` of group `table + suffix` must be (see the module doc)."""
    if key == "seed":
        return store.Layout(np.uint32, 2, 1)
    return store.Layout(np.int32, 2 if key == IDS_KEY else 1, vocab if suffix == "" else None)


def _padded(a: np.ndarray, rows: int, fill) -> np.ndarray:
    out = np.full((rows,) + a.shape[1:], fill, a.dtype)
    out[: a.shape[0]] = a
    return out


def _host_arrays(name: str, vocab: int, t: IdTable) -> dict[str, dict[str, np.ndarray]]:
    """The store arrays of one raw-id table (see the module doc)."""
    main = {TABLE_KEY: _padded(t.vectors, vocab, 0), "ids": _padded(split_words(t.ids), vocab, -1),
            "last": _padded(t.last.reshape(-1, 1), vocab, -1), "seed": np.asarray(t.seed, np.uint32).reshape(1, 2)}
    main.update({k: _padded(a, vocab, 0) for k, a in t.slots.items()})
    p = max(t.pending_ids.size, 1)
    pending = {"ids": _padded(split_words(t.pending_ids), p, -1),
               "counts": _padded(t.pending_counts.reshape(-1, 1).astype(np.int32), p, 0),
               "last": _padded(t.pending_last.reshape(-1, 1).astype(np.int32), p, -1)}
    return {name: main, name + PENDING: pending}


def write_id_tables(directory: str, plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables],
                    id_maps: Mapping[str, IdMap]) -> dict[str, str]:
    """Writes every raw-id table into the store at `directory` (process 0); returns their checksums."""
    arrays = {}
    for name, t in id_table_contents(plan, tables, id_maps).items():
        arrays.update(_host_arrays(name, plan.tables[name].vocabulary_size, t))
    if jax.process_index() == 0:
        return store.write_host(directory, arrays)
    return {f"{g}/{k}": store.host_checksum(np.ascontiguousarray(a)) for g, keys in arrays.items() for k, a in keys.items()}


def raw_arrays(read, name: str, serving: bool):
    """`(group, key, array)` of a raw-id table's arrays besides table and slots (`read(group, key)`)."""
    keys = ((IDS_KEY, ""),) if serving else RAW_KEYS
    return ((name + suffix, key, read(name + suffix, key)) for key, suffix in keys)


def read_id_tables(plan: EmbeddingPlan, slots: Mapping[str, list[str]], read: Callable[[str, str], np.ndarray], *,
                   with_slots: bool = True, serving_step: int | None = None):
    """The plan's raw-id stacks from the store: `({stack: EmbeddingVariables}, {stack: IdMap})`.

    `slots[table]`: the slot names saved with it; `read(group, key)`: a stored array on the host, verified.
    `serving_step`: a serving checkpoint's step (it stores each table's ids and rows only): its ids read as last
    used then, with no waiting ids and a zero seed (for an eval; training goes on from a training checkpoint).
    """
    contents = {}
    serving = serving_step is not None
    for s in dynamic_stacks(plan):
        name = s.first.name
        get = lambda key, group=name: read(group, key)  # noqa: E731
        words = get("ids")
        n = int((words[:, 0] != -1).sum())
        if serving:
            contents[name] = IdTable(join_words(words[:n]), get(TABLE_KEY)[:n], {}, np.full(n, serving_step, np.int32),
                                     np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32),
                                     np.zeros(2, np.uint32))
            continue
        p_words = get("ids", name + PENDING)
        m = int((p_words[:, 0] != -1).sum())
        contents[name] = IdTable(
            join_words(words[:n]), get(TABLE_KEY)[:n], {k: get(k)[:n] for k in slots[name]} if with_slots else {},
            get("last")[:n, 0], join_words(p_words[:m]), get("counts", name + PENDING)[:m, 0],
            get("last", name + PENDING)[:m, 0], get("seed")[0])
    return load_id_tables(plan, contents, with_slots=with_slots)
