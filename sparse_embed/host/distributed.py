"""Multi-process (multi-host) support: which rows a process feeds, and agreeing on numbers.

Under `jax.distributed` every process runs the same training script.
`preprocess` then works per process: a process passes only the rows of its
own devices (see `local_positions` / `process_rows`) and the batch arrays are
assembled into global arrays. Everything that decides a *shape* (the auto
capacity) or whether a step runs at all (overflow errors, bad input) must be
decided identically on every process, or the collectives of the train step
would deadlock; `allgather_ints` is how the processes agree.

`allgather_ints` goes through the key-value store of the `jax.distributed`
coordination service, not through a device program: it never interleaves
with the train step's collectives (so `preprocess` may run in a background
thread), needs no compilation, and ends with an error instead of hanging forever
when another process has died or stopped feeding batches: after
`EXCHANGE_TIMEOUT_S` (600 s; `$SPARSE_EMBED_EXCHANGE_TIMEOUT_S` sets it),
unless jax's own heartbeat ends a process first. Exchanges are matched by a name and a
count that the caller keeps (`plan_state`): every process must call
`preprocess` for a plan the same number of times, in the same order (as a
training loop does).

The coordination service's client is reached through `jax._src`: jax
(0.10) has no public key-value API, and a device collective could interleave
with the train step's collectives when `preprocess` runs on a prefetch
thread.
"""

from __future__ import annotations

import os
import zlib
from typing import Any, Sequence

import jax
import numpy as np

# how long a process waits for the others' numbers (a step's preprocessing: long enough for a slow input)
EXCHANGE_TIMEOUT_S = float(os.environ.get("SPARSE_EMBED_EXCHANGE_TIMEOUT_S", 600))


def mesh_processes(mesh) -> tuple[int, ...]:
    """The sorted process indices that own devices of `mesh`."""
    return tuple(sorted({int(d.process_index) for d in np.asarray(mesh.devices).flat}))


def spans_processes(plan) -> bool:
    """True if the plan's mesh has devices of more than one process."""
    return len(mesh_processes(plan.mesh)) > 1


def local_positions(plan) -> list[int]:
    """Positions along the plan's axis (= device indices of the batch) that hold this process's devices.

    The process feeds the rows of these positions, in this order: for a
    feature with global batch B over D positions, position d owns rows
    `[d * B // D, (d + 1) * B // D)`.
    """
    devices = np.asarray(plan.mesh.devices)
    axis = plan.mesh.axis_names.index(plan.axis_name)
    me = jax.process_index()
    moved = np.moveaxis(devices, axis, 0).reshape(devices.shape[axis], -1)
    return [d for d in range(moved.shape[0]) if any(dev.process_index == me for dev in moved[d])]


def process_rows(plan, feature: str) -> slice:
    """The slice of `feature`'s global batch rows this process passes to `preprocess`.

    Only valid when the process's positions are contiguous (as they are for
    a mesh built from `jax.devices()` in order); raises otherwise.
    """
    if not isinstance(feature, str) or feature not in plan.features:
        raise ValueError(f"process_rows: feature must name one of the plan's features {sorted(plan.features)}, got "
                         f"{feature!r} (process_slice cuts a whole {{feature: ids}} batch).")
    pos = local_positions(plan)
    if pos != list(range(pos[0], pos[0] + len(pos))):
        raise ValueError(f"This process's devices sit at non-contiguous mesh positions {pos}; "
                         "feed the rows of each position in that order.")
    spd = plan.features[feature].batch_size // plan.num_shards
    return slice(pos[0] * spd, (pos[-1] + 1) * spd)


def process_slice(plan, ids: dict[str, Any]) -> dict[str, Any]:
    """Cuts a *global* batch `{feature: ids}` down to this process's rows (dense, list or (values, lengths)).

    A convenience for tests and for input pipelines that read the whole
    batch; a real multi-host pipeline should read only its own rows.
    """
    out = {}
    for name, x in ids.items():
        rows = process_rows(plan, name)
        if isinstance(x, tuple):
            values, lengths = np.asarray(x[0]), np.asarray(x[1])
            starts = np.concatenate([[0], np.cumsum(lengths)])
            out[name] = (values[starts[rows.start]:starts[rows.stop]], lengths[rows])
        else:
            out[name] = x[rows]
    return out


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("The plan's mesh spans several processes but jax.distributed is not initialised; "
                           "call jax.distributed.initialize() first.")
    return client


def allgather_ints(processes: Sequence[int], values: Sequence[int], *, name: str, n: int,
                   timeout_s: float | None = None) -> np.ndarray:
    """`[len(processes), len(values)]` int64: every listed process's `values`, in process order.

    Exchange `n` (0, 1, ...) of the series `name`: every process in
    `processes` must make the same exchanges, in the same order, with
    equally long `values`. Raises RuntimeError if another process does not
    answer within `timeout_s` (default `EXCHANGE_TIMEOUT_S`).
    """
    texts = allgather_bytes(processes, ",".join(str(int(v)) for v in values).encode(), name=name, n=n,
                            timeout_s=timeout_s)
    rows = [[int(v) for v in t.decode().split(",")] if t else [] for t in texts]
    if len({len(r) for r in rows}) != 1:
        raise RuntimeError(f"Processes {tuple(processes)} exchanged numbers of different lengths "
                           f"{[len(r) for r in rows]}: they called preprocess with different plans or in a "
                           "different order.")
    return np.asarray(rows, np.int64).reshape(len(rows), -1)


def allgather_bytes(processes: Sequence[int], data: bytes, *, name: str, n: int,
                    timeout_s: float | None = None) -> list[bytes]:
    """Every listed process's `data`, in process order: exchange `n` of the series `name` (as `allgather_ints`)."""
    processes = tuple(int(p) for p in processes)
    me = jax.process_index()
    if me not in processes:
        raise ValueError(f"Process {me} is not one of {processes}.")
    client = _client()
    group = f"{zlib.crc32(','.join(map(str, processes)).encode()):08x}"
    prefix = f"sparse_embed/allgather/{group}/{name}/"
    client.key_value_set_bytes(f"{prefix}{n}/{me}", bytes(data))
    timeout_ms = int(1000 * (EXCHANGE_TIMEOUT_S if timeout_s is None else timeout_s))
    out = []
    for p in processes:
        try:
            out.append(bytes(client.blocking_key_value_get_bytes(f"{prefix}{n}/{p}", timeout_ms)))
        except Exception as e:  # noqa: BLE001 - the runtime's error types are not public
            raise RuntimeError(
                f"Process {me}: process {p} did not send its numbers for {name!r} (exchange #{n}) within "
                f"{timeout_ms / 1000:g} s ({type(e).__name__}: {e}). Every process must call preprocess for "
                "the plan the same number of times, in the same order: did another process fail, or its input "
                "end before this one's (every process must feed as many batches)?"
            ) from None
    if n > 0:  # every process has read exchange n-1 (it wrote exchange n after that): drop ours
        client.key_value_delete(f"{prefix}{n - 1}/{me}")
    return out
