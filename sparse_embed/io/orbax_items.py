"""The orbax side of a step: its item handlers, writing a step, and reading `meta` and the user pytree."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import warnings
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from sparse_embed.io.data_item import DATA, DataHandler, DataSave
from sparse_embed.io.checks import leaf_key, leaf_meanings, user_checksums, verify_user
from sparse_embed.io.ckpt_format import (
    EMBEDDINGS, META, USER, WHAT_TO_DO, CheckpointError, CheckpointInfo, CorruptCheckpointError, first_line, resolve,
)


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

    The user pytree's options (compared with benchmarks/checkpoint.py):

    - no zstd: float tables hardly compress (only untrained, constant slots shrink a lot), so it would
      slow saving and restoring for little space;
    - no OCDBT: its per-process database is merged after the write, which copies the data a second time.
      Checkpoints written with OCDBT still restore;
    - a replicated array whose piece per replica would be below `REPLICA_PARALLEL_MIN_BYTES` is written by
      its first replica: orbax's replica-parallel writing slices it into one piece per device, each a program
      of its own, compiled at the first save of every process (a demo's 9 dense leaves on 4 devices: 36
      programs, ~1.5 s); for pieces that small one writer is as fast.
    """
    arrays = lambda: ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=False,  # noqa: E731
                                                 type_handler_registry=_user_types())
    return {EMBEDDINGS: _MoveInHandler() if write else arrays(), USER: arrays(), META: ocp.JsonCheckpointHandler(),
            DATA: DataHandler()}


REPLICA_PARALLEL_MIN_BYTES = 4 << 20


class _NoOcdbtMergeNotice(logging.Filter):
    """orbax's save ends by merging per-process OCDBT files whatever the handler writes, and warns at every save
    that it found none: the items here are written without OCDBT (`item_handlers`), so that warning says nothing.
    It, and only it, is dropped from absl's logger (orbax logs through absl), for the whole process: orbax logs it
    for any save that had nothing to merge, and merges nothing then either."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.pathname.endswith("ocdbt_utils.py") and
                    str(record.msg).startswith("[process=%s][thread=%s] Skipping merge of OCDBT checkpoints"))


logging.getLogger("absl").addFilter(_NoOcdbtMergeNotice())


def _user_types() -> ocp.type_handlers.TypeHandlerRegistry:
    """orbax's standard type handlers, jax.Array's with `REPLICA_PARALLEL_MIN_BYTES` (see `item_handlers`)."""
    from orbax.checkpoint._src.metadata import array_metadata_store  # the store orbax's own ArrayHandler keeps

    array = ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_BYTES,
                                           array_metadata_store=array_metadata_store.Store())
    return ocp.type_handlers.create_type_handler_registry(*(
        (t, array if t is jax.Array else ocp.type_handlers.get_type_handler(t))
        for t in ocp.type_handlers.supported_types()))


def checkpointer(*, write: bool = False) -> ocp.Checkpointer:
    """An orbax checkpointer of the composite items a step directory holds."""
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler(**item_handlers(write=write)))


def _check_saveable(user: Any) -> None:
    """Refuses, before anything is written, the user leaves orbax would refuse after starting the step (leaving its
    temporary directory behind): leaves of size 0, and types it has no working handler for (a `np.bool_` scalar, a
    complex number, bytes, any other object), and an empty one (`{}`, `[]`: orbax's "Found empty item")."""
    leaves = jax.tree_util.tree_leaves_with_path(user)
    if user is not None and not leaves and not user:
        raise ValueError(f"The user pytree is empty ({user!r}), which orbax cannot save; pass user=None to save none.")
    empty = [leaf_key(p) for p, x in leaves if getattr(x, "size", 1) == 0]
    if empty:
        raise ValueError(f"The user pytree has leaves of size 0 {empty}, which orbax cannot save; leave them out "
                         "(or give them a size).")
    unknown = [f"{leaf_key(p)!r} ({type(x).__module__}.{type(x).__qualname__})" for p, x in leaves
               if not _saveable(x)]
    if unknown:
        raise TypeError(f"The user pytree has leaves orbax cannot save: {', '.join(unknown)}; it saves arrays, "
                        "numbers and strings: convert them (e.g. np.asarray), or leave them out.")


def _saveable(x: Any) -> bool:
    """Whether orbax has a working handler for a leaf: bytes have one listed, whose write then fails in
    tensorstore ("bytes16"), in the background."""
    try:
        ocp.type_handlers.get_type_handler(type(x))
    except ValueError:
        return False
    return not isinstance(x, bytes)


def write_step(save: Callable[[dict], Any], staging: str, write_tables: Callable[[str], dict[str, str]],
               info: CheckpointInfo, user: Any = None, data: Any = None) -> Any:
    """Writes the tables into `staging` (`write_tables(dir) -> checksums`), then `save(items)` with orbax.

    `data`: this process's input-pipeline state (JSON), the `data` item (`io.data_item`).

    The staging directory is removed if anything fails.
    """
    _check_saveable(user)
    try:
        if jax.process_index() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        # (a converted step keeps its source's: `io.convert` copies the data item in after)
        info = dataclasses.replace(info, checksums=write_tables(staging), has_data=data is not None or info.has_data)
        items = {EMBEDDINGS: StagedSave(staging), META: ocp.args.JsonSave(info.to_json())}
        if user is not None:
            items[USER] = ocp.args.PyTreeSave(user)
        if data is not None:
            items[DATA] = DataSave(data)
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
        raise CorruptCheckpointError(f"{step_dir}: cannot read its metadata ({type(e).__name__}: {first_line(e)}); "
                                     f"{WHAT_TO_DO}.") from None
    return CheckpointInfo.from_json(d, step_dir)


def read_user(step_dir: str, info: CheckpointInfo, target: Any) -> Any:
    """The user pytree of a step, restored into `target`'s structure and shardings, verified."""
    if not info.has_user:
        raise CheckpointError(f"{step_dir} has no user pytree; call restore without user=.")
    # a numpy scalar leaf (np.int32(4)) saves as a 0-d array, but orbax takes no numpy scalar as a target
    target = jax.tree.map(lambda x: np.asarray(x) if isinstance(x, np.generic) else x, target)
    saved = {k: v.split(" ", 1)[1] for k, v in (info.user_checksums or {}).items()}  # "dtype shape"
    shapes = lambda meanings: {k: m.split(" ", 1)[1] for k, m in meanings.items()}  # noqa: E731
    # a target of the saved record's leaves and shapes is right: where orbax's metadata says otherwise, it is damaged
    # (the restore below reports that); else orbax's metadata names what the target gets wrong
    if not saved or shapes(leaf_meanings(target)) != shapes(saved):
        _check_target(step_dir, target)
    args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
    try:
        user = checkpointer().restore(step_dir, args=ocp.args.Composite(**{USER: args}))[USER]
    except Exception as e:  # noqa: BLE001
        if saved and saved == leaf_meanings(target):  # the target fits what was saved: the stored data is damaged
            raise CorruptCheckpointError(f"{step_dir}: its user pytree cannot be read ({type(e).__name__}: "
                                         f"{first_line(e)}); {WHAT_TO_DO}.") from None
        raise CheckpointError(f"{step_dir}: its user pytree does not match the target given "
                              f"({type(e).__name__}: {first_line(e)}).") from None
    unchecked = verify_user(step_dir, info, user, target)
    if unchecked and info.verified:
        warnings.warn(f"{step_dir}: {unchecked} leaves of the user pytree were restored with another dtype or shape "
                      "than saved (as the target asked), so their checksums could not be checked.", stacklevel=3)
    return jax.tree.map(_placed_as, user, target)


def _placed_as(restored: Any, target: Any) -> Any:
    """A leaf restored for a target leaf never placed by the user (an uncommitted array: `jnp.zeros(())`, the step
    count of a fresh `tx.init`) comes back uncommitted too: orbax pins it to the target's one device, and the next
    jit that meets it beside arrays on a mesh fails on incompatible devices."""
    if not (isinstance(target, jax.Array) and not target.committed and isinstance(restored, jax.Array)):
        return restored
    if jax.dtypes.issubdtype(restored.dtype, jax.dtypes.prng_key):
        data = jax.numpy.asarray(np.asarray(jax.random.key_data(restored)))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(restored))
    return jax.numpy.asarray(np.asarray(restored))


def _check_target(step_dir: str, target: Any) -> None:
    """Refuses a target that is not the saved user pytree's structure, or that asks an array leaf in another shape
    than saved (orbax would hand back the saved shape, or fail deep inside its restore), naming the leaves; a dtype
    may differ (the leaf is cast). Metadata that cannot be read is left to the restore to report."""
    try:
        tree = _saved_user_tree(step_dir)
    except Exception:  # noqa: BLE001
        return
    def shape(x: Any) -> tuple | None:  # a Python number is a scalar; a string has none
        return () if isinstance(x, (bool, int, float, complex)) else getattr(x, "shape", None)

    saved, asked = ({leaf_key(p): shape(x) for p, x in jax.tree_util.tree_leaves_with_path(t)} for t in (tree, target))
    problems = []
    if missing := sorted(set(saved) - set(asked)):
        problems.append(f"its leaves {missing} are not in the target")
    if extra := sorted(set(asked) - set(saved)):
        problems.append(f"the target's leaves {extra} were not saved")
    problems += [f"{k!r} is {tuple(saved[k])} in the checkpoint, {tuple(asked[k])} in the target"
                 for k in sorted(set(saved) & set(asked))
                 if saved[k] is not None and asked[k] is not None and tuple(saved[k]) != tuple(asked[k])]
    if problems:
        raise CheckpointError(f"{step_dir}: its user pytree does not match the target given: {'; '.join(problems)}.")


def _saved_user_tree(step_dir: str) -> Any:
    """The user pytree's structure and array metadata as saved. Read by the item's handler itself: an
    `ocp.Checkpointer` over the item's directory looks there for a step's own metadata file, and logs "Metadata
    file does not exist" (as if the step were damaged) when it is not there."""
    return item_handlers()[USER].metadata(epath.Path(step_dir) / USER).tree


def read_user_host(step_dir: str, info: CheckpointInfo) -> Any:
    """The user pytree as saved, as numpy arrays on the host (no target needed), verified."""
    path = epath.Path(step_dir) / USER
    if not os.path.isdir(path):
        raise CorruptCheckpointError(f"{step_dir}: its '{USER}' item (the user pytree saved with it) is missing; "
                                     f"{WHAT_TO_DO}.")
    try:
        tree = _saved_user_tree(step_dir)
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        user = item_handlers()[USER].restore(path, args=ocp.args.PyTreeRestore(item=tree, restore_args=args))
    except Exception as e:  # noqa: BLE001
        raise CorruptCheckpointError(f"{step_dir}: its user pytree cannot be read ({type(e).__name__}: "
                                     f"{first_line(e)}); {WHAT_TO_DO}.") from None
    if verify_user(step_dir, info, user):  # read as stored: a leaf without a checksum was not saved
        raise CorruptCheckpointError(f"{step_dir}: the user pytree has leaves that were not saved; {WHAT_TO_DO}.")
    missing = sorted(set(info.user_checksums or ()) - set(user_checksums(user)))
    if missing:
        raise CorruptCheckpointError(f"{step_dir}: the user pytree's leaves {missing} are missing; {WHAT_TO_DO}.")
    return user
