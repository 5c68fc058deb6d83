"""Live updates, serving side: immutable snapshots of the served tables, deltas applied by building a new one.

A `Snapshot` is one version of the tables (`load_serving`'s arrays, never
changed in place). `apply_delta(snapshot, path)` returns the next version:
it reads and checks the whole delta first (checksum, base, sequence
number, tables, dtypes and widths), then builds new arrays for the tables
the delta touches and shares the others. A static table's new array is the
old one with the delta's rows written (one copy of that table, in XLA); a
raw-id table's is rebuilt in id order with the evicted ids dropped and the
new ones inserted, as a full export lays it out. `LiveTables` holds the
current snapshot and swaps the reference when a delta is applied, so a
lookup that reads `live.snapshot` once sees one version, whole, while the
next one is being built: the old snapshot stays alive as long as a lookup
holds it. Memory: while applying, the touched tables exist twice.

Applying the deltas of a chain in order gives the arrays (and raw ids)
that a full export of the last step loads, bit for bit.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any, Mapping, NamedTuple

import jax
import numpy as np

from sparse_embed.core.specs import TableSpec
from sparse_embed.io import delta_file
from sparse_embed.io.changes import delta_name, export_id
from sparse_embed.io.ckpt_format import CheckpointError
from sparse_embed.io.convert import load_serving


class Snapshot(NamedTuple):
    """One version of served tables: `tables` as `load_serving` returns them (arrays, or `(ids, array)` for a
    raw-id table), `specs` their `TableSpec`s, at delta `seq` (0: the export itself) after export `base`, the
    last delta applied's checksum `last` (None: none)."""

    base: str
    seq: int
    tables: Mapping[str, Any]
    specs: Mapping[str, TableSpec]
    last: str | None = None


def load_snapshot(export: str | os.PathLike, *, device: jax.Device | None = None) -> Snapshot:
    """The snapshot of a serving export (`load_serving`, verified), at sequence number 0."""
    tables, specs = load_serving(export, device=device)
    return Snapshot(export_id(export), 0, tables, specs)


@jax.jit
def _set_rows(table: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    return table.at[rows].set(values, mode="drop")  # padding rows (== vocab) are dropped


def _static(table: jax.Array, rows: np.ndarray, values: np.ndarray) -> jax.Array:
    """`table` with `rows` set to `values` (a new array; rows padded to a power of two: few compiles)."""
    n = 1 << (max(rows.size, 1) - 1).bit_length()
    padded = np.full(n, table.shape[0], np.int32)
    padded[: rows.size] = rows
    vals = np.zeros((n, values.shape[1]), values.dtype)
    vals[: rows.size] = values
    return _set_rows(table, padded, vals)


def _raw(name: str, path: str, held: np.ndarray, table: jax.Array, upsert: np.ndarray, values: np.ndarray,
         evicted: np.ndarray):
    """A raw-id table `(ids, array)` with `evicted` dropped and `upsert` written, in id order as exported (delta
    `path`'s table `name`)."""
    keep = ~np.isin(held, evicted)
    kept_ids, kept = held[keep], np.asarray(table)[: held.size][keep]
    ids = np.union1d(kept_ids, upsert)
    if ids.size > table.shape[0]:
        raise CheckpointError(f"Table {name!r}: {ids.size} ids after the delta {path}, more than the table's "
                              f"{table.shape[0]} rows.")
    out = np.zeros(table.shape, table.dtype)
    out[np.searchsorted(ids, kept_ids)] = kept
    out[np.searchsorted(ids, upsert)] = values
    return ids, jax.device_put(out, table.sharding)


def _check(snapshot: Snapshot, path: str, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
    """Raises CheckpointError unless the delta applies to `snapshot`: its base, next in order, its tables fit."""
    base, seq = header.get("base"), header.get("seq")
    if base != snapshot.base:
        raise CheckpointError(f"The delta {path} applies to export {base}, but the served tables come from export "
                              f"{snapshot.base}: load that export, or apply this export's deltas.")
    if seq != snapshot.seq + 1:
        raise CheckpointError(f"The delta {path} is number {seq} after export {base}, but the served tables are at "
                              f"number {snapshot.seq}: apply {delta_name(base, snapshot.seq + 1)} next.")
    if "after" in header and header["after"] != snapshot.last:  # (deltas written before the field: unchecked)
        raise CheckpointError(f"The delta {path} follows another delta number {seq - 1} (checksum "
                              f"{header['after']}) than the one the served tables applied ({snapshot.last}): two "
                              f"runs wrote deltas after export {base}. Load the export again and apply one run's "
                              "deltas (a run that starts over exports in full, into a directory of its own).")
    for name, kind in header["tables"].items():
        if name not in snapshot.tables or (kind == "ids") != isinstance(snapshot.tables[name], tuple):
            raise CheckpointError(f"The delta {path} has table {name!r} ({kind}), which the served tables do not "
                                  f"have as such ({sorted(snapshot.tables)}).")
        served = snapshot.tables[name][1] if kind == "ids" else snapshot.tables[name]
        rows, values = arrays[f"{name}/rows"], arrays[f"{name}/values"]
        if values.dtype != served.dtype or values.shape != (rows.size, served.shape[1]):
            raise CheckpointError(f"Table {name!r}: the delta {path} has rows of {values.dtype} {values.shape[1:]}, "
                                  f"the served table {served.dtype} {served.shape[1:]}.")
        if kind == "rows" and rows.size and not 0 <= rows.min() <= rows.max() < served.shape[0]:
            raise CheckpointError(f"Table {name!r}: the delta {path} has rows outside [0, {served.shape[0]}).")


def apply_delta(snapshot: Snapshot, path: str | os.PathLike) -> Snapshot:
    """The next snapshot: `snapshot` with the delta at `path` applied (`snapshot` itself is not changed).

    Raises CorruptCheckpointError if the file is damaged, CheckpointError if
    it is for another export, not the next in order, or for other tables.
    """
    path = os.fspath(path)
    header, arrays = delta_file.read(path)
    _check(snapshot, path, header, arrays)
    tables = dict(snapshot.tables)
    for name, kind in header["tables"].items():
        rows, values = arrays[f"{name}/rows"], arrays[f"{name}/values"]
        if kind == "ids":
            tables[name] = _raw(name, path, *snapshot.tables[name], rows, values, arrays[f"{name}/evicted"])
        else:
            tables[name] = _static(snapshot.tables[name], rows, values)
    return Snapshot(snapshot.base, snapshot.seq + 1, tables, snapshot.specs, header["checksum"])


class LiveTables:
    """The served tables of a running server: lookups read `snapshot` (one version, whole), `apply` swaps in
    the next. Applies are serialised; a refused delta leaves the served snapshot as it was."""

    def __init__(self, export: str | os.PathLike, *, device: jax.Device | None = None):
        self._snapshot = load_snapshot(export, device=device)
        self._lock = threading.RLock()

    @property
    def snapshot(self) -> Snapshot:
        """The current version; read it once per request and look up in it (`serving_lookup(..., s.tables, ...)`)."""
        return self._snapshot

    def apply(self, path: str | os.PathLike) -> Snapshot:
        """Applies one delta (see `apply_delta`) and makes it the served snapshot; returns it."""
        with self._lock:
            new = apply_delta(self._snapshot, path)
            self._snapshot = new  # one reference store: a reader gets the old snapshot or the new one
        return new

    def catch_up(self, directory: str | os.PathLike) -> int:
        """Applies, in order, the deltas of `directory` that follow the served snapshot; returns how many."""
        applied = 0
        with self._lock:
            while True:
                s = self._snapshot
                path = os.path.join(os.fspath(directory), delta_name(s.base, s.seq + 1))
                if not os.path.exists(path):
                    if os.path.isdir(directory):  # (none yet: training writes the first delta's directory)
                        _warn_if_gap(os.fspath(directory), s.base, s.seq + 1)
                    return applied
                self.apply(path)
                applied += 1


def _warn_if_gap(directory: str, base: str, missing: int) -> None:
    """Warns when a later delta of `base` is in `directory` but delta `missing` is not: the chain is broken
    there (a delta lost or not yet copied), and the served snapshot cannot move past it."""
    seqs = (n[len(base) + 1:-len(".delta")] for n in os.listdir(directory)
            if n.startswith(base + ".") and n.endswith(".delta"))
    later = sorted(int(q) for q in seqs if q.isdigit() and int(q) > missing)  # (by number: 1000000 after 999999)
    if later:
        warnings.warn(f"{os.path.join(directory, delta_name(base, missing))} is missing, but {len(later)} later "
                      f"delta(s) of the export are there ({delta_name(base, later[0])} ...): serving stays at delta "
                      f"{missing - 1} until it comes (a delta lost: export in full again).", RuntimeWarning,
                      stacklevel=3)
