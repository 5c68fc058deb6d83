"""Which stacks run on TPU SparseCores, and how many SparseCores a device has. No jax-tpu-embedding needed.

A plan with `sparsecores=S > 0` (SparseCores per device; detected on TPU)
lays each stack the primitives can run out for them as jax-tpu-embedding
does (`planning`, and the "row" placement over every SparseCore): rows
MOD-sharded over every SparseCore, each table rotated, each device's block
its S SparseCores' shards (every table padded to a multiple of
`8 * S * devices` rows); each device's output rows one slice per SparseCore.

The primitives compute `gain * row` sums and one update per touched row
through a per-row function (ours, traced: `Optimizer.update` on one row,
with the non-finite skip as a select), so every elementwise optimizer and
option maps onto them. What they cannot run falls back to the usual kernels
for that stack, with one warning per `plan()` call that names the stack and
the reason (`warn_fallbacks`).
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Mapping, Sequence

import numpy as np

from sparse_embed.core import placements
from sparse_embed.core.specs import TableSpec

# SparseCores per TPU chip by `device_kind` (jax-tpu-embedding's table; other TPUs have none).
SPARSECORES_PER_DEVICE = {"TPU v5": 4, "TPU v5p": 4, "TPU v6 lite": 2, "TPU7x": 2}


def detect(devices: Sequence) -> int:
    """SparseCores per device of a mesh's devices: 0 unless they are TPUs that have them."""
    first = devices[0]
    if first.platform != "tpu":
        return 0
    return SPARSECORES_PER_DEVICE.get(getattr(first, "device_kind", ""), 0)


def available() -> bool:
    """True if jax-tpu-embedding (the primitives) is installed: `pip install jax-tpu-embedding`."""
    return importlib.util.find_spec("jax_tpu_embedding") is not None


def count(sparsecores: int | None, devices: Sequence) -> int:
    """The SparseCores per device a plan uses: `sparsecores` (checked), or detected (None).

    Detected SparseCores without jax-tpu-embedding installed are not used (a warning says so).
    """
    if sparsecores is None:
        found = detect(devices)
        if found and not available():
            warnings.warn(f"These TPUs have {found} SparseCores per device, but jax-tpu-embedding is not "
                          "installed, so every stack runs on the TensorCores: pip install jax-tpu-embedding.",
                          stacklevel=3)
            return 0
        return found
    if isinstance(sparsecores, bool) or not isinstance(sparsecores, (int, np.integer)) or sparsecores < 0:
        raise ValueError(f"sparsecores must be an int >= 0 (SparseCores per device; 0 = none), "
                         f"got {sparsecores!r}.")
    sparsecores = int(sparsecores)  # (a numpy int, e.g. computed from a mesh shape, is an int too)
    if sparsecores and not available():
        raise ImportError(f"plan(sparsecores={sparsecores}) needs jax-tpu-embedding: "
                          "pip install jax-tpu-embedding.")
    return sparsecores


def unsupported(tables: Sequence[TableSpec], placement: str, sparsecores: int = 1,
                rows: Mapping[str, int] | None = None, num_shards: int = 1) -> str | None:
    """Why the SparseCore primitives cannot run a stack of `tables` (None if they can).

    `rows`: each feature's output rows per device (samples, or sample-positions), which the device's
    `sparsecores` slices share evenly. `num_shards`: the devices that share the stack's rows.
    """
    t = tables[0]
    opt = t.resolved_optimizer
    if not placements.get(placement).sparsecores:
        which = ", ".join(repr(n) for n in placements.names() if placements.get(n).sparsecores)
        return f"it is placed {placement!r}; SparseCores shard rows (placement {which})"
    if t.dynamic is not None:
        return "its table is keyed by raw ids (dynamic=)"
    if t.max_norm is not None:
        return "max_norm needs the looked-up rows before pooling, which the primitives do not expose"
    if str(t.dtype) != "float32":
        return f"its dtype is {t.dtype}; the primitives take float32 tables"
    if t.embedding_dim % 8:
        return f"its dim {t.embedding_dim} is not a multiple of 8 (the SparseCore row tiling)"
    narrow = sorted(k for k, s in opt.slots(t.embedding_dim).items() if s.width != t.embedding_dim)
    if narrow:
        return (f"{type(opt).__name__} keeps slots {narrow} narrower than a row; the primitives keep every "
                "slot as wide as the table")
    if not opt.elementwise:
        return f"{type(opt).__name__} is a user rule; the primitives' per-row computation is traced from built-in rules"
    uneven = sorted(f for f, n in (rows or {}).items() if n % sparsecores)
    if uneven:
        return (f"features {uneven} have per-device rows (batch / devices, times the sequence length) that are not "
                f"a multiple of its {sparsecores} SparseCores per device, which each take an equal slice")
    n = num_shards * sparsecores
    if n & (n - 1):  # jax-tpu-embedding's input preprocessing refuses (aborts) such a count: never run on one
        return (f"its {num_shards} devices x {sparsecores} SparseCores = {n} SparseCores are not a power of 2, "
                "which jax-tpu-embedding's input format requires")
    return None


def resolve(tables: Sequence[TableSpec], placement: str, sparsecores: int,
            rows: Mapping[str, int] | None = None, num_shards: int = 1) -> int:
    """The SparseCores a stack of `tables` runs on: `sparsecores`, or 0 if they cannot run it (`unsupported`)."""
    if not sparsecores or unsupported(tables, placement, sparsecores, rows, num_shards):
        return 0
    return sparsecores


def _why_not(stack, sparsecores: int) -> str | None:
    """`unsupported` of a planned stack (a `StackPlan`)."""
    rows = {lay.feature.name: lay.rows_per_device for lay in stack.features}
    return unsupported([p.table for p in stack.tables], stack.placement, sparsecores, rows, stack.num_shards)


def warn_fallbacks(stacks: Sequence, sparsecores: int) -> None:
    """One warning per planned stack (`StackPlan`) that runs on the usual kernels although the plan has
    `sparsecores`, naming the reason. `plan()` calls it once, for the stacks it returns."""
    if not sparsecores:
        return
    for s in stacks:
        why = None if s.sparsecores else _why_not(s, sparsecores)
        if why:
            warnings.warn(f"Stack {s.name!r} runs on the usual kernels, not on SparseCores: {why}.", stacklevel=3)
