"""Orbax checkpoints of the training state that restore onto any mesh and stacking.

A checkpoint step directory holds three orbax items:

- `embeddings`: the table store (`io.store`): per table and slot one zarr3
  array `[vocabulary_size, width]` in id order, with a CRC32C per chunk, so
  their meaning does not depend on the mesh or the stacking;
- `user` (optional): any pytree (dense params, optax state, ...);
- `meta`: JSON `CheckpointInfo`: every table's spec (vocabulary, dim,
  dtype, combiner, max_norm, optimizer and its slot widths), the stacking and
  the mesh size it was saved from, the step, a checksum of every stored
  array (`io.integrity`) and a digest of the metadata itself.

Integrity: tensorstore checks every chunk's CRC32C as it reads it, and
every read (restore, convert, `load_serving`, `sparse-embed verify`)
recomputes each array's checksum from the values it read; either raises
`CorruptCheckpointError` naming the step and the array on a mismatch;
`CheckpointManager.restore()` without a step then falls back to the newest
step that verifies, with a warning. Checkpoints written before checksums
(format "sparse_embed/1") still restore, with a warning that they are not
verified; those written by orbax's PyTree handler (formats 1 and 2, with
natural blocks padded for their mesh) still read.

Restoring checks the plan's tables against `meta` (a clear `ValueError`
naming the table otherwise), then streams each stored array, chunk by
chunk, into the plan's stacks (one `all_to_all` per chunk).

Memory: saving and restoring stream the tables in chunks of ~4 MiB per
device, so they need the state plus a few chunks; `save` returns once the
tables are on disk (they may then be donated or updated), and the user
pytree and the metadata are written in the background.

Crash safety comes from orbax: a step is written into a temporary directory
and renamed when complete, so a killed save never touches the last complete
step, and `latest_step()` / `restore()` only see complete steps (leftover
temporary directories are removed when a manager is opened).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import warnings
from typing import Any, Callable, Mapping, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp

from sparse_embed.core.planning import EmbeddingPlan
from sparse_embed.core.relayout import TABLE_KEY, from_natural, stored_rows
from sparse_embed.core.specs import Dynamic, TableSpec
from sparse_embed.core.state import EmbeddingVariables, check_state
from sparse_embed.core.tables import empty_tables, init_tables, natural_table
from sparse_embed.io import store
from sparse_embed.io.id_checkpoint import PENDING, raw_layout, read_id_tables, write_id_tables
from sparse_embed.io.integrity import ALGORITHM, bind, checksum, matches, meaning

FORMAT = "sparse_embed/3"  # the table store (io.store)
PYTREE_FORMAT, UNVERIFIED_FORMAT = "sparse_embed/2", "sparse_embed/1"  # orbax PyTree arrays; 1: before checksums
STAGING = ".sparse_embed-staging"  # tables written before orbax commits the step; moved into it
EMBEDDINGS, USER, META = "embeddings", "user", "meta"
_STEP_ITEMS = (EMBEDDINGS, USER, "_CHECKPOINT_METADATA")  # what a step directory holds beside META


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or not one sparse_embed can read."""


class CorruptCheckpointError(CheckpointError):
    """A step's stored values or metadata are damaged: a checksum does not match, or they cannot be read."""


_WHAT_TO_DO = ("restore another step (CheckpointManager.restore() without step= falls back to the newest good one), "
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

    @classmethod
    def from_spec(cls, t: TableSpec, *, with_slots: bool = True) -> "TableRecord":
        opt = t.resolved_optimizer
        slots = tuple(sorted((k, v.width) for k, v in opt.slots(t.embedding_dim).items())) if with_slots else ()
        return cls(t.name, t.vocabulary_size, t.embedding_dim, str(t.dtype), t.combiner, t.max_norm,
                   type(opt).__name__, slots, t.vocabulary_size, t.dynamic is not None)

    def to_spec(self) -> TableSpec:
        """A `TableSpec` with this record's shape, dtype, combiner and max_norm (for serving)."""
        return TableSpec(self.name, self.vocabulary_size, self.embedding_dim, combiner=self.combiner,
                         max_norm=self.max_norm, dtype=self.dtype, dynamic=Dynamic() if self.dynamic else None)

    @property
    def nbytes(self) -> int:
        """Bytes of the table and its slots (`[vocab, dim]` + `[vocab, width]` f32 each)."""
        return self.vocabulary_size * (self.embedding_dim * np.dtype(self.dtype).itemsize
                                       + 4 * sum(w for _, w in self.slots))


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
                raise CorruptCheckpointError(f"{where}: its metadata is corrupt (format {fmt!r}); {_WHAT_TO_DO}.")
            found = fmt if isinstance(d, dict) else type(d).__name__
            raise CheckpointError(f"{where} is not a sparse_embed checkpoint (format {found!r}, expected {FORMAT!r}).")
        if fmt != UNVERIFIED_FORMAT and d.get("digest") != _digest({k: v for k, v in d.items() if k != "digest"}):
            raise CorruptCheckpointError(f"{where}: its metadata is corrupt (its digest does not match); {_WHAT_TO_DO}.")
        try:
            tables = tuple(TableRecord(**{**t, "slots": tuple(tuple(s) for s in t["slots"])}) for t in d["tables"])
            return cls(d["kind"], tables, tuple(tuple(g) for g in d["stacking"]), int(d["num_shards"]),
                       d["step"], bool(d["has_user"]), d.get("checksums"), d.get("user_checksums"), fmt)
        except (KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"{where}: its metadata is corrupt ({type(e).__name__}: {e}).") from None


def _digest(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def leaf_key(path: tuple) -> str:
    """A user leaf's path as a container-independent string ("opt/0/mu/dense/kernel"), as orbax names it."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def user_checksums(user: Any) -> dict[str, str]:
    """`{leaf_key: "checksum dtype shape"}` of a user pytree's array leaves (others, e.g. strings, are skipped)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(user):
        a = leaf if isinstance(leaf, jax.Array) else np.asarray(leaf)
        if a.dtype.kind in "biufc" and a.dtype.itemsize in (1, 2, 4, 8):
            out[leaf_key(path)] = bind(checksum(a), a.dtype, a.shape)
    return out


def _array_name(table: str, key: str) -> str:
    return f"table {table!r}" if key == TABLE_KEY else f"slot {key!r} of table {table!r}"


def verify_embeddings(step_dir: str, info: CheckpointInfo, arrays: Mapping[str, Mapping[str, Any]]) -> None:
    """Raises CorruptCheckpointError naming every array whose values do not match its saved checksum."""
    def bound(name: str, a: Any) -> str:
        rows = info.table(name).vocabulary_size
        return bind(checksum(a, rows), a.dtype, (rows, *a.shape[1:]))

    check_sums(step_dir, info, {f"{name}/{key}": bound(name, a) for name, keys in arrays.items()
                                for key, a in keys.items()})


def check_sums(step_dir: str, info: CheckpointInfo, sums: Mapping[str, str]) -> None:
    """Raises CorruptCheckpointError naming every array ("table/key") whose bound checksum (of the values as
    read, with their dtype and shape) is not the saved one. The one check of every reader."""
    if not info.verified:
        return
    bad = [_array_name(*k.split("/", 1)) for k, v in sums.items() if not matches(info.checksums.get(k), v)]
    if bad:
        raise CorruptCheckpointError(f"{step_dir} (step {info.step}) is corrupt: the values of {', '.join(bad)} do not "
                                     f"match the checksum saved with them; {_WHAT_TO_DO}.")


def _meanings(tree: Any) -> dict[str, str]:
    """`{leaf_key: "dtype shape"}` of a pytree's leaves that have a dtype (arrays, `ShapeDtypeStruct`s)."""
    return {leaf_key(p): meaning(x.dtype, x.shape) for p, x in jax.tree_util.tree_leaves_with_path(tree)
            if hasattr(x, "dtype")}


def verify_user(step_dir: str, info: CheckpointInfo, user: Any, target: Any = None) -> int:
    """Checks a restored user pytree's leaves against their checksums; returns how many could not be checked.

    A leaf for which `target` asked another dtype or shape than it was saved
    with (a cast) cannot be checked, nor one saved without a checksum. Any
    other leaf must come back as saved: its values, dtype and shape.
    Without `target` (read as stored) nothing is asked for.
    """
    if not info.verified or info.user_checksums is None:
        return 0
    asked = None if target is None else _meanings(target)
    bad, unchecked = [], 0
    for key, got in user_checksums(user).items():
        want = info.user_checksums.get(key, "")
        if not want or (asked is not None and asked.get(key) != want.split(" ", 1)[-1]):
            unchecked += 1
        elif not matches(want, got):
            bad.append(key)
    if bad:
        raise CorruptCheckpointError(f"{step_dir} (step {info.step}) is corrupt: the user pytree's leaves {bad} do not "
                                     f"match the checksums saved with them; {_WHAT_TO_DO}.")
    return unchecked


def warn_unverified(step_dir: str, info: CheckpointInfo) -> None:
    if not info.verified:
        warnings.warn(f"{step_dir} was written by an older sparse_embed, without checksums: its values are restored "
                      "unverified. Save it again to add them.", stacklevel=3)


def training_info(plan: EmbeddingPlan, step: int | None, has_user: bool, checksums: Mapping[str, str] | None = None,
                  user_sums: Mapping[str, str] | None = None) -> CheckpointInfo:
    tables = tuple(TableRecord.from_spec(plan.tables[n]) for n in sorted(plan.tables))
    stacking = tuple(tuple(p.table.name for p in s.tables) for s in plan.stacks)
    return CheckpointInfo("training", tables, stacking, plan.num_shards, step, has_user, checksums, user_sums)


# ----------------------------------------------------------------- reading a step directory
def resolve(path: str | os.PathLike, step: int | None = None) -> str:
    """The step directory of `path`: `path` itself if it is one, else its latest (or given) complete step."""
    path = os.fspath(path)
    if os.path.isfile(path):
        raise CheckpointError(f"{path} is a file, not a checkpoint directory: pass the directory given to "
                              "CheckpointManager (or one of its step directories).")
    if not os.path.isdir(path):
        raise CheckpointError(f"No checkpoint at {path}: the directory does not exist.")
    if os.path.isdir(os.path.join(path, META)):
        return path
    if any(os.path.exists(os.path.join(path, item)) for item in _STEP_ITEMS):
        raise CorruptCheckpointError(f"{path} is an incomplete or damaged checkpoint step: its '{META}' item is "
                                     f"missing; {_WHAT_TO_DO}.")
    steps = sorted(int(n) for n in os.listdir(path) if n.isdigit() and os.path.isdir(os.path.join(path, n)))
    if not steps:
        raise CheckpointError(f"No complete checkpoint in {path} (no step directories with a '{META}' item).")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(f"No step {step} in {path}; complete steps are {steps}.")
    return os.path.join(path, str(step))


def _first_line(e: Exception, limit: int = 160) -> str:
    line = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."


class _MoveInHandler(ocp.CheckpointHandler):
    """Saves the `embeddings` item, already written by the table store into a staging directory, by moving it in.

    So the tables reach disk before orbax starts (streamed, in bounded
    memory), and the step still appears only when orbax commits it whole.
    """

    def save(self, directory, args: "StagedSave") -> None:
        if jax.process_index() == 0:
            for name in os.listdir(args.staging):
                os.rename(os.path.join(args.staging, name), os.path.join(os.fspath(directory), name))
            os.rmdir(args.staging)

    def restore(self, directory, args=None):
        raise NotImplementedError("the table store is read by sparse_embed.io.store")


@ocp.args.register_with_handler(_MoveInHandler, for_save=True, for_restore=True)
@dataclasses.dataclass
class StagedSave(ocp.args.CheckpointArgs):
    staging: str  # a directory written by `io.store`, moved into the step's `embeddings` item


def item_handlers(*, write: bool = False) -> dict[str, ocp.CheckpointHandler]:
    """The orbax handler of each item: `embeddings` moved in from staging (write) or an older PyTree (read).

    The user pytree's options were chosen by measurement (2.5M x 64 f32 with
    Adagrad slots, one CPU core, benchmarks/checkpoint.py):

    - no zstd: it made saving 1.5x and restoring 1.6x slower and shrank an initialised table by ~7% (only
      untrained, constant slots shrink a lot);
    - no OCDBT: its per-process database is merged after the write, which copies the data a second time:
      save + sync took 1.8-6.0 s with it, 0.8-1.0 s without (np.save: 1.7 s); restore 5.0-5.6 vs 3.8-4.9 s.
      Checkpoints written with OCDBT still restore.
    """
    arrays = lambda: ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=False)  # noqa: E731
    return {EMBEDDINGS: _MoveInHandler() if write else arrays(), USER: arrays(), META: ocp.JsonCheckpointHandler()}


def checkpointer(*, write: bool = False) -> ocp.Checkpointer:
    """An orbax checkpointer of the composite items a step directory holds."""
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler(**item_handlers(write=write)))


def write_step(save: Callable[[dict], Any], staging: str, write_tables: Callable[[str], dict[str, str]],
               info: CheckpointInfo, user: Any = None) -> Any:
    """Writes the tables into `staging` (`write_tables(dir) -> checksums`), then `save(items)` with orbax.

    The staging directory is removed if anything fails.
    """
    try:
        if jax.process_index() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        info = dataclasses.replace(info, checksums=write_tables(staging))
        items = {EMBEDDINGS: StagedSave(staging), META: ocp.args.JsonSave(info.to_json())}
        if user is not None:
            items[USER] = ocp.args.PyTreeSave(user)
        return save(items)
    finally:
        if jax.process_index() == 0:
            shutil.rmtree(staging, ignore_errors=True)


def read_info(path: str | os.PathLike, step: int | None = None) -> CheckpointInfo:
    """The `CheckpointInfo` of a checkpoint (a step directory, or a manager directory: latest step)."""
    step_dir = resolve(path, step)
    try:
        d = checkpointer().restore(step_dir, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
    except Exception as e:  # noqa: BLE001 - any read failure means the same thing to the user
        raise CorruptCheckpointError(f"{step_dir}: cannot read its metadata ({type(e).__name__}: {_first_line(e)}); "
                                     f"{_WHAT_TO_DO}.") from None
    return CheckpointInfo.from_json(d, step_dir)


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
            raise _unreadable_error(step_dir, info, [_array_name(*e.array)], e) from None
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
        raise _unreadable_error(step_dir, info, [_unreadable(step_dir, targets, info)], e) from None
    verify_embeddings(step_dir, info, arrays)
    return arrays


def _unreadable_error(step_dir: str, info: CheckpointInfo, names: list[str], e: Exception) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{step_dir} (step {info.step}) is corrupt or incomplete: {', '.join(names)} cannot "
                                  f"be read ({type(e).__name__}: {_first_line(e)}); {_WHAT_TO_DO}.")


def _unreadable(step_dir: str, targets: Mapping[str, Mapping[str, jax.ShapeDtypeStruct]], info: CheckpointInfo) -> str:
    """Names the arrays of `targets` that cannot be read on their own (after a failed read of them all)."""
    if sum(len(keys) for keys in targets.values()) == 1:
        return ", ".join(_array_name(t, k) for t, keys in targets.items() for k in keys)
    bad = []
    for name, keys in targets.items():
        for key, target in keys.items():
            try:
                read_embeddings(step_dir, {name: {key: target}}, dataclasses.replace(info, checksums=None))
            except CorruptCheckpointError:
                bad.append(_array_name(name, key))
    return ", ".join(bad) or f"its '{EMBEDDINGS}' arrays"


# ----------------------------------------------------------------- checking a plan against a checkpoint
def check_compatible(plan: EmbeddingPlan, info: CheckpointInfo, where: str, *, allow_vocab_growth: bool) -> None:
    """Raises a ValueError naming the table if the plan cannot be restored from `info`."""
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
        if rec.dtype != want.dtype:
            raise ValueError(f"Table {name!r}: dtype is {rec.dtype} in the checkpoint {where} but {want.dtype} in "
                             "the plan; use the checkpoint's dtype.")
        if info.kind == "training" and rec.slots != want.slots:
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


def _static_part(plan: EmbeddingPlan) -> EmbeddingPlan:
    """The plan without its raw-id stacks (those are stored in id order, `id_checkpoint`)."""
    return dataclasses.replace(plan, stacks=tuple(s for s in plan.stacks if s.dynamic is None))


def restore_state(plan: EmbeddingPlan, step_dir: str, *, allow_vocab_growth: bool = False,
                  rng: jax.Array | None = None, with_slots: bool = True):
    """`(tables, id_maps)` of the plan from one step directory (see `restore_embeddings`)."""
    info = read_info(step_dir)
    warn_unverified(step_dir, info)
    check_compatible(plan, info, step_dir, allow_vocab_growth=allow_vocab_growth)
    if with_slots and info.kind != "training":
        raise ValueError(f"{step_dir} is a {info.kind} checkpoint without optimizer slots; "
                         "restore it with with_slots=False, or restore a training checkpoint.")
    static = _static_part(plan)
    if info.format == FORMAT:
        tables = _stream_in(static, step_dir, info, allow_vocab_growth=allow_vocab_growth, rng=rng,
                            with_slots=with_slots)
    else:
        tables = _legacy_in(static, step_dir, info, rng=rng, with_slots=with_slots)
    if len(static.stacks) == len(plan.stacks):
        return tables, {}
    slots = {t.name: [k for k, _ in t.slots] for t in info.tables}
    raw, maps = read_id_tables(plan, slots, lambda group, key: read_host_array(step_dir, info, group, key),
                               with_slots=with_slots)
    return {**tables, **raw}, maps


def stored_layout(info: CheckpointInfo, group: str, key: str) -> store.Layout:
    """What the stored array `key` of `group` (a table, or a raw-id table's waiting ids) must be."""
    suffix = PENDING if group.endswith(PENDING) and group not in info.table_names else ""
    rec = info.table(group[: len(group) - len(suffix)])
    widths = {TABLE_KEY: rec.embedding_dim, **dict(rec.slots)}
    if suffix or key not in widths:
        return raw_layout(key, suffix, rec.vocabulary_size)
    return store.Layout(np.dtype(rec.dtype) if key == TABLE_KEY else np.float32, widths[key], rec.vocabulary_size)


def read_host_array(step_dir: str, info: CheckpointInfo, group: str, key: str) -> np.ndarray:
    """One stored array of the table store on the host, its metadata and checksum verified."""
    try:
        a, got = store.read_host(os.path.join(step_dir, EMBEDDINGS), group, key, stored_layout(info, group, key))
    except store.StoreReadError as e:
        raise _unreadable_error(step_dir, info, [_array_name(*e.array)], e) from None
    check_sums(step_dir, info, {f"{group}/{key}": got})
    return a


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
    if any(valid[n] < t.vocabulary_size for n, t in plan.tables.items()):
        if rng is None:
            raise ValueError("Restoring a larger vocabulary needs the initial values of the new rows (rng=).")
        state = init_tables(plan, rng, with_slots=with_slots)  # the new rows keep these values
    else:
        state = empty_tables(plan, with_slots=with_slots)
    try:
        state, sums = store.read_into_state(os.path.join(step_dir, EMBEDDINGS), plan, state, valid)
    except store.StoreReadError as e:
        raise _unreadable_error(step_dir, info, [_array_name(*e.array)], e) from None
    check_sums(step_dir, info, sums)
    return state


def read_user(step_dir: str, info: CheckpointInfo, target: Any) -> Any:
    """The user pytree of a step, restored into `target`'s structure and shardings, verified."""
    if not info.has_user:
        raise CheckpointError(f"{step_dir} has no user pytree; call restore without user=.")
    args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
    try:
        user = checkpointer().restore(step_dir, args=ocp.args.Composite(**{USER: args}))[USER]
    except Exception as e:  # noqa: BLE001
        saved = {k: v.split(" ", 1)[1] for k, v in (info.user_checksums or {}).items()}
        if saved and saved == _meanings(target):  # the target fits what was saved: the stored data is damaged
            raise CorruptCheckpointError(f"{step_dir}: its user pytree cannot be read ({type(e).__name__}: "
                                         f"{_first_line(e)}); {_WHAT_TO_DO}.") from None
        raise CheckpointError(f"{step_dir}: its user pytree does not match the target given "
                              f"({type(e).__name__}: {_first_line(e)}).") from None
    unchecked = verify_user(step_dir, info, user, target)
    if unchecked and info.verified:
        warnings.warn(f"{step_dir}: {unchecked} leaves of the user pytree were restored with another dtype or shape "
                      "than saved (as the target asked), so their checksums could not be checked.", stacklevel=3)
    return user


def read_user_host(step_dir: str, info: CheckpointInfo) -> Any:
    """The user pytree as saved, as numpy arrays on the host (no target needed), verified."""
    handler = ocp.Checkpointer(item_handlers()[USER])
    path = os.path.join(step_dir, USER)
    try:
        tree = handler.metadata(path).item_metadata.tree
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        user = handler.restore(path, args=ocp.args.PyTreeRestore(item=tree, restore_args=args))
    except Exception as e:  # noqa: BLE001
        raise CorruptCheckpointError(f"{step_dir}: its user pytree cannot be read ({type(e).__name__}: "
                                     f"{_first_line(e)}); {_WHAT_TO_DO}.") from None
    if verify_user(step_dir, info, user):  # read as stored: a leaf without a checksum was not saved
        raise CorruptCheckpointError(f"{step_dir}: the user pytree has leaves that were not saved; {_WHAT_TO_DO}.")
    missing = sorted(set(info.user_checksums or ()) - set(user_checksums(user)))
    if missing:
        raise CorruptCheckpointError(f"{step_dir}: the user pytree's leaves {missing} are missing; {_WHAT_TO_DO}.")
    return user


# ----------------------------------------------------------------- the manager
class Restored(NamedTuple):
    """What `CheckpointManager.restore` returns."""

    tables: dict[str, EmbeddingVariables]
    step: int
    user: Any
    id_maps: dict[str, Any] = {}  # the raw-id tables' maps (`IdMap`), placed for the plan


class CheckpointManager:
    """Saves and restores `(tables, step, user pytree)` with an orbax `CheckpointManager`.

    Saves are asynchronous by default: `save` returns once the arrays are
    copied off the devices, and the files are written in the background; call
    `wait()` before reading them from elsewhere (and `close()` at the end).

    Example:
      with se.CheckpointManager("/ckpt", max_to_keep=3) as ckpt:
          ckpt.save(step, plan, tables, user={"dense": params, "opt": opt_state})
          ...
          r = ckpt.restore(plan, user={"dense": params, "opt": opt_state})  # latest step, any mesh
          tables, step, user = r.tables, r.step, r.user
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
                 save_interval_steps: int = 1, async_save: bool = True):
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=save_interval_steps,
            preservation_policy=ocp.checkpoint_managers.LatestN(max_to_keep),
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=item_handlers(write=True))
        if jax.process_index() == 0:  # tables staged by a save that was killed
            for name in os.listdir(self.directory):
                if name.startswith(STAGING):
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def save(self, step: int, plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables], *,
             id_maps: Mapping[str, Any] | None = None, user: Any = None, force: bool = False) -> bool:
        """Saves `step` (skipped, returning False, if `save_interval_steps` says so and not `force`).

        The tables are streamed to disk before this returns (so `tables` may
        be donated or updated right after); the user pytree and the metadata
        are written in the background (`wait()`). A plan with raw-id tables
        needs their `id_maps` (saved with them, in id order).
        """
        step = int(step)
        if not force and not self._manager.should_save(step):
            return False
        check_state(plan, tables)
        static = _static_part(plan)
        if len(static.stacks) != len(plan.stacks) and id_maps is None:
            raw = sorted(set(plan.stack_names) - set(static.stack_names))
            raise ValueError(f"The plan has raw-id tables {raw}: pass their maps, save(..., id_maps=id_maps).")

        def write(d: str) -> dict[str, str]:
            sums = store.write_state(d, static, tables)
            return sums if id_maps is None else {**sums, **write_id_tables(d, plan, tables, id_maps)}

        info = training_info(plan, step, user is not None, None, None if user is None else user_checksums(user))
        return write_step(lambda items: self._manager.save(step, args=ocp.args.Composite(**items), force=force),
                          os.path.join(self.directory, f"{STAGING}-{step}"), write, info, user)

    def wait(self) -> None:
        """Blocks until every started save is complete on disk."""
        self._manager.wait_until_finished()

    def latest_step(self) -> int | None:
        """The newest complete step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def info(self, step: int | None = None) -> CheckpointInfo:
        return read_info(self._step_dir(step))

    def _step_dir(self, step: int | None) -> str:
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"No complete checkpoint in {self.directory}.")
        return resolve(self.directory, step)

    def restore(self, plan: EmbeddingPlan, *, step: int | None = None, user: Any = None,
                allow_vocab_growth: bool = False, rng: jax.Array | None = None) -> Restored:
        """Restores the latest (or given) step onto `plan`'s mesh and stacking.

        Every array is verified against its checksum. Without `step`, a
        corrupt latest step is skipped with a warning naming it, and the
        newest step that verifies is restored.

        Args:
          plan: the plan to restore into (any mesh size, any stacking).
          step: default, the latest complete step that verifies.
          user: a target for the user pytree (arrays or `jax.ShapeDtypeStruct`s
            with the shardings to restore into); None skips it.
          allow_vocab_growth: allow tables with a larger vocabulary than saved;
            new rows get the initializer (from `rng`) and fresh slots.
        """
        kwargs = dict(user=user, allow_vocab_growth=allow_vocab_growth, rng=rng)
        if step is not None:
            return self._restore(plan, self._step_dir(step), **kwargs)
        steps = sorted(self.all_steps(), reverse=True)
        if not steps:
            raise CheckpointError(f"No complete checkpoint in {self.directory}.")
        first_error = None
        for s in steps:
            try:
                restored = self._restore(plan, self._step_dir(s), **kwargs)
            except CorruptCheckpointError as e:
                first_error = first_error or e
                warnings.warn(f"Step {s} of {self.directory} is corrupt, trying an older step: {e}", stacklevel=2)
                continue
            return restored
        raise CorruptCheckpointError(f"Every step of {self.directory} ({steps}) is corrupt; the newest: "
                                     f"{first_error}") from None

    def _restore(self, plan: EmbeddingPlan, step_dir: str, *, user: Any, allow_vocab_growth: bool,
                 rng: jax.Array | None) -> Restored:
        info = read_info(step_dir)
        tables, maps = restore_state(plan, step_dir, allow_vocab_growth=allow_vocab_growth, rng=rng)
        return Restored(tables, int(info.step), None if user is None else read_user(step_dir, info, user), maps)

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

