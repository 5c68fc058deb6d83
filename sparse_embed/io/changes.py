"""Live updates, training side: which rows changed since the last export, and `export_delta`, which writes them.

What is tracked, and why it is exact: the lookup's backward applies the
optimizer to the rows a batch looked up and to no other row, so the rows
that changed since an export are among the ids fed to the steps since it.
`Changes.touched_ids(plan, ids)` takes a step's ids (the `{feature: ids}`
given to `preprocess`, any format) and returns a new tracker (the old one is
left as it is); it costs a sort of the batch's ids, and every 16 batches a
merge of what was kept (memory: the distinct ids). A delta carries each touched
row's current value, so a row that was looked up but left as it was is
re-sent, never missed. Rows changed outside the train step (a restore, your
own edits) are not seen: export in full after those.

A raw-id table is exact by a diff of its id set: the tracker keeps the ids
the served copy holds (from the export, then from each delta), and a delta
lists the ids evicted since (held before, not live now) and writes the rows
of the ids admitted since and of the live ids the steps touched.

A delta is named `<base>.<seq>.delta` (`delta_name`): `base` is the export
id of the full export it applies to (`export_id`, the digest of that
export's metadata, which covers every array's checksum) and `seq` counts
the deltas since it (1, 2, ...). Each holds its rows in the export's
serving dtype (a quantized row has the same bytes as in a full export).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax
import numpy as np

from sparse_embed.core.id_maps import IdMap
from sparse_embed.core.planning import EmbeddingPlan
from sparse_embed.core.raw_keys import join_words, split_words
from sparse_embed.core.state import EmbeddingVariables
from sparse_embed.core.tables import unstack_tables
from sparse_embed.host.ids import canonical, flattened
from sparse_embed.io import delta_file
from sparse_embed.io.ckpt_format import resolve
from sparse_embed.io.convert import check_not_offloaded, serving_rows
from sparse_embed.io.id_checkpoint import IDS_KEY
from sparse_embed.io.id_tables import id_table_contents, live_at
from sparse_embed.io.orbax_items import read_info
from sparse_embed.io.restoring import read_host_array

_PENDING = 16  # batches of touched ids kept apart before they are merged into one sorted array


def export_id(path: str | os.PathLike) -> str:
    """The id of a serving export (16 hex digits of its metadata's digest): what its deltas name as their base."""
    return read_info(path).to_json()["digest"][:16]


def delta_name(base: str, seq: int) -> str:
    """The file name of delta `seq` (1, 2, ...) after the export `base`."""
    return f"{base}.{seq:06d}.delta"


def _merged(parts: tuple[np.ndarray, ...]) -> np.ndarray:
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)


@dataclasses.dataclass(frozen=True)
class Changes:
    """What changed since the served copy was made: a pure tracker (every update returns a new one).

    base / seq / last: the export id, the number of the last delta written
    after it (0: none yet) and that delta's checksum (None); dtypes: `{table: serving dtype}` of the export
    (deltas use them); touched: `{table: tuple of int64 arrays}` (rows, or raw ids of a
    raw-id table) looked up since; served_ids: `{raw-id table: sorted int64
    ids}` the served copy holds; shapes: `{table: (vocabulary_size,
    embedding_dim)}` of the export, what `write_delta` checks rows against.
    """

    base: str
    seq: int
    dtypes: Mapping[str, str]
    touched: Mapping[str, tuple[np.ndarray, ...]]
    served_ids: Mapping[str, np.ndarray]
    shapes: Mapping[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    last: str | None = None  # the checksum of the last delta written (None: none yet), which the next names

    @classmethod
    def since(cls, export: str | os.PathLike) -> "Changes":
        """A tracker that starts at a serving export (read from `export`, as written by `export_serving`)."""
        step_dir = resolve(export)
        info = read_info(step_dir)
        if info.kind != "serving":
            raise ValueError(f"{step_dir} is a {info.kind} checkpoint; deltas apply to serving exports "
                             "(export_serving, or convert_checkpoint(..., serving=True)).")
        served = {}
        for rec in info.tables:
            if rec.dynamic:
                words = read_host_array(step_dir, info, rec.name, IDS_KEY)
                served[rec.name] = join_words(words[words[:, 0] != -1])
        return cls(export_id(step_dir), 0, {rec.name: rec.dtype for rec in info.tables}, {}, served,
                   {rec.name: (rec.vocabulary_size, rec.embedding_dim) for rec in info.tables})

    def touched_ids(self, plan: EmbeddingPlan, ids: Mapping[str, Any]) -> "Changes":
        """A new tracker that also holds the ids of one step's batch (`{feature: ids}` as given to preprocess)."""
        new = dict(self.touched)
        features = plan.features
        for fname, x in ids.items():
            if fname not in features:
                raise ValueError(f"ids have an unknown feature {fname!r}; the plan's features are {sorted(features)}.")
            f = features[fname]
            c = canonical(f, x, check_batch=False)
            flat = flattened(f, c, raw=f.table.dynamic is not None).ids
            parts = new.get(f.table.name, ()) + (np.unique(flat),)
            new[f.table.name] = (_merged(parts),) if len(parts) > _PENDING else parts
        return dataclasses.replace(self, touched=new)

    def rows(self, table: str) -> np.ndarray:
        """The sorted rows (raw ids) of `table` touched since the last delta."""
        return _merged(self.touched.get(table, ()))


def _static_rows(plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables], changes: Changes) -> dict:
    """`{table: (rows [n], float rows [n, dim])}` of the touched rows of the static tables."""
    names = {n for n in changes.touched if plan.tables[n].dynamic is None}
    stacks = tuple(s for s in plan.stacks if s.dynamic is None and {p.table.name for p in s.tables} & names)
    natural = unstack_tables(dataclasses.replace(plan, stacks=stacks), {s.name: tables[s.name] for s in stacks})
    rows = {n: changes.rows(n) for n in sorted(names)}
    return {n: (r, natural[n][r]) for n, r in rows.items()}


def _raw_rows(plan: EmbeddingPlan, tables, id_maps, changes: Changes, step: int | None) -> dict:
    """`{table: (upserted ids, float rows, evicted ids)}` of the raw-id tables (expired at `step`: evicted)."""
    out = {}
    for name, t in live_at(plan, id_table_contents(plan, tables, id_maps), step).items():
        held = changes.served_ids.get(name, np.zeros(0, np.int64))
        evicted = np.setdiff1d(held, t.ids, assume_unique=True)
        upsert = np.union1d(np.setdiff1d(t.ids, held, assume_unique=True),
                            np.intersect1d(changes.rows(name), t.ids, assume_unique=True))
        out[name] = (upsert, t.vectors[np.searchsorted(t.ids, upsert)], evicted)
    return out


def _in_order(table: str, what: str, ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(ids, values)` sorted by id (int64; a delta stores sorted ids as gaps); ValueError if an id repeats."""
    ids, values = np.asarray(ids, np.int64).ravel(), np.asarray(values)
    if (ids[1:] < ids[:-1]).any():  # export_delta's are sorted already: no copy of their values
        order = np.argsort(ids, kind="stable")
        ids, values = ids[order], values[order]
    twice = ids[1:][ids[1:] == ids[:-1]]
    if twice.size:
        raise ValueError(f"Table {table!r}: {what} {int(twice[0])} is given twice; a delta holds each once.")
    return ids, values


def _check_rows(changes: Changes, rows: Mapping[str, tuple], raw: Mapping[str, tuple]) -> None:
    """ValueError for rows a server would refuse (then every later delta, out of order): an unknown or misplaced
    table, a row outside the table, values of another width or count (and, in `write_delta`, more ids than a
    raw-id table has rows)."""
    for kind, given in (("rows", rows), ("ids", raw)):
        for name, (r, values, *_) in given.items():
            is_raw = name in changes.served_ids
            if name not in changes.dtypes or is_raw != (kind == "ids"):
                where = "raw=" if is_raw else "rows="
                raise ValueError(f"Table {name!r}: " + (f"not in the export (its tables: {sorted(changes.dtypes)})."
                                 if name not in changes.dtypes else f"give its rows in write_delta's {where}."))
            r, values = np.asarray(r), np.asarray(values)
            vocab, dim = changes.shapes.get(name, (None, values.shape[-1] if values.ndim else None))
            if values.ndim != 2 or values.shape != (r.size, dim):
                raise ValueError(f"Table {name!r}: {r.size} {'ids' if is_raw else 'rows'} need values [{r.size}, "
                                 f"{dim}], got {values.shape}.")
            if not is_raw and vocab is not None and r.size and (r.min() < 0 or r.max() >= vocab):
                bad = int(r[(r < 0) | (r >= vocab)][0])
                raise ValueError(f"Table {name!r}: row {bad} is outside [0, {vocab}).")


def _next_path(directory: str | os.PathLike, changes: Changes, *, check: bool = True) -> str:
    """The path of the delta after `changes`; FileExistsError if it exists (see `write_delta`) and `check`."""
    path = os.path.join(os.fspath(directory), delta_name(changes.base, changes.seq + 1))
    if check and os.path.exists(path):
        raise FileExistsError(f"The delta {path} exists already: this tracker (sequence {changes.seq}) wrote its "
                              "next delta before, so it is an old one (carry on with the tracker write_delta/"
                              "export_delta returned), or another run exports the same tables into this directory. "
                              "A server that applied that delta would never apply this one; after a restore, "
                              "export in full (export_serving), track from there (Changes.since) and write the "
                              "deltas into a new directory (the export of a state exported before has its id).")
    return path


def write_delta(directory: str | os.PathLike, changes: Changes, rows: Mapping[str, tuple[np.ndarray, np.ndarray]],
                raw: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None) -> tuple[str, Changes]:
    """Writes the next delta after `changes` from host rows: `rows[table] = (rows [n], float values [n, dim])`,
    `raw[table] = (upserted ids [n], float values [n, dim], evicted ids [m])`, ids in any order, each once;
    returns `(its path, the tracker for the next delta)`. `export_delta` gathers these from the live tables.

    A delta is never overwritten (FileExistsError): a server may have applied the one there, and it takes each
    sequence number once, so other content under the same name would never reach it.

    Under `jax.distributed` every process calls it (as `export_serving`): process 0 writes the file, the others (which
    may find it written already) take its checksum for the tracker they return, the same as process 0's."""
    writer = jax.process_index() == 0
    path = _next_path(directory, changes, check=writer)
    _check_rows(changes, rows, raw or {})
    # "after": the delta it follows (None: the export), so that two runs' chains after one export never mix
    header: dict[str, Any] = {"base": changes.base, "seq": changes.seq + 1, "after": changes.last, "tables": {}}
    arrays: dict[str, np.ndarray] = {}
    served = dict(changes.served_ids)
    for name, (r, values) in rows.items():
        header["tables"][name] = "rows"
        r, values = _in_order(name, "row", r, values)
        arrays.update({f"{name}/rows": r, f"{name}/values": serving_rows(values, changes.dtypes[name], name, r)})
    for name, (upsert, values, evicted) in (raw or {}).items():
        header["tables"][name] = "ids"
        upsert, values = _in_order(name, "id", upsert, values)
        evicted = _in_order(name, "evicted id", evicted, evicted)[0]
        served[name] = np.union1d(np.setdiff1d(served[name], evicted), upsert)
        vocab = changes.shapes.get(name, (None,))[0]
        if vocab is not None and served[name].size > vocab:  # the server would refuse it, and every later delta
            raise ValueError(f"Table {name!r}: {served[name].size} ids after the delta, more than its {vocab} rows "
                             "(upserted ids the served copy does not hold, and not as many evicted).")
        arrays.update({f"{name}/rows": upsert, f"{name}/values": serving_rows(values, changes.dtypes[name], name,
                                                                             upsert, "raw id"),
                       f"{name}/evicted": evicted})
    if writer:
        os.makedirs(directory, exist_ok=True)
    digest = delta_file.write(path, header, arrays, ids=[k for k in arrays if not k.endswith("/values")],
                              dry=not writer)
    return path, dataclasses.replace(changes, seq=changes.seq + 1, touched={}, served_ids=served, last=digest)


def _touched_everywhere(plan: EmbeddingPlan, changes: Changes) -> Changes:
    """Under `jax.distributed`: `changes` touched by the ids of every process. A process's tracker holds the ids
    it fed (its own rows of each batch, what its `preprocess` took), and a delta needs every row that changed."""
    from jax.experimental import multihost_utils

    names = sorted(plan.tables)
    mine = [changes.rows(n) for n in names]
    sizes = np.asarray(multihost_utils.process_allgather(np.array([r.size for r in mine], np.int32)))  # [P, tables]
    words = np.full((max(int(sizes.sum(axis=1).max()), 1), 2), -1, np.int32)  # int64 ids as int32 words (no x64)
    words[: sum(r.size for r in mine)] = split_words(np.concatenate(mine))
    every = np.asarray(multihost_utils.process_allgather(words))  # [P, width, 2]
    ids = [np.split(join_words(w[: n.sum()]), np.cumsum(n)[:-1]) for w, n in zip(every, sizes)]
    touched = {name: (np.unique(np.concatenate([p[i] for p in ids])),) for i, name in enumerate(names)}
    return dataclasses.replace(changes, touched={n: t for n, t in touched.items() if t[0].size})


def export_delta(directory: str | os.PathLike, plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables],
                 changes: Changes, *, id_maps: Mapping[str, IdMap] | None = None,
                 step: int | None = None) -> tuple[str, Changes]:
    """Writes the rows changed since `changes` began (see the module doc) as the next delta in `directory`.

    Returns `(its path, the tracker for the next delta)`. Gathers the touched
    tables to the host as `export_serving` does; writes only their touched rows.
    `step`: as `export_serving`'s (the ids of a raw-id table expired at `step` leave the served copy).
    Under `jax.distributed` every process calls it with its own tracker (of the ids it fed); the delta holds the
    rows that the ids of every process touched, and process 0 writes it (`write_delta`).
    """
    check_not_offloaded(plan, "export_delta")
    raw_names = sorted(t.name for t in plan.tables.values() if t.dynamic is not None)
    if raw_names and id_maps is None:
        raise ValueError(f"The plan has raw-id tables {raw_names}: pass export_delta(..., id_maps=id_maps).")
    if set(raw_names) != set(changes.served_ids):
        raise ValueError(f"The export has raw-id tables {sorted(changes.served_ids)}, the plan {raw_names}: "
                         "the tracker started at an export of another model.")
    for name, t in sorted(plan.tables.items()):  # rows of a resized table would land in the served one silently
        shape = (t.vocabulary_size, t.embedding_dim)
        if changes.shapes.get(name, shape) != shape:
            raise ValueError(f"Table {name!r} is {list(shape)} in the plan, {list(changes.shapes[name])} in the "
                             "export: the tracker started at an export of another model.")
    _next_path(directory, changes)  # before gathering the tables
    if jax.process_count() > 1:  # (also: every process checked the name before process 0 writes it)
        changes = _touched_everywhere(plan, changes)
    raw = _raw_rows(plan, tables, id_maps, changes, step) if raw_names else {}
    return write_delta(directory, changes, _static_rows(plan, tables, changes), raw)
