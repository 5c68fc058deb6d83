"""A step's `data` item: each process's input-pipeline state (JSON), for an exact resume.

Each process writes its own file, `process_<i>-of-<n>.json` (grain's
checkpoint handler does the same): under `jax.distributed` each process
reads its own rows, so each has its own position. A restore reads this
process's file; with another number of processes, it reads the state
only if every process saved the same one (a position in a dataset that
every process walks alike), and otherwise says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from typing import Any

import jax
import orbax.checkpoint as ocp

from sparse_embed.io.ckpt_format import WHAT_TO_DO, CheckpointError, CorruptCheckpointError

DATA = "data"
_ENVELOPE = "sparse_embed.data"  # a file's format: {_ENVELOPE: 1, "state": ..., "crc32": ...} (before it: the state)


def _name(index: int, count: int) -> str:
    return f"process_{index}-of-{count}.json"


def _crc(state: Any) -> str:
    """The CRC32 of the state as it reads back (JSON once: tuples are lists, keys strings), keys sorted."""
    return f"{zlib.crc32(json.dumps(json.loads(json.dumps(state)), sort_keys=True).encode()):08x}"


def check_serialisable(state: Any) -> None:
    """TypeError naming `data=` unless `state` is JSON-serialisable; before a save writes anything (else `json`
    failed in orbax's background thread, after the tables were written, with its bare message and a half-made
    step left on disk)."""
    try:
        json.dumps(state)
    except (TypeError, ValueError) as e:
        raise TypeError(f"CheckpointManager.save: data must be JSON-serialisable (the input position, e.g. "
                        f"se.data.Loader.get_state(), alone or in your own dict or list): {e}; make numpy or jax "
                        "values Python ones (.item(), .tolist()).") from None


def _read(path: str, checked: bool = False) -> Any:
    """A process's saved state, checked against its CRC32 (files from before it: as they are, unless `checked`:
    the step's metadata says it was saved with one)."""
    try:
        with open(path) as f:
            got = json.load(f)
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{path}: the input position (the step's data item) cannot be read "
                                     f"({type(e).__name__}: {e}); {WHAT_TO_DO}.") from None
    if not (isinstance(got, dict) and _ENVELOPE in got) and not checked:
        return got
    if (not isinstance(got, dict) or got.get(_ENVELOPE) != 1 or "state" not in got
            or got.get("crc32") != _crc(got["state"])):
        raise CorruptCheckpointError(f"{path}: the input position (the step's data item) does not match the checksum "
                                     f"saved with it; {WHAT_TO_DO}.")
    return got["state"]


class DataHandler(ocp.CheckpointHandler):
    """Writes this process's state into the item directory, reads it back (see the module docstring)."""

    def save(self, directory, args: "DataSave") -> None:
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, _name(jax.process_index(), jax.process_count()))
        with open(path + ".tmp", "w") as f:
            json.dump({_ENVELOPE: 1, "state": args.state, "crc32": _crc(args.state)}, f)
        os.replace(path + ".tmp", path)

    def restore(self, directory, args: "DataRestore | None" = None) -> Any:
        directory, checked = os.fspath(directory), bool(args and args.checked)
        mine = os.path.join(directory, _name(jax.process_index(), jax.process_count()))
        if os.path.exists(mine):
            return _read(mine, checked)
        states = [_read(path, checked) for path in _files(directory)]
        if not states:
            raise _missing(directory)
        if all(s == states[0] for s in states):
            return states[0]
        raise CheckpointError(f"{directory}: the input state was saved by {len(states)} processes, each at its own "
                              f"position; restore it with as many processes (now {jax.process_count()}), or "
                              "without it: restore(..., data=False), and the input starts where you start it.")


@ocp.args.register_with_handler(DataHandler, for_save=True)
@dataclasses.dataclass
class DataSave(ocp.args.CheckpointArgs):
    state: Any  # JSON-serialisable


@ocp.args.register_with_handler(DataHandler, for_restore=True)
@dataclasses.dataclass
class DataRestore(ocp.args.CheckpointArgs):
    checked: bool = False  # the step's metadata says its files carry checksums (`_read`)


def read_data(step_dir: str, saved: bool = False) -> Any:
    """This process's input state saved in a step, or None if the step holds none (`saved`: its metadata says it
    saved one, so a missing item is damage, a CorruptCheckpointError)."""
    if not os.path.isdir(os.path.join(step_dir, DATA)):
        if saved:
            raise _missing(step_dir)
        return None
    return DataHandler().restore(os.path.join(step_dir, DATA), DataRestore(checked=saved))


def check_data(step_dir: str, saved: bool) -> None:
    """Reads every process's saved input position of a step (`sparse-embed verify`); CorruptCheckpointError if
    one is damaged, or none is there though the step (`saved`) has one."""
    paths = _files(os.path.join(step_dir, DATA))
    if saved and not paths:
        raise _missing(step_dir)
    for path in paths:
        _read(path, saved)


def _files(directory: str) -> list[str]:
    """Every process's file of a data item (none if the item is not there)."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".json")) if os.path.isdir(directory) else []
    return [os.path.join(directory, n) for n in names]


def _missing(where: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: the step saved an input position (its data item), which is missing; "
                                  f"{WHAT_TO_DO}.")
