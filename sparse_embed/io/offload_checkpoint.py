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

Under several processes each process's store holds its own rows (`tiers.processes`): each records its
stores' commits in `offload.process<i>of<P>.json`, and on restore checks its own; the processes agree
(`host.distributed`) before any of them changes a store.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import zlib
from typing import Any, Mapping, NamedTuple

import jax

from sparse_embed.core.planning import EmbeddingPlan
from sparse_embed.core.state import EmbeddingVariables
from sparse_embed.core.tables import empty_tables
from sparse_embed.host import distributed, plan_state
from sparse_embed.io.ckpt_format import EMBEDDINGS, CheckpointError, CorruptCheckpointError
from sparse_embed.tiers import store as tier_store
from sparse_embed.tiers.processes import check_layout

RECORD = "offload.json"  # one process's record; process i of P: offload.process<i>of<P>.json
_RESTORES: dict[str, int] = {}  # plan tag -> restores of such a plan (the processes' exchange numbers)
_LOCK = threading.Lock()


class Commits(NamedTuple):
    """What a save records: the file (this process's) and `{table: {"path", "commit", "id", "step"}}`."""

    file: str
    stores: dict[str, dict[str, Any]]


def _place(plan: EmbeddingPlan) -> tuple[int, int]:
    """`(index, count)` of this process among the processes of the plan's mesh."""
    processes = distributed.mesh_processes(plan.mesh)
    return processes.index(jax.process_index()), len(processes)


def _record(plan: EmbeddingPlan) -> str:
    index, count = _place(plan)
    return RECORD if count == 1 else f"offload.process{index}of{count}.json"


def split(plan: EmbeddingPlan) -> tuple[EmbeddingPlan, EmbeddingPlan]:
    """`(the plan's in-memory stacks, its offloaded tables' stacks)`, each a plan of its own."""
    tiered = set(plan.tiered_tables)
    caches = tuple(s for s in plan.stacks if s.tables[0].table.name in tiered)
    return (dataclasses.replace(plan, stacks=tuple(s for s in plan.stacks if s not in caches), tiered=()),
            dataclasses.replace(plan, stacks=caches))


def for_save(plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables], tiers: Any,
             step: int) -> tuple[EmbeddingPlan, dict[str, EmbeddingVariables], Commits | None]:
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
    if sorted(tiers.tables) != names or any(tiers.tables[n].spec != plan.tiered_tables[n] for n in names):
        raise ValueError(f"CheckpointManager.save: the Tiers given hold tables {sorted(tiers.tables)}, not the "
                         f"plan's offloaded tables {names} as declared.")
    commits = Commits(_record(plan), tiers.committed(step))
    memory, _ = split(plan)
    missing = sorted(set(plan.stack_names) - set(tables))
    if missing:
        raise ValueError(f"CheckpointManager.save: the tables lack stacks {missing} of the plan.")
    return memory, {k: tables[k] for k in memory.stack_names}, commits


def _checksum(commits: Mapping[str, Any]) -> str:
    return f"{zlib.crc32(json.dumps(commits, sort_keys=True).encode()):08x}"


def write_commits(directory: str, commits: Commits | None) -> None:
    """Writes this process's record (the stores' commits and their checksum) into a step's staged `embeddings`."""
    if commits is not None:
        with open(os.path.join(directory, commits.file), "w") as f:
            json.dump({"stores": commits.stores, "crc32": _checksum(commits.stores)}, f, indent=1, sort_keys=True)


def record_files(step_dir: str) -> list[str]:
    """The records of stores' commits a step holds (`offload.json`, `offload.process<i>of<P>.json`), by name."""
    item = os.path.join(step_dir, EMBEDDINGS)
    return sorted(n for n in (os.listdir(item) if os.path.isdir(item) else ())
                  if re.fullmatch(r"offload(\.process\d+of\d+)?\.json", n))


def read_commits(plan: EmbeddingPlan, step_dir: str) -> dict | None:
    """This process's stores' commits the step recorded, checked (None: it recorded none)."""
    path = os.path.join(step_dir, EMBEDDINGS, _record(plan))
    if not os.path.exists(path):
        others = record_files(step_dir)  # (a step without its item: the restore names the missing item)
        if others:
            raise CheckpointError(f"{step_dir} was saved by another number of processes than this run's "
                                  f"{_place(plan)[1]} (it has {others}): restore it with as many.")
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
    commits = read_commits(plan, step_dir) or {}
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

    Every store (of every process) is checked before any is changed: a table the step did not record, a store
    open in this process, or one that does not keep the commit raises naming the table.
    """
    if not plan.tiered:
        return {}
    commits = read_commits(plan, step_dir) or {}
    stores, failure = [], None
    try:
        try:
            for name, spec in sorted(plan.tiered_tables.items()):
                stores.append(_checked_store(plan, spec, commits.get(name), step_dir))
        except Exception as e:  # noqa: BLE001 - with several processes, every one must still take part in the exchange
            failure = e
        _agree(plan, failure)
        for s in stores:
            s.rollback_to(commits[s.table.name]["id"])
    finally:
        for s in stores:
            s.close()
    return empty_tables(split(plan)[1])


def _checked_store(plan: EmbeddingPlan, spec, commit: dict | None, step_dir: str) -> tier_store.RowStore:
    """This process's store of `spec`, opened, once it is known to keep `commit`; else a CheckpointError."""
    name, (index, count) = spec.name, _place(plan)
    if commit is None:
        raise CheckpointError(f"Table {name!r} is offloaded in the plan, but the checkpoint {step_dir} does not "
                              "hold it.")
    path = tier_store.shard_path(spec.storage.path, index, count)
    if tier_store.is_open(path):
        raise CheckpointError(f"Table {name!r}: its store at {path!r} is open (a Tiers of this process); close it "
                              "(tiers.close()) before restoring, then make a new Tiers.")
    check_layout(name, spec.storage.path, count)
    store = tier_store.RowStore(spec, path=path, create=False)
    if commit["id"] not in [h["id"] for h in store.history]:
        store.close()
        raise CheckpointError(
            f"Table {name!r}: the checkpoint {step_dir} needs commit {commit['commit']} (step {commit['step']}, id "
            f"{commit['id']}) of the store at {path!r} (saved from {commit['path']!r}), which that store does "
            f"not keep: it keeps {[(h['commit'], h['step']) for h in store.history]} (commit, step), its last "
            f"{tier_store.KEPT_COMMITS}, or is another store.")
    return store


def _agree(plan: EmbeddingPlan, failure: Exception | None) -> None:
    """Raises `failure` here, and on every other process of the plan's mesh when one has one."""
    processes = distributed.mesh_processes(plan.mesh)
    if len(processes) > 1:
        tag = plan_state.of(plan).tag
        with _LOCK:
            n = _RESTORES[tag] = _RESTORES.get(tag, -1) + 1
        flags = distributed.allgather_ints(processes, [int(failure is not None)], name=f"offload_restore.{tag}", n=n)
        bad = [processes[i] for i in map(int, flags[:, 0].nonzero()[0])]
        if bad and failure is None:
            raise CheckpointError(f"Restoring the offloaded tables' stores failed on process(es) {bad} (see their "
                                  "error); no store was changed.")
    if failure is not None:
        raise failure
