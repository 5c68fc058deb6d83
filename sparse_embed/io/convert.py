"""Checkpoint conversion: serving exports (tables only, optional bf16, int8 or int4) and re-layout for N devices.

A serving checkpoint is one directory with the `embeddings` item
`{table: {"table": [vocabulary_size, dim]}}` (exact shapes, no slots) and a
`meta` item of kind "serving"; `load_serving` reads it back for
`serving_lookup`. An int8 / int4 table is stored as its row-wise quantized
fused rows, `uint8 [vocabulary_size, width]` (`io.quantize`).

Memory: exporting from live tables gathers each table to the host (a serving
model needs whole tables on its one device anyway). Converting a checkpoint
on disk reads and writes one array at a time, so peak memory is the largest
single table (or slot), not the whole model.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
from typing import Any, Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import SingleDeviceSharding

from sparse_embed.core.planning import EmbeddingPlan
from sparse_embed.core.raw_keys import join_words, split_words
from sparse_embed.core.relayout import TABLE_KEY
from sparse_embed.core.specs import TableSpec
from sparse_embed.core.state import EmbeddingVariables, check_state
from sparse_embed.core.tables import unstack_tables
from sparse_embed.io import store
from sparse_embed.io.checks import warn_unverified
from sparse_embed.io.data_item import DATA
from sparse_embed.io.ckpt_format import (
    EMBEDDINGS, FORMAT, STAGING, USER, CheckpointError, CheckpointInfo, TableRecord, resolve, training_info,
)
from sparse_embed.io.offload_checkpoint import record_files
from sparse_embed.io.orbax_items import checkpointer, read_info, read_user_host, write_step
from sparse_embed.io.restoring import read_embeddings, read_host_array
from sparse_embed.io.id_checkpoint import IDS_KEY, raw_arrays
from sparse_embed.io.id_tables import expired, id_table_contents, live_at
from sparse_embed.io.quantize import BITS, bad_row, quantize

DTYPES = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
          "float16": jnp.float16, "f16": jnp.float16, "int8": "int8", "int4": "int4"}


def _dtype(dtype) -> str | None:
    """A serving table's dtype as recorded: a float dtype's name, or "int8" / "int4" (row-wise quantized)."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"Unknown dtype {dtype!r}; use one of {sorted(DTYPES)}.")
        dtype = DTYPES[dtype]
    if dtype in BITS:
        return dtype
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in DTYPES:  # a dtype object names one of them too (float64 would be written, then fail its checksum)
        raise ValueError(f"Unknown dtype {dtype!r}; use one of {sorted(DTYPES)}.")
    return name


def check_not_offloaded(plan: EmbeddingPlan, what: str) -> None:
    """Raises unless no table of `plan` is offloaded: such a table's array holds its cache's rows (a cache slot's
    row, not row i), and the table itself is in its store."""
    if plan.tiered_tables:
        raise ValueError(f"{what}: tables {sorted(plan.tiered_tables)} are offloaded: their arrays hold their caches' "
                         "rows, the tables are in their stores. Serve them from their stores "
                         "(sparse_embed.offload.StoreServer, docs/offload.md).")


def serving_rows(a: np.ndarray, dtype: str | None, table: str, names: np.ndarray | None = None,
                 kind: str = "row") -> np.ndarray:
    """Float rows `[n, dim]` as a serving table of `dtype` stores them (quantized: fused uint8 rows); `names`,
    `kind`: what an error calls row `i` (`quantize`)."""
    if dtype in BITS:
        return quantize(a, BITS[dtype], what=f"Table {table!r}", names=names, kind=kind)
    a = np.asarray(a)
    if dtype is None:
        return a
    with np.errstate(over="ignore"):
        out = a.astype(dtype)
    past = (np.isfinite(a) & ~np.isfinite(out)).any(axis=-1)  # (float16: beyond 65504)
    if past.any():
        raise bad_row(f"Table {table!r}", past, names, kind, f"holds values beyond {dtype}'s range (it would serve "
                      "inf); export it as float32 or bfloat16.")
    return out


def _save(dst: str, arrays: Iterable[tuple[str, str, np.ndarray]], info: CheckpointInfo) -> None:
    """Writes `(table, key, host array)`s, one at a time, and `info` (with their checksums) to a new directory.

    Under `jax.distributed` every process holds the same whole arrays: process 0 writes them, the others only
    sum them for `info` (two writers of one staging directory collided, and the save then hung in orbax)."""
    if os.path.exists(dst):
        raise CheckpointError(f"{dst} already exists; choose a new destination.")

    def write(staging: str) -> dict[str, str]:
        sums = {}
        for name, key, a in arrays:
            if jax.process_index() == 0:
                sums.update(store.write_host(staging, {name: {key: a}}))
            else:
                sums[f"{name}/{key}"] = store.host_checksum(np.ascontiguousarray(a))
        return sums

    save = lambda items: checkpointer(write=True).save(dst, args=ocp.args.Composite(**items))  # noqa: E731
    write_step(save, dst.rstrip(os.sep) + STAGING, write, info)


def _check_destination(dst: str, src: str) -> None:
    """Before anything is read: `dst` is new, outside the checkpoint `src` read from, and its parent exists (made
    if need be)."""
    if os.path.exists(dst):
        raise CheckpointError(f"{dst} already exists; choose a new destination.")
    real, source = os.path.realpath(dst), os.path.realpath(src)
    if os.path.commonpath([real, source]) == source:
        raise CheckpointError(f"{dst} is inside the checkpoint {src} it would be converted from; choose a "
                              "destination outside it.")
    try:
        os.makedirs(os.path.dirname(real), exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"Cannot write {dst}: {e.strerror} ({e.filename}).") from None


def _serving_info(records: Iterable[TableRecord], dtype, stacking, num_shards, step) -> CheckpointInfo:
    recs = tuple(
        dataclasses.replace(r, slots=(), stored_rows=r.vocabulary_size, dtype=dtype or r.dtype)
        for r in records
    )
    return CheckpointInfo("serving", recs, stacking, num_shards, step, False, {}, None)


def export_serving(path: str | os.PathLike, plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables], *,
                   id_maps: Mapping[str, Any] | None = None, dtype=None, step: int | None = None) -> None:
    """Writes a serving checkpoint of the live `tables`: `[vocab, dim]` per table, no slots, optional dtype
    (a float dtype, or "int8" / "int4": row-wise quantized, `io.quantize`).

    A raw-id table (its `id_maps` needed) is written in id order with its ids
    (`[vocab, 2]` words, -1 unused), which `load_serving` returns with it;
    with `step`, without the ids a lookup at `step` finds expired.
    """
    check_state(plan, tables)
    check_not_offloaded(plan, "export_serving")
    dtype = _dtype(dtype)
    raw = {s.first.name for s in plan.stacks if s.dynamic is not None}
    if raw and id_maps is None:
        raise ValueError(f"The plan has raw-id tables {sorted(raw)}: pass export_serving(..., id_maps=id_maps).")
    static = dataclasses.replace(plan, stacks=tuple(s for s in plan.stacks if s.dynamic is None))
    natural = unstack_tables(static, {s.name: tables[s.name] for s in static.stacks})
    arrays = [(name, TABLE_KEY, serving_rows(a, dtype, name)) for name, a in natural.items()]
    for name, t in (live_at(plan, id_table_contents(plan, tables, id_maps), step) if raw else {}).items():
        vocab = plan.tables[name].vocabulary_size
        table = np.zeros((vocab, t.vectors.shape[1]), t.vectors.dtype)
        table[: t.ids.size] = t.vectors
        words = np.full((vocab, 2), -1, np.int32)
        words[: t.ids.size] = split_words(t.ids)
        names = np.concatenate([t.ids, np.full(vocab - t.ids.size, -1, np.int64)])  # (errors name the raw id)
        arrays += [(name, TABLE_KEY, serving_rows(table, dtype, name, names, "raw id")), (name, IDS_KEY, words)]
    info = training_info(plan, step, False)
    _save(os.fspath(path), iter(arrays), _serving_info(info.tables, dtype, info.stacking, info.num_shards, step))


def load_serving(path: str | os.PathLike, *, device: jax.Device | None = None) -> tuple[dict[str, Any], dict[str, TableSpec]]:
    """`({table: [vocab, dim] array on `device`}, {table: TableSpec})` from a serving or training checkpoint.

    The specs carry vocabulary, dim, dtype, combiner and max_norm (for
    `FeatureSpec`s of `serving_lookup`). A raw-id table comes as
    `(ids, array)`: its live ids (int64, sorted) and the table whose row k
    holds the k-th of them (from a training checkpoint: without the ids a
    lookup at its step finds expired, as `convert_checkpoint` serves it). An int8 / int4 table comes as its fused rows,
    `uint8 [vocab, width]` (`io.quantize`), which `serving_lookup` dequantizes.
    """
    step_dir = resolve(path)
    info = read_info(step_dir)
    warn_unverified(step_dir, info)
    arrays: dict[str, Any] = {name: array for name, (_, array) in read_tables(step_dir, info, [TABLE_KEY], device)}
    for rec in info.tables:
        if rec.dynamic:
            gone, table = _expired(step_dir, info, rec), arrays[rec.name]
            words = _dropped(read_host_array(step_dir, info, rec.name, IDS_KEY), gone, -1)
            if gone is not None and gone.any():  # a training checkpoint: as convert_checkpoint serves it
                table = jax.device_put(_dropped(np.asarray(table), gone, 0), table.sharding)
            arrays[rec.name] = (join_words(words[words[:, 0] != -1]), table)
    return arrays, {t.name: t.to_spec() for t in info.tables}


def read_tables(step_dir: str, info: CheckpointInfo, keys: list[str], device: jax.Device | None = None):
    """Yields `(table, (key, array))` one array at a time, on one device, `[vocabulary_size, w]`, verified."""
    sharding = SingleDeviceSharding(device or jax.devices()[0])
    for rec in info.tables:
        widths = {TABLE_KEY: rec.stored[::-1], **{k: (w, "float32") for k, w in rec.slots}}
        for key in keys if keys else widths:
            w, dt = widths[key]
            target = {rec.name: {key: jax.ShapeDtypeStruct((rec.vocabulary_size, w), np.dtype(dt), sharding=sharding)}}
            yield rec.name, (key, read_embeddings(step_dir, target, info)[rec.name][key])


def _converted(a: np.ndarray, rec: TableRecord, dtype: str | None, raw_ids: Callable[[], np.ndarray]) -> np.ndarray:
    """A table read from a checkpoint, in the serving `dtype` asked for (None: as stored); `raw_ids()`: a raw-id
    table's ids row by row (-1: none), which its errors name a row by (as `export_serving`'s)."""
    if dtype is None or dtype == rec.dtype:
        return a
    if rec.dtype in BITS:
        raise ValueError(f"Table {rec.name!r} is stored quantized ({rec.dtype}); it converts to {dtype} only from "
                         "the float checkpoint it was exported from.")
    return serving_rows(a, dtype, rec.name, *((raw_ids(), "raw id") if rec.dynamic else ()))


def _expired(step_dir: str, info: CheckpointInfo, rec: TableRecord) -> np.ndarray | None:
    """The rows of a training checkpoint's raw-id table that a lookup at the checkpoint's step finds expired
    (`[vocab]` bool, as `live_at`), or None where none can be (no `expire_after`, or a serving checkpoint)."""
    if info.kind != "training" or rec.expire_after is None or info.step is None:
        return None
    return expired(read_host_array(step_dir, info, rec.name, "last")[:, 0], info.step, rec.expire_after)


def _dropped(a: np.ndarray, gone: np.ndarray | None, fill) -> np.ndarray:
    """`a`'s rows without the `gone` ones, in order, padded back to its shape with `fill`."""
    if gone is None or not gone.any():
        return a
    out = np.full_like(a, fill)
    kept = a[~gone]
    out[: kept.shape[0]] = kept
    return out


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, devices: int | None = None,
                       serving: bool = False, dtype=None, step: int | None = None,
                       progress: Callable[[Iterable], Iterable] | None = None) -> str:
    """Converts a checkpoint; returns the written step directory.

    - `serving=True`: a serving checkpoint at `dst` (`[vocab, dim]` tables,
      no slots, optionally cast to `dtype`, e.g. "bf16", or quantized, "int8" / "int4");
      a raw-id table without the ids a lookup at the checkpoint's step finds
      expired (as `export_serving(..., step=)`); no `devices` (nothing to record). Refused for a checkpoint with
      offloaded tables (their rows are in their stores: `offload.StoreServer`).
    - else: a training checkpoint at `dst/<step>` recorded for `devices`
      devices (default: as saved), slots, user pytree, the input's position
      (`data`) and offloaded tables' store commits kept, in the
      current format (any checkpoint restores onto any mesh anyway; this
      rewrites one from an older version, or records another mesh size).
    `progress` wraps the iteration over arrays (e.g. `tqdm`).
    """
    step_dir = resolve(src, step)
    info = read_info(step_dir)
    warn_unverified(step_dir, info)
    offload_records = record_files(step_dir)
    if serving and offload_records:
        raise CheckpointError(f"{step_dir} has offloaded tables (their rows are in their stores, {offload_records}): "
                              "a serving copy would leave them out. Serve them from their stores "
                              "(sparse_embed.offload.StoreServer, docs/offload.md).")
    dtype = _dtype(dtype)
    progress = progress or (lambda it, **_: it)
    if serving:
        if devices is not None:  # a serving export is read on one device (load_serving): no mesh size to record
            raise ValueError("devices= applies to training checkpoints only (a serving export is read on one device, "
                             "whatever mesh it came from).")
        keys, out_dir, n = [TABLE_KEY], os.fspath(dst), info.num_shards
        new_info = _serving_info(info.tables, dtype, info.stacking, n, info.step)
    else:
        keys, (new_info, out_dir) = [], _training_copy(step_dir, info, dst, devices, dtype)
    _check_destination(out_dir, os.fspath(src))
    if not serving and info.has_user:  # verified before anything is written (after, a failure left a step behind)
        read_user_host(step_dir, info)
    total = sum(1 + (0 if serving else len(r.slots)) for r in info.tables)
    # a serving copy leaves out the raw ids a lookup at the checkpoint's step finds expired, as export_serving
    gone = {r.name: _expired(step_dir, info, r) for r in info.tables if serving and r.dynamic}
    read = lambda group, key: _dropped(read_host_array(step_dir, info, group, key), gone.get(group), -1)  # noqa: E731
    arrays = ((name, key, _converted(_dropped(np.asarray(a), gone.get(name), 0), info.table(name), dtype,
                                     lambda name=name: join_words(read(name, IDS_KEY))))
              for name, (key, a) in progress(read_tables(step_dir, info, keys), total=total, unit="array"))
    raw = (x for r in info.tables if r.dynamic for x in raw_arrays(read, r.name, serving))
    _save(out_dir, itertools.chain(arrays, raw), new_info)
    if not serving:
        _copy_as_saved(step_dir, out_dir, info, offload_records)
    return out_dir


def _training_copy(step_dir: str, info: CheckpointInfo, dst: str | os.PathLike, devices: int | None,
                   dtype) -> tuple[CheckpointInfo, str]:
    """`(info, step directory)` of a training copy of the checkpoint `info` describes, for `devices` devices."""
    if info.kind != "training":
        raise CheckpointError(f"{step_dir} is a {info.kind} checkpoint; only training checkpoints convert to "
                              "training checkpoints.")
    if dtype is not None:
        raise ValueError("dtype= applies to serving exports only (training tables keep the dtype of their spec).")
    n = info.num_shards if devices is None else devices
    if n <= 0:
        raise ValueError(f"devices must be >= 1, got {n}.")
    new_info = dataclasses.replace(info, num_shards=n, format=FORMAT, tables=tuple(
        dataclasses.replace(r, stored_rows=r.vocabulary_size) for r in info.tables))
    return new_info, os.path.join(os.fspath(dst), str(info.step if info.step is not None else 0))


def _copy_as_saved(step_dir: str, out_dir: str, info: CheckpointInfo, offload_records: list[str]) -> None:
    """Into a converted training step, what no mesh changes: the user pytree (verified before), the input's position
    (`data`) and the offloaded tables' store commits (checksummed records)."""
    if info.has_user:
        shutil.copytree(os.path.join(step_dir, USER), os.path.join(out_dir, USER))
    if os.path.isdir(os.path.join(step_dir, DATA)):
        shutil.copytree(os.path.join(step_dir, DATA), os.path.join(out_dir, DATA))
    for name in offload_records:
        shutil.copy2(os.path.join(step_dir, EMBEDDINGS, name), os.path.join(out_dir, EMBEDDINGS, name))

