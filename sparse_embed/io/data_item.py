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
from typing import Any

import jax
import orbax.checkpoint as ocp

from sparse_embed.io.ckpt_format import CheckpointError

DATA = "data"


def _name(index: int, count: int) -> str:
    return f"process_{index}-of-{count}.json"


class DataHandler(ocp.CheckpointHandler):
    """Writes this process's state into the item directory, reads it back (see the module docstring)."""

    def save(self, directory, args: "DataSave") -> None:
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, _name(jax.process_index(), jax.process_count()))
        with open(path + ".tmp", "w") as f:
            json.dump(args.state, f)
        os.replace(path + ".tmp", path)

    def restore(self, directory, args: "DataRestore | None" = None) -> Any:
        directory = os.fspath(directory)
        mine = os.path.join(directory, _name(jax.process_index(), jax.process_count()))
        if os.path.exists(mine):
            with open(mine) as f:
                return json.load(f)
        states = []
        for name in sorted(os.listdir(directory)):
            if name.endswith(".json"):
                with open(os.path.join(directory, name)) as f:
                    states.append(json.load(f))
        if states and all(s == states[0] for s in states):
            return states[0]
        raise CheckpointError(f"{directory}: the input state was saved by {len(states)} processes, each at its own "
                              f"position; restore it with as many processes (now {jax.process_count()}).")


@ocp.args.register_with_handler(DataHandler, for_save=True)
@dataclasses.dataclass
class DataSave(ocp.args.CheckpointArgs):
    state: Any  # JSON-serialisable


@ocp.args.register_with_handler(DataHandler, for_restore=True)
@dataclasses.dataclass
class DataRestore(ocp.args.CheckpointArgs):
    pass


def read_data(step_dir: str) -> Any:
    """This process's input state saved in a step, or None if the step holds none."""
    if not os.path.isdir(os.path.join(step_dir, DATA)):
        return None
    return DataHandler().restore(os.path.join(step_dir, DATA))
