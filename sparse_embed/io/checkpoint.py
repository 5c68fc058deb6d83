"""Orbax checkpoints of the training state that restore onto any mesh and stacking: the manager.

`CheckpointManager` saves `(tables, step, id maps, user pytree, input state)` as one
orbax step and restores the newest step that verifies onto any plan. The
pieces it is made of, one concern each:

- `io.ckpt_format`: a step's items, its metadata (`CheckpointInfo`), errors;
- `io.store`: the table store (`embeddings`: per table and slot one zarr3
  array in id order, CRC32C per chunk, its metadata checked on open);
- `io.checks`: the one check of every reader (checksums bound to dtype and shape);
- `io.orbax_items`: orbax's handlers, writing a step, reading `meta` and the user pytree;
- `io.restoring`: a step onto a plan (checked, streamed, verified), older formats too.

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

import itertools
import os
import shutil
import warnings
from typing import Any, Mapping, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp

from sparse_embed.core.planning import EmbeddingPlan
from sparse_embed.core.state import EmbeddingVariables, check_state
from sparse_embed.host import distributed
from sparse_embed.io import store
from sparse_embed.io.checks import user_checksums
from sparse_embed.io.ckpt_format import (  # noqa: F401 - the public names, re-exported
    META, STAGING, CheckpointError, CheckpointInfo, CorruptCheckpointError, TableRecord, as_step, resolve,
    training_info,
)
from sparse_embed.io import offload_checkpoint
from sparse_embed.io.data_item import check_serialisable, read_data
from sparse_embed.io.id_checkpoint import write_id_tables
from sparse_embed.io.id_tables import check_id_maps
from sparse_embed.io.orbax_items import item_handlers, read_info, read_user, write_step
from sparse_embed.io.restoring import restore_embeddings, restore_state, static_part  # noqa: F401 (re-exported)


_CALLS = {"checkpoint_save": itertools.count(), "checkpoint_restore": itertools.count()}  # exchange numbers


def _differences(plan: EmbeddingPlan, what: str, fields: dict[str, int]) -> list[str]:
    """Under `jax.distributed`: the `fields` (ints) that differ between the processes of the plan's mesh, each as
    "name {process: value}" (none with one process)."""
    processes = distributed.mesh_processes(plan.mesh)
    if len(processes) == 1:
        return []
    got = distributed.allgather_ints(processes, list(fields.values()), name=what, n=next(_CALLS[what]))
    return [f"{k} {dict(zip(processes, map(int, got[:, i])))}" for i, k in enumerate(fields)
            if (got[:, i] != got[0, i]).any()]


def _check_same_save(plan: EmbeddingPlan, step: int, force: bool, id_maps: Any, user: Any, data: Any) -> None:
    """Under `jax.distributed`: every process saves the same step, with the same items, or all raise naming the
    difference (another step wrote another staging directory, and the save failed on one process with a missing
    file and on the others with a gloo timeout; `data` on one process only restored its state on every one)."""
    differ = _differences(plan, "checkpoint_save", {
        "step": step, "force": int(force), "id_maps": int(id_maps is not None), "user": int(user is not None),
        "data": int(data is not None)})
    if differ:
        raise ValueError(f"CheckpointManager.save: the processes called it differently ({'; '.join(differ)}, by "
                         "process; id_maps, user, data: 1 if passed): every process must save the same step with "
                         "the same items (each its own data).")


def _check_same_restore(plan: EmbeddingPlan, step_dir: str, step: int, user: Any) -> None:
    """Under `jax.distributed`: every process restores the same step (and user pytree or none), or all raise
    saying so (each read its own rows of its own step, and the checksums summed over the processes matched
    neither: both steps were reported corrupt)."""
    differ = _differences(plan, "checkpoint_restore", {"step": step, "user": int(user is not None)})
    if differ:
        raise ValueError(f"CheckpointManager.restore: the processes restore differently ({'; '.join(differ)}, by "
                         f"process; user: 1 if passed), here {step_dir}: every process must restore the same "
                         "step, with the same items.")


class Restored(NamedTuple):
    """What `CheckpointManager.restore` returns."""

    tables: dict[str, EmbeddingVariables]
    step: int
    user: Any
    id_maps: dict[str, Any] = {}  # the raw-id tables' maps (`IdMap`), placed for the plan
    data: Any = None  # the input pipeline's state saved with the step (`save(..., data=)`), or None


def _check_options(max_to_keep: Any, save_interval_steps: Any) -> None:
    """Raises unless `max_to_keep` is None or an integer >= 1 and `save_interval_steps` an integer >= 1."""
    for name, value, meaning in (("max_to_keep", max_to_keep, "the newest steps kept; None keeps every step"),
                                 ("save_interval_steps", save_interval_steps, "save every this many steps")):
        if value is None and name == "max_to_keep":
            continue
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"CheckpointManager: {name} must be an integer >= 1 ({meaning}), got {value!r} "
                            f"({type(value).__name__}).")
        if value < 1:
            raise ValueError(f"CheckpointManager: {name} must be >= 1 ({meaning}), got {value}.")


def _check_directory(directory: str) -> None:
    """Raises a CheckpointError if `directory` is a file or one step of a checkpoint (orbax raised a bare
    NotADirectoryError for a file; a step directory had "No complete checkpoint", and a save nested steps in it)."""
    if os.path.isfile(directory):
        raise CheckpointError(f"{directory} is a file, not a checkpoint directory: pass the directory of the "
                              "checkpoint's steps (a new one to start one).")
    if os.path.isdir(os.path.join(directory, META)):
        raise CheckpointError(f"{directory} is one checkpoint step (it has a '{META}' item), not the directory of a "
                              "CheckpointManager: open the directory above it, or read this step with "
                              "se.restore_embeddings (or se.load_serving, a serving export).")


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
        _check_options(max_to_keep, save_interval_steps)
        self.directory = os.path.abspath(os.fspath(directory))
        _check_directory(self.directory)
        self._options = dict(
            save_interval_steps=int(save_interval_steps),
            preservation_policy=ocp.checkpoint_managers.LatestN(None if max_to_keep is None else int(max_to_keep)),
            enable_async_checkpointing=async_save,
            create=True,
        )
        # Leftovers of a killed save (orbax's temporary steps, our staged tables) are removed at this manager's
        # first save, not when it opens: a manager opened only to restore (an evaluation job beside the
        # training) would remove the temporary step of a save in flight in the training's manager, losing it.
        self._manager, self._cleaned = self._orbax(cleanup=False), False
        self._closed = False

    def _orbax(self, cleanup: bool) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(cleanup_tmp_directories=cleanup, **self._options)
        return ocp.CheckpointManager(self.directory, options=options, item_handlers=item_handlers(write=True))

    def _clean_leftovers(self) -> None:
        """Before the first save: a manager that removes orbax's leftover temporary steps (awaited by its save),
        and the tables staged by a save that was killed."""
        if self._cleaned:
            return
        self._manager.close()
        self._manager, self._cleaned = self._orbax(cleanup=True), True
        if jax.process_index() == 0:
            for name in os.listdir(self.directory):
                if name.startswith(STAGING):
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def save(self, step: int, plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables], *,
             id_maps: Mapping[str, Any] | None = None, user: Any = None, data: Any = None,
             force: bool = False, tiers: Any = None) -> bool:
        """Saves `step` (an integer) and returns True; or skips it, returning False and writing nothing.

        Skipped without `force`: a step `save_interval_steps` leaves out, and a step not after the latest saved
        one (already saved, or older): a saved step is never overwritten, so check the result if it may
        exist. With `force`, `save_interval_steps` is ignored and a step not after the latest is a ValueError.

        The tables are streamed to disk before this returns (so `tables` may
        be donated or updated right after); the user pytree and the metadata
        are written in the background (`wait()`). A plan with raw-id tables
        needs their `id_maps` (saved with them, in id order). `data`: this
        process's input-pipeline state, JSON-serialisable (`se.data.Loader.get_state()`:
        the data position and the plan's capacity marks), for an exact resume.
        """
        step = as_step(step, "CheckpointManager.save: step")
        if step < 0:
            raise ValueError(f"CheckpointManager.save: step must be >= 0, got {step}.")
        if self._closed:  # orbax's closed manager would wait forever on the save's background thread
            raise RuntimeError(f"CheckpointManager.save: the manager of {self.directory} is closed (close(), or the "
                               "end of its `with` block); open a new one to save (restores still work).")
        _check_same_save(plan, step, force, id_maps, user, data)
        if data is not None:  # before the offloaded tables' stores are flushed, or anything is written
            check_serialisable(data)
        # offloaded tables: their `tiers`, flushed at `step` (each store's commit is recorded, docs/offload.md)
        plan, tables, commits = offload_checkpoint.for_save(plan, tables, tiers, step)
        if force:
            self._check_after_latest(step)
        elif not self._manager.should_save(step):
            return False
        check_state(plan, tables)  # (it takes tables without slots: they look up, for eval)
        slotless = [s for s in plan.stacks if s.slot_widths() and not tables[s.name].slots]
        if slotless:  # else a step whose metadata lists slots it does not hold: every restore called it corrupt
            s = slotless[0]
            raise ValueError(f"CheckpointManager.save: stack {s.name!r} has no optimizer slots (tables made with "
                             f"with_slots=False), and a training checkpoint keeps its {type(s.optimizer).__name__} "
                             f"slots {sorted(s.slot_widths())}: save the training tables, or write these for serving "
                             "with se.export_serving.")
        static = static_part(plan)
        if len(static.stacks) != len(plan.stacks) and id_maps is None:
            raw = sorted(set(plan.stack_names) - set(static.stack_names))
            raise ValueError(f"The plan has raw-id tables {raw}: pass their maps, save(..., id_maps=id_maps).")
        if id_maps is not None:
            check_id_maps(plan, id_maps)  # before anything is written

        self._clean_leftovers()

        def write(d: str) -> dict[str, str]:
            sums = store.write_state(d, static, tables)
            offload_checkpoint.write_commits(d, commits)
            return sums if id_maps is None else {**sums, **write_id_tables(d, plan, tables, id_maps)}

        info = training_info(plan, step, user is not None, None, None if user is None else user_checksums(user))
        return write_step(lambda items: self._manager.save(step, args=ocp.args.Composite(**items), force=force),
                          os.path.join(self.directory, f"{STAGING}-{step}"), write, info, user, data)

    def _check_after_latest(self, step: int) -> None:
        """Raises unless `step` is after the latest saved step (orbax neither overwrites a step nor orders an
        older one after it)."""
        latest = self._manager.latest_step()
        if latest is not None and step <= latest:
            what = "is already saved" if step in self._manager.all_steps() else "is before the latest saved step"
            raise ValueError(f"CheckpointManager.save(force=True): step {step} {what} in {self.directory} (latest: "
                             f"step {latest}); steps are saved in increasing order and never overwritten: save a step "
                             f"after {latest}, or into another directory.")

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
        step = self.latest_step() if step is None else as_step(step, "CheckpointManager: step")
        if step is None:
            raise CheckpointError(f"No complete checkpoint in {self.directory}.")
        return resolve(self.directory, step)

    def restore(self, plan: EmbeddingPlan, *, step: int | None = None, user: Any = None,
                allow_vocab_growth: bool = False, rng: jax.Array | None = None, data: bool = True) -> Restored:
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
          data: False leaves the input position saved with `data=` out (`Restored.data` None): the one way
            to restore onto another process count a step whose processes each saved their own position.

        Saves of this manager still in progress are waited for first (a step
        just saved is restored, not reported missing).
        """
        self.wait()  # a save of this manager still in progress is part of what there is to restore
        kwargs = dict(user=user, allow_vocab_growth=allow_vocab_growth, rng=rng, data=data)
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
                 rng: jax.Array | None, data: bool) -> Restored:
        info = read_info(step_dir)
        _check_same_restore(plan, step_dir, int(info.step), user)
        memory = offload_checkpoint.memory_plan(plan, step_dir, info.table_names)
        tables, maps = restore_state(memory, step_dir, allow_vocab_growth=allow_vocab_growth, rng=rng)
        # offloaded tables: each store made the step's commit again; their caches come back empty (docs/offload.md)
        tables.update(offload_checkpoint.restore_stores(plan, step_dir))
        return Restored(tables, int(info.step), None if user is None else read_user(step_dir, info, user), maps,
                        read_data(step_dir, info.has_data) if data else None)

    def close(self) -> None:
        """Waits for pending saves and releases the manager (saving after it is an error; restoring works)."""
        # orbax's close() does not wait for the removal of leftover temporary directories that opening its manager
        # started (the manager of our first save, `_clean_leftovers`; only a save waits): a program that exited
        # right after printed an ERROR traceback ("cannot schedule new futures after interpreter shutdown")
        try:
            getattr(self._manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()
        except OSError:  # orbax logged it (e.g. the temporary step of another manager's save): not this one's failure
            pass
        self._manager.close()
        self._closed = True

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

