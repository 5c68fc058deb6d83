"""Orbax checkpoints of the training state that restore onto any mesh and stacking.

A checkpoint step directory holds three orbax items:

- `embeddings`: per table, its natural block arrays (see `core.relayout`):
  `{table: {"table": [stored_rows, dim], slot: [stored_rows, width]}}`, id
  order, so their meaning does not depend on the mesh or the stacking;
- `user` (optional): any pytree (dense params, optax state, ...);
- `meta`: JSON `CheckpointInfo`: every table's spec (vocabulary, dim,
  dtype, combiner, max_norm, optimizer and its slot widths), the stacking and
  the mesh size it was saved from, and the step.

Restoring checks the plan's tables against `meta` (a clear `ValueError`
naming the table otherwise), reads every table's natural blocks straight into
the new mesh's row-block sharding (orbax pads or truncates the padding rows),
and relays them into the plan's stacks with one `all_to_all` per array.

Memory: saving holds one extra copy of each device's shards (the natural
blocks) until orbax has copied them to the host, and the host holds one copy
of this process's shards while the background write runs. Restoring holds,
per device, its block of every table plus the stacked result (~2x the state,
per device). No device ever holds a whole table (unless the mesh has one
device), and neither does the host.

Crash safety comes from orbax: a step is written into a temporary directory
and renamed when complete, so a killed save never touches the last complete
step, and `latest_step()` / `restore()` only see complete steps (leftover
temporary directories are removed when a manager is opened).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp

from sparse_embed.core.planning import EmbeddingPlan
from sparse_embed.core.relayout import TABLE_KEY, from_natural, stored_rows, to_natural
from sparse_embed.core.specs import TableSpec
from sparse_embed.core.state import EmbeddingVariables, check_state
from sparse_embed.core.tables import natural_table

FORMAT = "sparse_embed/1"
EMBEDDINGS, USER, META = "embeddings", "user", "meta"


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or not one sparse_embed can read."""


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
    stored_rows: int  # rows of the stored natural arrays (>= vocabulary_size; the rest is padding)

    @classmethod
    def from_spec(cls, t: TableSpec, num_shards: int, *, with_slots: bool = True) -> "TableRecord":
        opt = t.resolved_optimizer
        slots = tuple(sorted((k, v.width) for k, v in opt.slots(t.embedding_dim).items())) if with_slots else ()
        return cls(t.name, t.vocabulary_size, t.embedding_dim, str(t.dtype), t.combiner, t.max_norm,
                   type(opt).__name__, slots, stored_rows(t.vocabulary_size, num_shards))

    def to_spec(self) -> TableSpec:
        """A `TableSpec` with this record's shape, dtype, combiner and max_norm (for serving)."""
        return TableSpec(self.name, self.vocabulary_size, self.embedding_dim, combiner=self.combiner,
                         max_norm=self.max_norm, dtype=self.dtype)

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

    def table(self, name: str) -> TableRecord:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)

    @property
    def table_names(self) -> list[str]:
        return [t.name for t in self.tables]

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["format"] = FORMAT
        return d

    @classmethod
    def from_json(cls, d: Any, where: str) -> "CheckpointInfo":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            found = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise CheckpointError(f"{where} is not a sparse_embed checkpoint (format {found!r}, expected {FORMAT!r}).")
        try:
            tables = tuple(TableRecord(**{**t, "slots": tuple(tuple(s) for s in t["slots"])}) for t in d["tables"])
            return cls(d["kind"], tables, tuple(tuple(g) for g in d["stacking"]), int(d["num_shards"]),
                       d["step"], bool(d["has_user"]))
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{where}: its metadata is corrupt ({type(e).__name__}: {e}).") from None


def training_info(plan: EmbeddingPlan, step: int | None, has_user: bool) -> CheckpointInfo:
    tables = tuple(TableRecord.from_spec(plan.tables[n], plan.num_shards) for n in sorted(plan.tables))
    stacking = tuple(tuple(p.table.name for p in s.tables) for s in plan.stacks)
    return CheckpointInfo("training", tables, stacking, plan.num_shards, step, has_user)


# ----------------------------------------------------------------- reading a step directory
def resolve(path: str | os.PathLike, step: int | None = None) -> str:
    """The step directory of `path`: `path` itself if it is one, else its latest (or given) complete step."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"No checkpoint at {path}: the directory does not exist.")
    if os.path.isdir(os.path.join(path, META)):
        return path
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


def checkpointer() -> ocp.Checkpointer:
    """An orbax checkpointer of the composite items a step directory holds."""
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def read_info(path: str | os.PathLike, step: int | None = None) -> CheckpointInfo:
    """The `CheckpointInfo` of a checkpoint (a step directory, or a manager directory: latest step)."""
    step_dir = resolve(path, step)
    try:
        d = checkpointer().restore(step_dir, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
    except Exception as e:  # noqa: BLE001 - any read failure means the same thing to the user
        raise CheckpointError(f"{step_dir}: cannot read its metadata ({type(e).__name__}: {_first_line(e)}).") from None
    return CheckpointInfo.from_json(d, step_dir)


def read_embeddings(step_dir: str, targets: Mapping[str, Mapping[str, jax.ShapeDtypeStruct]]) -> dict:
    """Restores `{table: {key: array}}` natural arrays into `targets` (shape, dtype, sharding); pads/truncates rows."""
    args = jax.tree.map(
        lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=t.shape, dtype=t.dtype, strict=False),
        dict(targets),
    )
    restore = ocp.args.PyTreeRestore(item=dict(targets), restore_args=args, partial_restore=True)
    try:
        return checkpointer().restore(step_dir, args=ocp.args.Composite(**{EMBEDDINGS: restore}))[EMBEDDINGS]
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(
            f"{step_dir} is corrupt or incomplete: its '{EMBEDDINGS}' arrays cannot be read "
            f"({type(e).__name__}: {_first_line(e)})."
        ) from None


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
        rec, want = info.table(name), TableRecord.from_spec(t, plan.num_shards)
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
    fresh slots.
    """
    step_dir = resolve(path, step)
    info = read_info(step_dir)
    check_compatible(plan, info, step_dir, allow_vocab_growth=allow_vocab_growth)
    if with_slots and info.kind != "training":
        raise ValueError(f"{step_dir} is a {info.kind} checkpoint without optimizer slots; "
                         "restore it with with_slots=False, or restore a training checkpoint.")
    sharding, S = plan.table_sharding(), plan.num_shards
    targets = {}
    for name, t in plan.tables.items():
        rows = stored_rows(t.vocabulary_size, S)
        keys = {TABLE_KEY: (t.embedding_dim, t.dtype)}
        if with_slots:
            keys.update({k: (w, np.float32) for k, w in info.table(name).slots})
        targets[name] = {k: jax.ShapeDtypeStruct((rows, w), dt, sharding=sharding) for k, (w, dt) in keys.items()}
    natural = read_embeddings(step_dir, targets)
    valid = {name: info.table(name).vocabulary_size for name in plan.tables}
    fresh = None if rng is None else (lambda s, i: natural_table(plan, s, rng, i))
    return from_natural(plan, natural, valid, fresh)


# ----------------------------------------------------------------- the manager
class Restored(NamedTuple):
    """What `CheckpointManager.restore` returns."""

    tables: dict[str, EmbeddingVariables]
    step: int
    user: Any


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
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables], *,
             user: Any = None, force: bool = False) -> bool:
        """Starts saving `step` (skipped, returning False, if `save_interval_steps` says so and not `force`).

        `tables` may be donated or updated as soon as this returns.
        """
        step = int(step)
        if not force and not self._manager.should_save(step):
            return False
        check_state(plan, tables)
        info = training_info(plan, step, user is not None)
        items = {EMBEDDINGS: ocp.args.PyTreeSave(to_natural(plan, tables)), META: ocp.args.JsonSave(info.to_json())}
        if user is not None:
            items[USER] = ocp.args.PyTreeSave(user)
        return self._manager.save(step, args=ocp.args.Composite(**items), force=force)

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

        Args:
          plan: the plan to restore into (any mesh size, any stacking).
          step: default, the latest complete step.
          user: a target for the user pytree (arrays or `jax.ShapeDtypeStruct`s
            with the shardings to restore into); None skips it.
          allow_vocab_growth: allow tables with a larger vocabulary than saved;
            new rows get the initializer (from `rng`) and fresh slots.
        """
        step_dir = self._step_dir(step)
        info = read_info(step_dir)
        tables = restore_embeddings(plan, step_dir, allow_vocab_growth=allow_vocab_growth, rng=rng)
        restored_user = None
        if user is not None:
            if not info.has_user:
                raise CheckpointError(f"{step_dir} has no user pytree; call restore without user=.")
            args = ocp.args.PyTreeRestore(item=user, restore_args=ocp.checkpoint_utils.construct_restore_args(user))
            try:
                restored_user = checkpointer().restore(step_dir, args=ocp.args.Composite(**{USER: args}))[USER]
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(f"{step_dir}: its user pytree does not match the target given "
                                      f"({type(e).__name__}: {_first_line(e)}).") from None
        return Restored(tables, int(info.step), restored_user)

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

