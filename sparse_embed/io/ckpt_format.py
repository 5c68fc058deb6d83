"""The checkpoint format: a step's items, its metadata (`CheckpointInfo`), its errors, and finding a step.

A step directory holds the orbax items `embeddings` (the table store,
`io.store`), `user` (optional, any pytree) and `meta` (JSON
`CheckpointInfo`, with a digest of itself). Formats before the table store
("sparse_embed/2": orbax PyTree arrays; "/1": also before checksums) still read (`io.legacy`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import operator
import os
import warnings
from typing import Any, Mapping

import numpy as np

from sparse_embed.core.planning import EmbeddingPlan
from sparse_embed.core.relayout import TABLE_KEY
from sparse_embed.core.specs import Dynamic, TableSpec
from sparse_embed.io import store
from sparse_embed.io.id_checkpoint import PENDING, raw_layout
from sparse_embed.io.integrity import ALGORITHM
from sparse_embed.io.quantize import BITS, stored


FORMAT = "sparse_embed/3"  # the table store (io.store)


PYTREE_FORMAT, UNVERIFIED_FORMAT = "sparse_embed/2", "sparse_embed/1"  # orbax PyTree arrays; 1: before checksums


STAGING = ".sparse_embed-staging"  # tables written before orbax commits the step; moved into it


EMBEDDINGS, USER, META = "embeddings", "user", "meta"


_STEP_ITEMS = (EMBEDDINGS, USER, "_CHECKPOINT_METADATA")  # what a step directory holds beside META


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or not one sparse_embed can read."""


class CorruptCheckpointError(CheckpointError):
    """A step's stored values or metadata are damaged: a checksum does not match, or they cannot be read."""


WHAT_TO_DO = ("restore another step (CheckpointManager.restore() without step= falls back to the newest good one), "
               "or copy the checkpoint again from a good source; `sparse-embed verify DIR` checks every array")


@dataclasses.dataclass(frozen=True)
class TableRecord:
    """What a checkpoint records about one table."""

    name: str
    vocabulary_size: int
    embedding_dim: int
    dtype: str
    combiner: str
    max_norm: float | None
    optimizer: str  # the optimizer's class name, for messages
    slots: tuple[tuple[str, int], ...]  # (slot name, width), sorted; empty in a serving checkpoint
    stored_rows: int  # rows of the stored arrays (format 3: vocabulary_size; before: padded for the mesh)
    dynamic: bool = False  # keyed by raw ids: rows in id order, with their ids (`id_checkpoint`)
    expire_after: int | None = None  # a raw-id table's `Dynamic.expire_after` (not recorded before 0.2.0's end)
    default: float | tuple[float, ...] | None = None  # its `Dynamic.default` (what ids without a row read; older: None)

    @classmethod
    def from_spec(cls, t: TableSpec, *, with_slots: bool = True) -> "TableRecord":
        opt = t.resolved_optimizer
        slots = tuple(sorted((k, v.width) for k, v in opt.slots(t.embedding_dim).items())) if with_slots else ()
        return cls(t.name, t.vocabulary_size, t.embedding_dim, str(t.dtype), t.combiner, t.max_norm,
                   type(opt).__name__, slots, t.vocabulary_size, t.dynamic is not None,
                   *((t.dynamic.expire_after, t.dynamic.default) if t.dynamic is not None else (None, None)))

    def to_spec(self) -> TableSpec:
        """A `TableSpec` with this record's shape, dtype, combiner and max_norm (for serving; a quantized
        table's spec says float32, what its lookups return)."""
        return TableSpec(self.name, self.vocabulary_size, self.embedding_dim, combiner=self.combiner,
                         max_norm=self.max_norm, dtype="float32" if self.dtype in BITS else self.dtype,
                         dynamic=Dynamic(default=self.default) if self.dynamic else None)

    @property
    def stored(self) -> tuple[np.dtype, int]:
        """The stored table's dtype and width (a quantized serving table: uint8 fused rows, `io.quantize`)."""
        return stored(self.dtype, self.embedding_dim)

    @property
    def nbytes(self) -> int:
        """Bytes of the table and its slots (`[vocab, width]` of its dtype + `[vocab, width]` f32 each)."""
        dtype, width = self.stored
        return self.vocabulary_size * (width * dtype.itemsize + 4 * sum(w for _, w in self.slots))


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint's `meta` item: how to read its `embeddings` (see module doc)."""

    kind: str  # "training" or "serving"
    tables: tuple[TableRecord, ...]
    stacking: tuple[tuple[str, ...], ...]  # the tables of each stack it was saved from
    num_shards: int  # the mesh size it was saved from
    step: int | None
    has_user: bool
    # "table/key" -> checksum of the array's first vocabulary_size rows; None: written before checksums
    checksums: Mapping[str, str] | None = None
    user_checksums: Mapping[str, str] | None = None  # user leaf path (`leaf_key`) -> checksum
    format: str = FORMAT  # how `embeddings` is stored: FORMAT (the table store) or an orbax PyTree before it
    has_data: bool = False  # a `data` item was saved (the input position; steps saved before this field: unknown)

    def table(self, name: str) -> TableRecord:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def table_names(self) -> list[str]:
        return [t.name for t in self.tables]

    @property
    def verified(self) -> bool:
        """Whether the checkpoint carries checksums (false for checkpoints written before them)."""
        return self.checksums is not None

    def to_json(self) -> dict:
        d = {**dataclasses.asdict(self), "algorithm": ALGORITHM}
        return {**d, "digest": _digest(d)}

    @classmethod
    def from_json(cls, d: Any, where: str) -> "CheckpointInfo":
        fmt = d.get("format") if isinstance(d, dict) else None
        if fmt not in (FORMAT, PYTREE_FORMAT, UNVERIFIED_FORMAT):
            if isinstance(d, dict) and ("digest" in d or str(fmt).startswith("sparse_embed/")):
                raise CorruptCheckpointError(f"{where}: its metadata is corrupt (format {fmt!r}); {WHAT_TO_DO}.")
            found = fmt if isinstance(d, dict) else type(d).__name__
            raise CheckpointError(f"{where} is not a sparse_embed checkpoint (format {found!r}, expected {FORMAT!r}).")
        if fmt != UNVERIFIED_FORMAT and d.get("digest") != _digest({k: v for k, v in d.items() if k != "digest"}):
            raise CorruptCheckpointError(f"{where}: its metadata is corrupt (its digest does not match); {WHAT_TO_DO}.")
        try:
            tables = tuple(TableRecord(**{**t, "slots": tuple(tuple(s) for s in t["slots"]),
                                          **({"default": tuple(t["default"])} if isinstance(t.get("default"), list)
                                             else {})}) for t in d["tables"])
            return cls(d["kind"], tables, tuple(tuple(g) for g in d["stacking"]), int(d["num_shards"]),
                       d["step"], bool(d["has_user"]), d.get("checksums"), d.get("user_checksums"), fmt,
                       bool(d.get("has_data", False)))
        except (KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"{where}: its metadata is corrupt ({type(e).__name__}: {e}).") from None


def _digest(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def training_info(plan: EmbeddingPlan, step: int | None, has_user: bool, checksums: Mapping[str, str] | None = None,
                  user_sums: Mapping[str, str] | None = None) -> CheckpointInfo:
    tables = tuple(TableRecord.from_spec(plan.tables[n]) for n in sorted(plan.tables))
    stacking = tuple(tuple(p.table.name for p in s.tables) for s in plan.stacks)
    return CheckpointInfo("training", tables, stacking, plan.num_shards, step, has_user, checksums, user_sums)


def stored_layout(info: CheckpointInfo, group: str, key: str) -> store.Layout:
    """What the stored array `key` of `group` (a table, or a raw-id table's waiting ids) must be."""
    suffix = PENDING if group.endswith(PENDING) and group not in info.table_names else ""
    rec = info.table(group[: len(group) - len(suffix)])
    widths = {TABLE_KEY: rec.stored[1], **dict(rec.slots)}
    if suffix or key not in widths:
        return raw_layout(key, suffix, rec.vocabulary_size)
    return store.Layout(rec.stored[0] if key == TABLE_KEY else np.float32, widths[key], rec.vocabulary_size)


def as_step(step: Any, what: str = "step") -> int:
    """`step` as an int: a Python, numpy or jax integer scalar; anything else (floats, strings, bools) is a
    TypeError."""
    try:
        if not isinstance(step, (bool, np.bool_)) and np.dtype(getattr(step, "dtype", np.int64)).kind in "iu":
            return operator.index(step)
    except TypeError:
        pass
    raise TypeError(f"{what} must be an integer, got {step!r} ({type(step).__name__}).")


def _saved_step(step_dir: str) -> int | None:
    """The step a step directory's metadata records, read as plain JSON (orbax's file), or None where it cannot
    be read (reading the checkpoint then reports the damage) or records none."""
    try:
        with open(os.path.join(step_dir, META, "metadata")) as f:
            step = json.load(f).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def resolve(path: str | os.PathLike, step: int | None = None, *, complete: bool = True) -> str:
    """The step directory of `path`: `path` itself if it is one, else its latest (or given) complete step (a
    later one without its meta item is passed over with a warning; `complete=False`: the latest, as it is)."""
    path = os.fspath(path)
    step = None if step is None else as_step(step)
    if os.path.isfile(path):
        raise CheckpointError(f"{path} is a file, not a checkpoint directory: pass the directory given to "
                              "CheckpointManager (or one of its step directories).")
    if not os.path.isdir(path):
        raise CheckpointError(f"No checkpoint at {path}: the directory does not exist.")
    if os.path.isdir(os.path.join(path, META)):
        name = os.path.basename(os.path.normpath(path))
        if step is not None and name.isdigit() and int(name) != step:
            raise CheckpointError(f"{path} is the directory of step {name}, not of step {step}: pass the checkpoint "
                                  "directory above it to choose a step.")
        saved = None if step is None or name.isdigit() else _saved_step(path)
        if saved is not None and saved != step:  # a serving export, or a step directory under another name
            raise CheckpointError(f"{path} is one checkpoint step, step {saved}, not step {step}: it holds no other.")
        return path
    if any(os.path.exists(os.path.join(path, item)) for item in _STEP_ITEMS):
        raise CorruptCheckpointError(f"{path} is an incomplete or damaged checkpoint step: its '{META}' item is "
                                     f"missing; {WHAT_TO_DO}.")
    numbered = sorted(int(n) for n in os.listdir(path) if n.isdigit() and os.path.isdir(os.path.join(path, n)))
    steps = [n for n in numbered if os.path.isdir(os.path.join(path, str(n), META))]
    if not complete and numbered and (step is None or step in numbered):
        return os.path.join(path, str(numbered[-1] if step is None else step))
    if step is not None and step in numbered and step not in steps:
        raise CorruptCheckpointError(f"Step {step} in {path} is incomplete or damaged: its '{META}' item is "
                                     f"missing; {WHAT_TO_DO}.")
    if not steps:
        raise CheckpointError(f"No complete checkpoint in {path} (no step directories with a '{META}' item).")
    if step is None:
        step = steps[-1]
        if numbered[-1] > step:
            warnings.warn(f"{path}: step {numbered[-1]} is incomplete (no '{META}' item); using step {step}, the "
                          "latest complete one.", stacklevel=3)
    elif step not in steps:
        raise CheckpointError(f"No step {step} in {path}; complete steps are {steps}.")
    return os.path.join(path, str(step))


def first_line(e: Exception, limit: int = 160) -> str:
    line = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


def unreadable_error(step_dir: str, info: CheckpointInfo, names: list[str], e: Exception) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{step_dir} (step {info.step}) is corrupt or incomplete: {', '.join(names)} cannot "
                                  f"be read ({type(e).__name__}: {first_line(e)}); {WHAT_TO_DO}.")
