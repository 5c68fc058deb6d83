"""Host preprocessing: ids -> static-shape `ShardedCooMatrix` batches, one per stack, and `Stats`.

One path for one process and for several (under `jax.distributed`): each
process canonicalises and checks its own rows (`ids`), counts each stack's
entries per (device, shard) partition (`partition`), agrees with the other
processes on the numbers that decide shapes and errors, picks each stack's
capacity (`plan_state`), and fills the padded buffers. A stack that a
backend runs with its own batch type (`StackPlan.backend`) then goes through
that backend's hook (`INPUT_HOOKS`), which adds what its kernel reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple

import jax
import numpy as np

from sparse_embed.core.batch import ShardedCooMatrix, Stats
from sparse_embed.core.planning import EmbeddingPlan, StackPlan
from sparse_embed.core import sparsecore
from sparse_embed.host import distributed, native, plan_state, sparsecore_input
from sparse_embed.host.ids import (CanonicalIds, FeatureInputError, FlatIds, checked, error, fixed_width, flatten,
                                  truncated)
from sparse_embed.host.partition import Partitioned, partition
from sparse_embed.host.raw_ids import checked_raw, flatten_raw, partition_raw


# A backend's preprocessing hook by `StackPlan.backend`: `hook(plan, stacks, batch, several)` replaces its stacks'
# (numpy) COO batches in `batch` with its own batch type, agreeing with the other processes where it must, and
# returns the `Stats` fields it fills.
INPUT_HOOKS: dict[str, Callable[..., dict[str, dict]]] = {sparsecore.NAME: sparsecore_input.add_inputs}


def _check_keys(plan: EmbeddingPlan, ids, weights) -> dict:
    """`weights` as a mapping; errors listing the features `ids` or `weights` lack or have beyond the plan's."""
    features = plan.features
    weights = {} if weights is None else weights
    for what, given in (("ids", ids), ("weights", weights)):
        if not isinstance(given, Mapping):
            raise TypeError(f"{what} must be a mapping feature name -> {what}, got {type(given).__name__}.")
    for what, given in (("ids", ids), ("weights", weights)):
        unknown = sorted(set(given) - set(features), key=str)  # (key=str: names of any type, e.g. 1 and 'a')
        if unknown:
            raise ValueError(f"{what} has unknown features {unknown}; the plan's features are {sorted(features)}.")
    missing = sorted(set(features) - set(ids))
    if missing:
        raise ValueError(f"ids is missing features {missing}; every feature of the plan needs ids.")
    return weights


def _num_samples(x: Any) -> int | None:
    """Samples in one feature's ids (any accepted format), or None if that cannot be told."""
    try:
        if isinstance(x, tuple):
            return len(x[1]) if len(x) == 2 else None
        if isinstance(x, list):
            return len(x)
        return int(np.shape(x)[0])
    except Exception:  # noqa: BLE001 - malformed input: canonical() reports it
        return None


def _check_local_batch(plan: EmbeddingPlan, name: str, x: Any, local_batch: int, num_local: int) -> None:
    """Under several processes, each passes only its devices' rows: say so when the count is wrong."""
    f, n = plan.features[name], _num_samples(x)
    if n is not None and n != local_batch:
        raise error(f, f"got {n} samples, but this process (process {jax.process_index()} of "
                       f"{jax.process_count()}) must pass {local_batch}: the plan's mesh spans several processes, "
                       f"so each process passes only its own rows, {f.batch_size // plan.num_shards} samples for "
                       f"each of its {num_local} of the {plan.num_shards} devices (the global batch_size is "
                       f"{f.batch_size}).")


def _checked_features(plan: EmbeddingPlan, ids, weights, num_local: int) -> dict[str, FlatIds | CanonicalIds]:
    """Every feature's ids, checked: in C if the extension is there (then `partition` runs in C), else numpy."""
    weights, check = _check_keys(plan, ids, weights), (flatten if native.extension() is None else checked)
    out = {}
    for name, f in plan.features.items():
        if num_local != plan.num_shards:  # this process's rows only
            local_batch = f.batch_size // plan.num_shards * num_local
            _check_local_batch(plan, name, ids[name], local_batch, num_local)
            f = dataclasses.replace(f, batch_size=local_batch)
        raw_check = flatten_raw if native.extension() is None else checked_raw
        out[name] = (raw_check if f.table.dynamic else check)(f, ids[name], weights.get(name))
    return out


class _Numbers(NamedTuple):
    """One stack's numbers, agreed by every process."""

    needed: int  # most entries in a partition
    max_unique: int  # most unique rows in a partition
    num_ids: int
    dropped: int  # with an explicit capacity: entries past it
    worst: int  # the process with the fullest partition
    bound: int | None  # most entries a partition can get from batches of this shape (None: a ragged feature)
    truncated: int  # sequence features' ids past max_sequence_length, left out


_FIELDS = 6  # numbers per stack exchanged between processes: needed, max_unique, num_ids, dropped, bound, truncated


def _entry_bound(stack: StackPlan, ids: Mapping[str, Any]) -> int:
    """The most entries one of `stack`'s partitions can get from batches shaped like `ids`: every id of a
    device (its samples times each dense feature's width, a sequence feature's at most its length); -1 if a
    feature is ragged (its count varies by batch)."""
    total = 0
    for lay in stack.features:
        f, width = lay.feature, fixed_width(ids[lay.feature.name])
        if width is None:
            return -1
        total += lay.samples_per_device * (min(width, f.max_sequence_length) if f.is_sequence else width)
    return total


def _agree(plan: EmbeddingPlan, ids, parts: dict[str, Partitioned], cut: dict[str, int],
           failed: bool) -> dict[str, _Numbers]:
    """Every stack's numbers over all processes (one process: its own); raises on every process if one failed.
    `cut`: each stack's ids past a sequence feature's length (`truncated`)."""
    mine = [int(failed)]
    for s in plan.stacks:
        p = parts.get(s.name)
        # An explicit capacity is known up front, so each process can count its own drops.
        mine += [0] * _FIELDS if p is None else [
            p.needed, p.max_unique, p.num_ids, p.dropped(s.capacity) if s.capacity is not None else 0,
            _entry_bound(s, ids), cut[s.name]]
    processes = distributed.mesh_processes(plan.mesh)
    if len(processes) == 1:
        table = np.asarray([mine], np.int64)
    else:
        plan_state.check_same_plan(plan, processes)
        state = plan_state.of(plan)
        table = distributed.allgather_ints(processes, mine, name=state.tag, n=state.next_exchange())
    if failed:
        return {}
    bad = [processes[i] for i in np.flatnonzero(table[:, 0])]
    if bad:
        raise ValueError(f"preprocess failed on process(es) {bad} (see their error); this process "
                         f"({jax.process_index()}) raises too, so that no process runs a step the others skip.")
    out = {}
    for i, s in enumerate(plan.stacks):
        col = table[:, 1 + _FIELDS * i: 1 + _FIELDS * (i + 1)]
        out[s.name] = _Numbers(int(col[:, 0].max()), int(col[:, 1].max()), int(col[:, 2].sum()),
                               int(col[:, 3].sum()), processes[int(np.argmax(col[:, 0]))],
                               None if (col[:, 4] < 0).any() else int(col[:, 4].max()), int(col[:, 5].sum()))
    return out


def _partitions(plan: EmbeddingPlan, ids, weights, positions: list[int], several: bool,
                failure: BaseException | None = None):
    """Each stack's `Partitioned` entries of this process's rows, and the numbers all processes agree on
    (`failure`: this process failed before; it takes part in the exchange, then raises it)."""
    parts, cut = {}, {}
    try:
        if failure is None:
            flats = _checked_features(plan, ids, weights, len(positions))
            parts = {s.name: (partition_raw if s.dynamic else partition)(s, flats, len(positions))
                     for s in plan.stacks}
            cut = {s.name: sum(truncated(lay.feature, flats[lay.feature.name]) for lay in s.features)
                   for s in plan.stacks}
    except Exception as e:  # noqa: BLE001 - with several processes, every one must still take part in the exchange
        if not several:
            raise
        failure = _this_process(e)
    agreed = _agree(plan, ids, parts, cut, failure is not None)
    if failure is not None:
        raise failure
    return parts, agreed


def _this_process(e: Exception) -> Exception:
    """A feature's input error under several processes, saying that its sample numbers are this process's (they
    count the rows it passed, not the global batch's)."""
    if not isinstance(e, FeatureInputError):
        return e
    out = type(e)(f"{e} (On process {jax.process_index()} of {jax.process_count()}: samples are numbered within "
                  "the rows this process passed.)")
    out.__cause__ = e
    return out


def _overflow_error(stack: StackPlan, part: Partitioned, numbers: _Numbers, cap: int, positions: list[int]):
    feats = [lay.feature.name for lay in stack.features]
    fix = ("Raise capacity= in plan() (or use sparse_embed.grow_capacity(plan, stats)), or pass "
           "on_overflow='drop'.")
    if part.needed < numbers.needed:  # the fullest partition is another process's
        return ValueError(f"Stack {stack.name!r} (features {feats}): a partition on process {numbers.worst} has "
                          f"{numbers.needed} ids but the capacity is {cap}. {fix}")
    S, p = stack.segments, int(np.argmax(part.counts))
    return ValueError(f"Stack {stack.name!r} (features {feats}): partition (device {positions[p // S]}, shard "
                      f"{p % S}) has {int(part.counts[p])} ids but the capacity is {cap}. {fix}")


def _place(plan: EmbeddingPlan, coo: ShardedCooMatrix, several: bool) -> ShardedCooMatrix:
    """The batch on the plan's mesh, sharded over its axis (a global array built from every process's rows)."""
    sharding = plan.batch_sharding()
    if not several:
        return jax.device_put(coo, sharding)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x, (plan.num_shards, *x.shape[1:])),
                        coo)


def preprocess(
    plan: EmbeddingPlan,
    ids: Mapping[str, Any],
    weights: Mapping[str, Any] | None = None,
    *,
    device_put: bool = True,
) -> tuple[dict[str, ShardedCooMatrix], Stats]:
    """Builds the per-stack `ShardedCooMatrix` batch for one global batch of ids.

    Args:
      plan: the `EmbeddingPlan`.
      ids: feature name -> ids in any format of `sparse_embed.host.ids` (1-D,
        dense 2-D with -1 padding, ragged list, or `(values, row_lengths)`).
        Every feature of the plan must be present. The global batch of each
        feature is split evenly over the mesh devices in order.
      weights: feature name -> weights of the same structure (default 1).
      device_put: place the arrays on the plan's mesh (sharded over the
        device axis); False returns numpy arrays.

    Returns:
      `({stack: ShardedCooMatrix}, Stats)`.

    With `capacity=None`, a stack's capacity is the high-water mark of the
    batches preprocessed so far for this plan (host state, see `plan_state`);
    it grows, never shrinks. Thread-safe.

    Under `jax.distributed` (a mesh with devices of several processes), each
    process passes only its own rows (`sparse_embed.distributed.process_rows`)
    and gets global arrays (numpy arrays of its devices with
    `device_put=False`); the processes agree on every decision and the
    `Stats` are global. Every process must call it the same number of times,
    in the same order (docs/distributed.md).

    Raises:
      ValueError naming the feature for bad ids/weights/structure/batch size,
      or the stack for a capacity overflow under `on_overflow="error"`, or
      the table if the plan offloads it (`Tiers.preprocess` maps its ids to
      cache rows first).
    """
    if plan.tiered:
        names = ", ".join(repr(t.name) for t in plan.tiered)
        raise ValueError(f"Tables {names} are offloaded (storage=Offload(...)): preprocess their batches with "
                         "sparse_embed.offload.Tiers(plan, rng).preprocess or .prefetch, which map ids to cache rows.")
    return preprocess_cached(plan, ids, weights, device_put=device_put)


def preprocess_cached(plan: EmbeddingPlan, ids: Mapping[str, Any], weights: Mapping[str, Any] | None = None, *,
                      device_put: bool = True, failure: BaseException | None = None
                      ) -> tuple[dict[str, ShardedCooMatrix], Stats]:
    """`preprocess` where an offloaded table's ids are already its cache rows (`sparse_embed.tiers`);
    `failure`: the tiers failed on this process (raised here, after every process learns of it)."""
    several = distributed.spans_processes(plan)
    positions = distributed.local_positions(plan) if several else list(range(plan.num_shards))
    parts, agreed = _partitions(plan, ids, weights, positions, several, failure)
    state, batch = plan_state.of(plan), {}
    fields = {k: {} for k in Stats.__dataclass_fields__ if k != "batches"}  # (per stack; batches: one)
    fields["layouts"] = {s.name: s.batch_layout.digest for s in plan.stacks}
    for s in plan.stacks:  # before any stack's capacity grows: a failed preprocess changes nothing
        if s.capacity is not None and agreed[s.name].needed > s.capacity and plan.on_overflow == "error":
            raise _overflow_error(s, parts[s.name], agreed[s.name], s.capacity, positions)
    for s in plan.stacks:
        part, numbers = parts[s.name], agreed[s.name]
        cap = state.capacity(s, max(numbers.needed, 1), numbers.bound)  # the same on every process
        if numbers.needed > cap and plan.on_overflow == "error":
            raise _overflow_error(s, part, numbers, cap, positions)
        batch[s.name] = part.fill(s, cap)
        for k, v in zip(fields, (numbers.needed, numbers.max_unique, numbers.dropped, numbers.num_ids, cap)):
            fields[k][s.name] = v
        fields["truncated_ids"][s.name] = numbers.truncated
    fields.update(_backend_inputs(plan, batch, several))
    if device_put:
        batch = {k: _place(plan, v, several) for k, v in batch.items()}
    return batch, Stats(**fields)


def _backend_inputs(plan: EmbeddingPlan, batch: dict, several: bool) -> dict[str, dict]:
    """Runs each backend's hook on its stacks (none for a plan whose stacks no backend runs); its `Stats` fields."""
    by_backend: dict[str, list[StackPlan]] = {}
    for s in plan.stacks:
        if s.backend is not None:
            by_backend.setdefault(s.backend, []).append(s)
    fields = {}
    for backend, stacks in by_backend.items():
        fields.update(INPUT_HOOKS[backend](plan, stacks, batch, several))
    return fields
