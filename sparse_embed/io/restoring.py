"""Restoring a step onto any plan: checked against the plan, streamed from the table store, verified.

Restoring checks the plan's tables against `meta` (a clear `ValueError`
naming the table otherwise), then streams each stored array, chunk by
chunk, into the plan's stacks (one `all_to_all` per chunk; memory: the
state plus a few chunks). Raw-id tables come back placed for the plan
(`io.id_checkpoint`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

from sparse_embed.core.planning import EmbeddingPlan
from sparse_embed.core.relayout import TABLE_KEY, from_natural, stored_rows
from sparse_embed.core.state import EmbeddingVariables
from sparse_embed.core.tables import empty_tables, init_tables, natural_table
from sparse_embed.io import direct, store
from sparse_embed.io.checks import array_name, check_sums, verify_embeddings, warn_unverified
from sparse_embed.io.ckpt_format import (
    EMBEDDINGS, FORMAT, CheckpointInfo, CorruptCheckpointError, TableRecord, resolve, stored_layout, unreadable_error,
)
from sparse_embed.io.id_checkpoint import read_id_tables
from sparse_embed.io.orbax_items import checkpointer, read_info
from sparse_embed.io.quantize import BITS


def check_compatible(plan: EmbeddingPlan, info: CheckpointInfo, where: str, *, allow_vocab_growth: bool,
                     with_slots: bool = True) -> None:
    """Raises a ValueError naming the table if the plan cannot be restored from `info` (its slots only if they
    are restored: `with_slots=False` reads none, so another optimizer takes the tables)."""
    missing = sorted(set(plan.tables) - set(info.table_names))
    if missing:
        raise ValueError(
            f"Table {missing[0]!r} is not in the checkpoint {where} (it has tables {info.table_names}); "
            "restore from a checkpoint that has it, or remove its features from the plan."
        )
    unused = sorted(set(info.table_names) - set(plan.tables))
    if unused:
        raise ValueError(
            f"Table {unused[0]!r} of the checkpoint {where} is not in the plan (plan tables {sorted(plan.tables)}); "
            "add a feature that reads it, so that no trained table is silently dropped."
        )
    for name, t in plan.tables.items():
        rec, want = info.table(name), TableRecord.from_spec(t)
        if rec.dynamic != want.dynamic:
            saved = "keyed by raw ids" if rec.dynamic else "a static table (ids are rows)"
            raise ValueError(f"Table {name!r} is {saved} in the checkpoint {where}, but "
                             f"{'keyed by raw ids' if want.dynamic else 'static'} in the plan; use the same kind.")
        if rec.embedding_dim != t.embedding_dim:
            raise ValueError(f"Table {name!r}: embedding_dim is {rec.embedding_dim} in the checkpoint {where} "
                             f"but {t.embedding_dim} in the plan.")
        if rec.dtype in BITS:  # no TableSpec holds quantized rows: the advice below could not be followed
            raise ValueError(f"Table {name!r} is quantized ({rec.dtype}) in the serving checkpoint {where}: it cannot "
                             "be restored into a plan's tables; read it with se.load_serving (serving_lookup), or "
                             "restore from a float checkpoint.")
        if rec.dtype != want.dtype:
            raise ValueError(f"Table {name!r}: dtype is {rec.dtype} in the checkpoint {where} but {want.dtype} in "
                             "the plan; use the checkpoint's dtype.")
        if with_slots and info.kind == "training" and rec.slots != want.slots:
            raise ValueError(
                f"Table {name!r}: the checkpoint {where} has optimizer {rec.optimizer} with slots {dict(rec.slots)}, "
                f"the plan has {want.optimizer} with slots {dict(want.slots)}; use the same optimizer."
            )
        if rec.dynamic:  # any capacity: ids are placed anew (the least recently used dropped if it is smaller)
            continue
        if rec.vocabulary_size > t.vocabulary_size:
            raise ValueError(f"Table {name!r}: vocabulary_size is {rec.vocabulary_size} in the checkpoint {where} "
                             f"but {t.vocabulary_size} in the plan; a vocabulary cannot shrink.")
        if rec.vocabulary_size < t.vocabulary_size and not allow_vocab_growth:
            raise ValueError(
                f"Table {name!r}: vocabulary_size is {rec.vocabulary_size} in the checkpoint {where} but "
                f"{t.vocabulary_size} in the plan; pass allow_vocab_growth=True (and rng=) to initialise the "
                "new rows, or use the checkpoint's vocabulary_size."
            )


def restore_embeddings(
    plan: EmbeddingPlan,
    path: str | os.PathLike,
    *,
    step: int | None = None,
    allow_vocab_growth: bool = False,
    rng: jax.Array | None = None,
    with_slots: bool = True,
) -> dict[str, EmbeddingVariables]:
    """The plan's stacked, sharded state from a training (or, with `with_slots=False`, serving) checkpoint.

    Works for any mesh size and stacking. New rows of a grown vocabulary get
    the table's initializer from `rng` (as `init_tables(plan, rng)`) and
    fresh slots. Every array is verified against its checksum
    (`CorruptCheckpointError` naming the array otherwise). Raw-id tables
    come back placed for this plan; `CheckpointManager.restore` also
    returns their `id_maps`.
    """
    return restore_state(plan, resolve(path, step), allow_vocab_growth=allow_vocab_growth, rng=rng,
                         with_slots=with_slots)[0]


def static_part(plan: EmbeddingPlan) -> EmbeddingPlan:
    """The plan without its raw-id stacks (those are stored in id order, `id_checkpoint`)."""
    return dataclasses.replace(plan, stacks=tuple(s for s in plan.stacks if s.dynamic is None))


def restore_state(plan: EmbeddingPlan, step_dir: str, *, allow_vocab_growth: bool = False,
                  rng: jax.Array | None = None, with_slots: bool = True):
    """`(tables, id_maps)` of the plan from one step directory (see `restore_embeddings`)."""
    info = read_info(step_dir)
    warn_unverified(step_dir, info)
    check_compatible(plan, info, step_dir, allow_vocab_growth=allow_vocab_growth, with_slots=with_slots)
    if with_slots and info.kind != "training":
        raise ValueError(f"{step_dir} is a {info.kind} checkpoint without optimizer slots; "
                         "restore it with with_slots=False, or restore a training checkpoint.")
    static = static_part(plan)
    grown = {n: (info.table(n).vocabulary_size, t.vocabulary_size) for n, t in static.tables.items()
             if info.table(n).vocabulary_size < t.vocabulary_size}
    if grown and rng is None:  # before anything is read; the table named (the check below the readers names none)
        name, (saved, now) = next(iter(sorted(grown.items())))
        raise ValueError(f"Table {name!r}: vocabulary_size is {saved} in the checkpoint {step_dir} but {now} in the "
                         "plan: its new rows need their initial values, pass rng= (as to init_tables).")
    if info.format == FORMAT:
        tables = _stream_in(static, step_dir, info, allow_vocab_growth=allow_vocab_growth, rng=rng,
                            with_slots=with_slots)
    else:
        tables = _legacy_in(static, step_dir, info, rng=rng, with_slots=with_slots)
    if len(static.stacks) == len(plan.stacks):
        return tables, {}
    slots = {t.name: [k for k, _ in t.slots] for t in info.tables}
    serving_step = (info.step or 0) if info.kind == "serving" else None
    raw, maps = read_id_tables(plan, slots, lambda group, key: read_host_array(step_dir, info, group, key),
                               with_slots=with_slots, serving_step=serving_step)
    return {**tables, **raw}, maps


def read_host_array(step_dir: str, info: CheckpointInfo, group: str, key: str) -> np.ndarray:
    """One stored array of the table store on the host, its metadata and checksum verified."""
    try:
        a, got = store.read_host(os.path.join(step_dir, EMBEDDINGS), group, key, stored_layout(info, group, key))
    except store.StoreReadError as e:
        raise unreadable_error(step_dir, info, [array_name(*e.array)], e) from None
    check_sums(step_dir, info, {f"{group}/{key}": got})
    return a


def read_embeddings(step_dir: str, targets: Mapping[str, Mapping[str, jax.ShapeDtypeStruct]],
                    info: CheckpointInfo) -> dict:
    """Restores `{table: {key: array}}` natural arrays into `targets` (shape, dtype, sharding); pads/truncates rows.

    Verifies every array against its checksum in `info` (CorruptCheckpointError otherwise).
    """
    if info.format == FORMAT:
        try:
            arrays = {name: {key: store.read_array(os.path.join(step_dir, EMBEDDINGS), name, key, t)
                             for key, t in keys.items()} for name, keys in targets.items()}
        except store.StoreReadError as e:
            raise unreadable_error(step_dir, info, [array_name(*e.array)], e) from None
        verify_embeddings(step_dir, info, arrays)
        return arrays
    args = jax.tree.map(
        lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=t.shape, dtype=t.dtype, strict=False),
        dict(targets),
    )
    restore = ocp.args.PyTreeRestore(item=dict(targets), restore_args=args, partial_restore=True)
    try:
        arrays = checkpointer().restore(step_dir, args=ocp.args.Composite(**{EMBEDDINGS: restore}))[EMBEDDINGS]
    except Exception as e:  # noqa: BLE001
        raise unreadable_error(step_dir, info, [_unreadable(step_dir, targets, info)], e) from None
    verify_embeddings(step_dir, info, arrays)
    return arrays


def _unreadable(step_dir: str, targets: Mapping[str, Mapping[str, jax.ShapeDtypeStruct]], info: CheckpointInfo) -> str:
    """Names the arrays of `targets` that cannot be read on their own (after a failed read of them all)."""
    if sum(len(keys) for keys in targets.values()) == 1:
        return ", ".join(array_name(t, k) for t, keys in targets.items() for k in keys)
    bad = []
    for name, keys in targets.items():
        for key, target in keys.items():
            try:
                read_embeddings(step_dir, {name: {key: target}}, dataclasses.replace(info, checksums=None))
            except CorruptCheckpointError:
                bad.append(array_name(name, key))
    return ", ".join(bad) or f"its '{EMBEDDINGS}' arrays"


def _legacy_in(plan: EmbeddingPlan, step_dir: str, info: CheckpointInfo, *, rng: jax.Array | None,
               with_slots: bool) -> dict[str, EmbeddingVariables]:
    """Restores a checkpoint written before the table store (an orbax PyTree of natural blocks)."""
    sharding, S = plan.table_sharding(), plan.num_shards
    targets = {}
    for name, t in plan.tables.items():
        rows = stored_rows(t.vocabulary_size, S)
        keys = {TABLE_KEY: (t.embedding_dim, t.dtype)}
        if with_slots:
            keys.update({k: (w, np.float32) for k, w in info.table(name).slots})
        targets[name] = {k: jax.ShapeDtypeStruct((rows, w), dt, sharding=sharding) for k, (w, dt) in keys.items()}
    natural = read_embeddings(step_dir, targets, info)
    valid = {name: info.table(name).vocabulary_size for name in plan.tables}
    fresh = None if rng is None else (lambda s, i: natural_table(plan, s, rng, i))
    return from_natural(plan, natural, valid, fresh)


def _stream_in(plan: EmbeddingPlan, step_dir: str, info: CheckpointInfo, *, allow_vocab_growth: bool,
               rng: jax.Array | None, with_slots: bool) -> dict[str, EmbeddingVariables]:
    """Restores the table store into a new state, chunk by chunk (the state plus a few chunks in memory)."""
    valid = {name: info.table(name).vocabulary_size for name in plan.tables}
    initialized = True
    if any(valid[n] < t.vocabulary_size for n, t in plan.tables.items()):
        if rng is None:
            raise ValueError("Restoring a larger vocabulary needs the initial values of the new rows (rng=).")
        state = init_tables(plan, rng, with_slots=with_slots)  # the new rows keep these values
    else:  # on CPU, buffers that only the reads write (`io.direct`); else zeros
        state = direct.new_state(plan, with_slots=with_slots)
        initialized = state is None
        state = empty_tables(plan, with_slots=with_slots) if state is None else state
    try:
        state, sums = store.read_into_state(os.path.join(step_dir, EMBEDDINGS), plan, state, valid, owned=True,
                                            initialized=initialized)
    except store.StoreReadError as e:
        raise unreadable_error(step_dir, info, [array_name(*e.array)], e) from None
    check_sums(step_dir, info, sums)
    return state
