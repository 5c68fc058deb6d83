"""Raw-id tables in natural form: one entry per live id, independent of mesh, shard count and rows.

`id_table_contents` reads a raw-id stack's table, slots and map into an
`IdTable` (sorted by id); `load_id_tables` places an `IdTable` onto any plan
with that table (another mesh, another process count): each id goes to its
owner shard under the new plan and gets a row there, so the id -> vector
mapping is the same. A shard that receives more ids than it has rows keeps
the most recently used ones and `load_id_tables` says how many it dropped.
"""

from __future__ import annotations

import warnings
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparse_embed.core.id_maps import IdMap, dynamic_stacks, pending_per_shard, with_directories
from sparse_embed.core.key_set import FREE, KeySet, full_keys, num_buckets
from sparse_embed.core.planning import EmbeddingPlan, StackPlan
from sparse_embed.core.raw_keys import join_words, owner_shards, split_words
from sparse_embed.core.state import SLOT_DTYPE, EmbeddingVariables
from sparse_embed.core.tables import to_host


class IdTable(NamedTuple):
    """A raw-id table's contents, sorted by id. `ids [n]` int64, `vectors [n, dim]`, `slots {name: [n, w]}`,
    `last [n]` int32 (step of last use); ids waiting for admission with their counts and last step; `seed [2]`."""

    ids: np.ndarray
    vectors: np.ndarray
    slots: dict[str, np.ndarray]
    last: np.ndarray
    pending_ids: np.ndarray
    pending_counts: np.ndarray
    pending_last: np.ndarray
    seed: np.ndarray


def _live(ks: KeySet):
    """Global slots that hold an id, and those ids (sorted by id), from one set per shard (host arrays)."""
    sizes = to_host(ks.size)
    S = sizes.size
    n = ks.order.shape[0] // S
    live = (np.arange(n)[None] < sizes[:, None]).reshape(-1)
    at = (to_host(ks.order) + np.repeat(np.arange(S) * n, n))[live].astype(np.int64)
    keys = to_host(ks.sorted_keys)
    if keys.ndim == 1:  # compact sets: [S * n] low words; the high words from each shard's buckets
        dirs, spans, slots = to_host(ks.directory).reshape(S, -1), to_host(ks.span).reshape(S, 3), to_host(ks.order)
        part = lambda i: KeySet(keys[i * n:(i + 1) * n], None, slots[i * n:(i + 1) * n], sizes[i], dirs[i], spans[i])
        keys = np.concatenate([np.asarray(full_keys(part(i))) for i in range(S)])
    ids = join_words(keys[live])
    order = np.argsort(ids, kind="stable")
    return at[order], ids[order]


def _expected_shapes(stack: StackPlan) -> dict[str, tuple[int, ...]]:
    """The shape (`sorted_keys`: its rows) of each array of an `IdMap` made for `stack` (`init_id_maps`)."""
    S, R, P = stack.num_shards, stack.rows_per_shard, pending_per_shard(stack)
    want = {"seed": (S, 2), "rows.size": (S,), "rows.order": (S * R,), "rows.last": (S * R,),
            "rows.sorted_keys": (S * R,)}
    if P:
        want.update({"pending.size": (S,), "pending.order": (S * P,), "pending.last": (S * P,),
                     "pending.sorted_keys": (S * P,), "counts": (S * P,)})
    return want


def _map_problems(stack: StackPlan, m: IdMap) -> list[str]:
    """How `m` differs from a map of `stack` (empty: it fits)."""
    P = pending_per_shard(stack)
    if (m.pending is None) != (P == 0) or (m.counts is None) != (P == 0):
        return [f"waiting ids {'missing' if P else 'present'} (the plan's table has admit_after="
                f"{stack.dynamic.admit_after}{f', {P} waiting ids per shard' if P else ''})"]
    problems = []
    for path, want in _expected_shapes(stack).items():
        obj = m
        for part in path.split("."):
            obj = getattr(obj, part)
        got = tuple(np.shape(obj))
        got = got[:1] if path.endswith("sorted_keys") else got
        if got != want:
            problems.append(f"{path} has shape {got}, expected {want}")
    return problems


def check_id_maps(plan: EmbeddingPlan, id_maps: Mapping[str, IdMap]) -> None:
    """Raises unless `id_maps` holds an `IdMap` made for each raw-id stack of `plan` (its shard count and rows)."""
    if not isinstance(id_maps, Mapping):
        raise TypeError(f"id_maps must be a mapping {{stack name: IdMap}} (from se.init_id_maps or se.map_ids), "
                        f"got {type(id_maps).__name__}.")
    for s in dynamic_stacks(plan):
        where = f"Table {s.first.name!r}" + (f" (stack {s.name!r})" if s.name != s.first.name else "")
        if s.name not in id_maps:
            raise ValueError(f"{where} is keyed by raw ids, but id_maps has no entry {s.name!r} for it (it has "
                             f"{sorted(map(str, id_maps))}): pass the maps that trained these tables.")
        m = id_maps[s.name]
        if not isinstance(m, IdMap):
            raise TypeError(f"{where}: id_maps[{s.name!r}] must be an IdMap, got {type(m).__name__}.")
        problems = _map_problems(s, m)
        if problems:
            raise ValueError(f"{where}: its id map is not one of this plan ({s.num_shards} shards of "
                             f"{s.rows_per_shard} rows): {'; '.join(problems)}. Pass the maps trained with these "
                             "tables, under this plan (not those of another mesh or vocabulary).")


def id_table_contents(plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables],
                      id_maps: Mapping[str, IdMap]) -> dict[str, IdTable]:
    """`{table: IdTable}` of every raw-id table, on the host (gathered from every process); raises if `id_maps`
    are not the plan's (`check_id_maps`)."""
    check_id_maps(plan, id_maps)
    out = {}
    for s in dynamic_stacks(plan):
        m, v = id_maps[s.name], tables[s.name]
        at, ids = _live(m.rows)
        if m.pending is not None:
            p_at, p_ids = _live(m.pending)
            p_counts, p_last = to_host(m.counts)[p_at], to_host(m.pending.last)[p_at]
        else:
            p_ids, p_counts, p_last = np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32)
        out[s.first.name] = IdTable(ids, to_host(v.table)[at], {k: to_host(a)[at] for k, a in v.slots.items()},
                                    to_host(m.rows.last)[at], p_ids, p_counts, p_last, to_host(m.seed)[0])
    return out


def expired(last: np.ndarray, step: int, expire_after: int) -> np.ndarray:
    """Which ids, last used at `last` (-1: no id), a lookup at `step` finds expired (`Dynamic.expire_after`)."""
    last = np.asarray(last).astype(np.int64)
    return (last != -1) & (last < int(step) - expire_after)


def live_at(plan: EmbeddingPlan, contents: Mapping[str, IdTable], step: int | None) -> dict[str, IdTable]:
    """`contents` without the ids a lookup at `step` finds expired (`Dynamic.expire_after`: last used before
    `step - expire_after`; they read zeros or the default there); as they are with `step` None."""
    out = dict(contents)
    for name, t in contents.items():
        after = plan.tables[name].dynamic.expire_after
        if step is not None and after is not None:
            keep = ~expired(t.last, step, after)
            out[name] = t._replace(ids=t.ids[keep], vectors=t.vectors[keep], last=t.last[keep],
                                   slots={k: a[keep] for k, a in t.slots.items()})
    return out


def _contents_problem(stack: StackPlan, t: IdTable) -> str | None:
    """What makes `t` unfit to place (None: it fits). The key sets are built assuming ids distinct, in
    `[0, 2**63)` and increasing, each with its vector, slots and last-use step (waiting ids: count and step);
    unsorted or repeated ids gave sets whose searches missed ids that `id_table_contents` still listed."""
    live = {"vectors": t.vectors, "last": t.last, **{f"slots[{k!r}]": a for k, a in t.slots.items()}}
    waiting = {"pending_counts": t.pending_counts, "pending_last": t.pending_last}
    for what, ids, per_id in (("ids", t.ids, live), ("pending_ids", t.pending_ids, waiting)):
        ids = np.asarray(ids)
        if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
            return f"{what} must be a 1-D array of integers, got dtype {ids.dtype} and shape {ids.shape}"
        for name, a in per_id.items():
            if np.shape(a)[:1] != ids.shape:
                return f"{name}: shape {np.shape(a)}, but there are {ids.size} {what}"
        bad = [int(x) for x in (ids.min(), ids.max()) if not 0 <= int(x) < 2**63] if ids.size else []
        if bad:
            return f"{what} hold {bad[0]}: raw ids are in [0, 2**63)"
        if ids.size > 1 and not (np.diff(ids.astype(np.int64)) > 0).all():
            return f"{what} must be distinct and in increasing order (an IdTable is sorted by id)"
    if np.shape(t.vectors)[1:] != (stack.embedding_dim,):
        return f"vectors: shape {np.shape(t.vectors)}, but the plan's table has embedding_dim {stack.embedding_dim}"
    specs = stack.optimizer.slots(stack.embedding_dim)
    for k, a in t.slots.items():
        if k in specs and np.shape(a)[1:] != (specs[k].width,):
            return (f"slots[{k!r}]: shape {np.shape(a)}, but the plan's {type(stack.optimizer).__name__} keeps "
                    f"{specs[k].width} values a row in it")
    return None


def _per_shard(ids: np.ndarray, last: np.ndarray, S: int, caps: list[int]):
    """Each shard's entries (indices into ids, sorted by id) and how many did not fit (least recent dropped)."""
    owners, shards, dropped = owner_shards(ids, S), [], 0
    for s in range(S):
        mine = np.flatnonzero(owners == s)
        if mine.size > caps[s]:
            keep = np.lexsort((ids[mine], -last[mine].astype(np.int64)))[: caps[s]]
            dropped += mine.size - caps[s]
            mine = np.sort(mine[keep])  # ids are sorted, so indices in id order
        shards.append(mine)
    return shards, dropped


def _sets(shards: list[np.ndarray], ids: np.ndarray, last: np.ndarray, n: int) -> tuple[KeySet, np.ndarray]:
    """Host arrays of one KeySet per shard, concatenated, and each entry's global slot."""
    S = len(shards)
    keys = np.full((S * n, 2), FREE, np.int32)
    lasts = np.full(S * n, FREE, np.int32)
    slot = np.zeros(ids.size, np.int64)
    for s, mine in enumerate(shards):
        slot[mine] = s * n + np.arange(mine.size)
        keys[slot[mine]] = split_words(ids[mine])
        lasts[slot[mine]] = last[mine]
    order = np.tile(np.arange(n, dtype=np.int32), S)  # entry k of a shard at row k (and position k): id order
    directory = np.zeros(S * (num_buckets(n) + 1), np.int32)  # rebuilt on device (`with_directories`)
    sets = KeySet(keys, lasts, order, np.array([m.size for m in shards], np.int32), directory, np.zeros(2 * S, np.float32))
    return sets, slot


def _place(plan: EmbeddingPlan, stack: StackPlan, t: IdTable, with_slots: bool):
    S, R = stack.num_shards, stack.rows_per_shard
    vocab = stack.first.vocabulary_size
    caps = [max(-(-(vocab - s) // S), 0) for s in range(S)]
    shards, dropped = _per_shard(t.ids, t.last, S, caps)
    rows, slot = _sets(shards, t.ids, t.last, R)
    kept = np.concatenate(shards) if shards else np.zeros(0, np.int64)
    table = np.zeros((S * R, stack.embedding_dim), stack.dtype)
    table[slot[kept]] = t.vectors[kept]
    specs = stack.optimizer.slots(stack.embedding_dim)
    slots = {}
    if with_slots:
        for k, spec in specs.items():
            a = np.full((S * R, spec.width), spec.init, SLOT_DTYPE)
            if k in t.slots:
                a[slot[kept]] = t.slots[k][kept]
            slots[k] = a
    pend, counts, p_dropped = None, None, 0
    P = pending_per_shard(stack)
    if P:
        p_shards, p_dropped = _per_shard(t.pending_ids, t.pending_last, S, [P] * S)
        pend, p_slot = _sets(p_shards, t.pending_ids, t.pending_last, P)
        counts = np.zeros(S * P, np.int32)
        p_kept = np.concatenate(p_shards)
        counts[p_slot[p_kept]] = t.pending_counts[p_kept]
    seed = np.tile(np.asarray(t.seed, np.uint32)[None], (S, 1))
    return EmbeddingVariables(table, slots), IdMap(rows, pend, counts, seed), (dropped, p_dropped)


def load_id_tables(plan: EmbeddingPlan, contents: Mapping[str, IdTable], *, with_slots: bool = True):
    """`IdTable`s -> `({stack: EmbeddingVariables}, {stack: IdMap})` of the plan's raw-id stacks, sharded.

    Warns with the count when a shard of this plan has fewer rows than the
    ids it owns, or fewer waiting places (`pending_capacity`) than the ids
    waiting for admission it owns (the least recently used are dropped).
    Raises for contents that are no `IdTable` of the plan's table, or of a table it does not key by raw ids.
    """
    raw = [s.first.name for s in dynamic_stacks(plan)]
    unused = sorted(set(contents) - set(raw))
    if unused:  # (as a restore refuses a checkpoint's table the plan lacks: no trained table dropped silently)
        kind = "a static table in the plan" if unused[0] in plan.tables else "not in the plan"
        raise ValueError(f"Table {unused[0]!r} of the contents is {kind} (its raw-id tables are {raw}): its ids "
                         "and vectors would be dropped; load contents of the plan's raw-id tables only.")
    tables, maps = {}, {}
    for s in dynamic_stacks(plan):
        name = s.first.name
        if name not in contents:
            raise ValueError(f"Table {name!r} is keyed by raw ids in the plan, but the contents have no entry for it "
                             f"(they have {sorted(contents)}).")
        bits, t = s.dynamic.id_bits, contents[name]
        problem = _contents_problem(s, t)
        if problem:
            raise ValueError(f"Table {name!r}: the contents do not fit an IdTable: {problem}.")
        top = max([int(x.max()) for x in (t.ids, t.pending_ids) if x.size], default=-1)
        if bits is not None and top >= 2**bits:
            raise ValueError(f"Table {name!r}: the contents hold id {top}, but the plan's table takes ids below "
                             f"2**{bits} (Dynamic(id_bits={bits})).")
        v, m, (dropped, waiting) = _place(plan, s, t, with_slots)
        if dropped:
            warnings.warn(f"Table {name!r}: {dropped} ids did not fit their owner shards under this plan "
                          f"({s.num_shards} shards of {s.rows_per_shard} rows); the least recently used were dropped.",
                          stacklevel=2)
        if waiting:
            warnings.warn(f"Table {name!r}: {waiting} ids waiting for admission did not fit their owner shards' "
                          f"waiting places under this plan ({s.num_shards} shards of {pending_per_shard(s)}: "
                          "Dynamic.pending_capacity); the least recently seen were forgotten (their counts start "
                          "again).", stacklevel=2)
        put = lambda x: jax.device_put(jnp.asarray(x), plan.table_sharding()) if x is not None else None
        tables[s.name], maps[s.name] = jax.tree.map(put, v), jax.tree.map(put, m)
    return tables, with_directories(plan, maps) if maps else maps
