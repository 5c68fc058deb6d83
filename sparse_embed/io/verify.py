"""`verify_checkpoint`: reads every stored array of a step and checks it against its checksum."""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Iterable

from sparse_embed.core.relayout import TABLE_KEY
from sparse_embed.io.ckpt_format import CheckpointError, CorruptCheckpointError, resolve
from sparse_embed.io.orbax_items import read_info, read_user_host
from sparse_embed.io.restoring import read_host_array
from sparse_embed.io.id_checkpoint import RAW_KEYS, raw_arrays
from sparse_embed.io.convert import read_tables
from sparse_embed.io.data_item import DATA, check_data


@dataclasses.dataclass(frozen=True)
class Verification:
    """What `verify_checkpoint` found: the step directory, how many arrays it checked, and the problems."""

    step_dir: str
    checked: int
    problems: tuple[str, ...]
    verified: bool  # False: written before checksums; the arrays were only read

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(path: str | os.PathLike, *, step: int | None = None,
                      progress: Callable[[Iterable], Iterable] | None = None) -> Verification:
    """Reads every table, slot and user leaf of a step (default: the latest) and checks their checksums.

    One array at a time, on one device, so memory stays at the largest array.
    Every array is checked even after a problem is found. `progress` wraps
    the iteration over arrays (e.g. `tqdm`). Raises CheckpointError only if
    the step cannot be found.
    """
    step_dir = os.fspath(path)
    try:
        step_dir = resolve(path, step, complete=False)  # the latest step, damaged or not
        info = read_info(step_dir)
    except CorruptCheckpointError as e:  # its metadata is missing or damaged: no array can be checked
        return Verification(step_dir, 0, (str(e),), True)
    progress = progress or (lambda it, **_: it)
    problems, checked = [], 0
    raw = len(RAW_KEYS) if info.kind == "training" else 1
    data = info.has_data or os.path.isdir(os.path.join(step_dir, DATA))  # (before has_data: the item is there)
    total = sum(1 + len(r.slots) + (raw if r.dynamic else 0) for r in info.tables) + info.has_user + data
    arrays = _each_array(step_dir, info, data)
    for problem in progress(arrays, total=total, unit="array"):
        checked += 1
        if problem:
            problems.append(problem)
    return Verification(step_dir, checked, tuple(problems), info.verified)


def _each_array(step_dir: str, info, data: bool) -> Iterable[str | None]:
    """Reads the arrays one by one; yields None for a good one, the problem for a bad one."""
    for rec in info.tables:
        for key in [TABLE_KEY, *(k for k, _ in rec.slots)]:
            try:
                next(read_tables(step_dir, dataclasses.replace(info, tables=(rec,)), [key]))
            except CheckpointError as e:
                yield str(e)
            else:
                yield None
        if rec.dynamic:  # its ids, last-use steps, seed and waiting ids
            try:
                for _ in raw_arrays(lambda g, k: read_host_array(step_dir, info, g, k), rec.name,
                                    info.kind != "training"):
                    yield None
            except CheckpointError as e:
                yield str(e)
    if info.has_user:
        try:
            read_user_host(step_dir, info)
        except CheckpointError as e:
            yield str(e)
        else:
            yield None
    if data:
        try:
            check_data(step_dir, info.has_data)
        except CheckpointError as e:
            yield str(e)
        else:
            yield None
