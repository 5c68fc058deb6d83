"""Checkpoints of a plan with offloaded tables: the in-memory tables through orbax, each offloaded table as its
store's commit.

An offloaded table's store is written in place and committed by `Tiers.flush(tables, step)`, incrementally
(only the rows changed since the last commit). So `CheckpointManager.save(step, plan, tables, tiers=tiers)`
saves the other tables as usual and records, for each offloaded table, its store's commit at `step` (path,
number, id, step) in `offload.json` of the step's `embeddings` item, with a checksum: a copy of the store it
is not. The device cache is not saved: after the flush the store holds every row, and a restored run starts
with an empty cache (which rows are cached never changes a value, only what is read and written).

`restore` makes each store that commit again (`RowStore.rollback_to`): a store keeps its last
`KEPT_COMMITS` commits, so restoring an older checkpoint, or one saved before a crash that came after the
flush of a save that never completed, goes back. A store that no longer keeps the commit (or another store
at that path) is a `CheckpointError` naming the table, and no store is changed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from typing import Any, Mapping

from sparse_embed.core.planning import EmbeddingPlan
from sparse_embed.core.state import EmbeddingVariables
from sparse_embed.core.tables import empty_tables
from sparse_embed.host import distributed
from sparse_embed.io.ckpt_format import EMBEDDINGS, CheckpointError, CorruptCheckpointError
from sparse_embed.tiers import store as tier_store

RECORD = "offload.json"


def split(plan: EmbeddingPlan) -> tuple[EmbeddingPlan, EmbeddingPlan]:
    """`(the plan's in-memory stacks, its offloaded tables' stacks)`, each a plan of its own."""
    tiered = set(plan.tiered_tables)
    caches = tuple(s for s in plan.stacks if s.tables[0].table.name in tiered)
    return (dataclasses.replace(plan, stacks=tuple(s for s in plan.stacks if s not in caches), tiered=()),
            dataclasses.replace(plan, stacks=caches))


def _one_process(plan: EmbeddingPlan) -> None:
    if distributed.spans_processes(plan):
        raise NotImplementedError(f"CheckpointManager: tables {sorted(plan.tiered_tables)} are offloaded and the "
                                  "plan's mesh spans several processes; checkpoints of offloaded tables run in one "
                                  "process for now (each process's store is committed by tiers.flush: "
                                  "docs/offload.md).")


def for_save(plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables], tiers: Any,
             step: int) -> tuple[EmbeddingPlan, dict[str, EmbeddingVariables], dict | None]:
    """`(plan, tables, commits)` a save writes: the in-memory part of the plan and its tables, and each
    offloaded table's store commit at `step` (None without offloaded tables). Raises naming the table when the
    tiers are missing, another plan's, or not flushed at `step`."""
    if not plan.tiered:
        if tiers is not None:
            raise ValueError("CheckpointManager.save(tiers=...): the plan has no offloaded table.")
        return plan, dict(tables), None
    names = sorted(plan.tiered_tables)
    if tiers is None:
        raise ValueError(f"Tables {names} are offloaded: flush them and pass their Tiers, `tables = "
                         f"tiers.flush(tables, step); manager.save(step, plan, tables, tiers=tiers)` (the "
                         "checkpoint records each store's commit; only the rows changed since the last one are "
                         "written).")
    _one_process(plan)
    if sorted(tiers.tables) != names or any(tiers.tables[n].spec != plan.tiered_tables[n] for n in names):
        raise ValueError(f"CheckpointManager.save: the Tiers given hold tables {sorted(tiers.tables)}, not the "
                         f"plan's offloaded tables {names} as declared.")
    commits = tiers.committed(step)
    memory, _ = split(plan)
    missing = sorted(set(plan.stack_names) - set(tables))
    if missing:
        raise ValueError(f"CheckpointManager.save: the tables lack stacks {missing} of the plan.")
    return memory, {k: tables[k] for k in memory.stack_names}, commits


def _checksum(commits: Mapping[str, Any]) -> str:
    return f"{zlib.crc32(json.dumps(commits, sort_keys=True).encode()):08x}"


def write_commits(directory: str, commits: Mapping[str, Any] | None) -> None:
    """Writes `offload.json` (the stores' commits and their checksum) into a step's staged `embeddings`."""
    if commits is not None:
        with open(os.path.join(directory, RECORD), "w") as f:
            json.dump({"stores": commits, "crc32": _checksum(commits)}, f, indent=1, sort_keys=True)


def read_commits(step_dir: str) -> dict | None:
    """The stores' commits a step recorded, checked (None: it recorded none)."""
    path = os.path.join(step_dir, EMBEDDINGS, RECORD)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
        commits = record["stores"]
        ok = record["crc32"] == _checksum(commits)
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}).") from None
    if not ok:
        raise CorruptCheckpointError(f"{path} fails its checksum: the stores' commits it records are damaged.")
    return commits


def memory_plan(plan: EmbeddingPlan, step_dir: str, saved_tables: tuple[str, ...]) -> EmbeddingPlan:
    """The in-memory part of `plan`, to restore from the step's tables; a CheckpointError naming the table when
    the plan offloads a table the step holds in memory, or the other way round."""
    commits = read_commits(step_dir) or {}
    for name in plan.tables:
        offloaded, stored = name in plan.tiered_tables, name in commits
        if offloaded != stored and (name in saved_tables or stored):
            how = ("offloaded in the plan but in memory in", "into a plan that keeps it in memory, then "
                   "sparse_embed.offload.write_store moves it to a store") if offloaded else \
                  ("in memory in the plan but offloaded in", "into a plan that offloads it, then "
                   "sparse_embed.offload.store_state reads it whole")
            raise CheckpointError(f"Table {name!r} is {how[0]} the checkpoint {step_dir}: restore it {how[1]}.")
    return split(plan)[0]


def restore_stores(plan: EmbeddingPlan, step_dir: str) -> dict[str, EmbeddingVariables]:
    """Makes each offloaded table's store the commit the step recorded; returns their stacks' (empty) caches.

    Every store is checked before any is changed: a table the step did not record, a store open in this
    process, or one that does not keep the commit raises naming the table.
    """
    if not plan.tiered:
        return {}
    _one_process(plan)
    commits = read_commits(step_dir) or {}
    stores = []
    try:
        for name, spec in sorted(plan.tiered_tables.items()):
            if name not in commits:
                raise CheckpointError(f"Table {name!r} is offloaded in the plan, but the checkpoint {step_dir} "
                                      "does not hold it.")
            if tier_store.is_open(spec.storage.path):
                raise CheckpointError(f"Table {name!r}: its store at {spec.storage.path!r} is open (a Tiers of this "
                                      "process); close it (tiers.close()) before restoring, then make a new Tiers.")
            stores.append(tier_store.RowStore(spec))
            kept = [h["id"] for h in stores[-1].history]
            if commits[name]["id"] not in kept:
                c = commits[name]
                raise CheckpointError(
                    f"Table {name!r}: the checkpoint {step_dir} needs commit {c['commit']} (step {c['step']}, id "
                    f"{c['id']}) of the store at {spec.storage.path!r} (saved from {c['path']!r}), which that store "
                    f"does not keep: it keeps {[(h['commit'], h['step']) for h in stores[-1].history]} (commit, "
                    f"step), its last {tier_store.KEPT_COMMITS}, or is another store.")
        for s in stores:
            s.rollback_to(commits[s.table.name]["id"])
    finally:
        for s in stores:
            s.close()
    return empty_tables(split(plan)[1])
