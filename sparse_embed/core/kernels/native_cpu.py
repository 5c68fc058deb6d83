"""The native CPU kernel: the lookup's per-shard work in C++ (`_native_cpu.cc`), through XLA's typed FFI.

Forward: one pass over the received entries, in their order (each sample's
entries together), which gathers each row (prefetched ahead), clips it to
`max_norm`, scales it by its gain and adds it to its output row (in
registers for widths 16/32/64/128); the work is split over XLA's CPU
thread pool at output-row boundaries. With the view's `out_blocks` (one
block per feature) each block is a result of its own, and the backward
reads the gradients in the same blocks: no stacked copy either way.

Backward: the entries are sorted by table row (a radix sort, no scratch
array the size of the table), so the table is updated in address order,
a bucket of rows at a time on the thread that sorted the bucket (its
sorted entries still in that core's cache). Each distinct row is read,
updated with its slots and written once, in place on the donated table
and slots (`input_output_aliases`), one row at a time while the rows 32
ahead are prefetched. SGD applies each
occurrence on its own, as the generic kernel does; every other optimizer
sums the row's gradient first. Each row's arithmetic runs in a fixed order
on one thread, so results do not depend on the number of threads (nor on
the instruction set: the hot loops have AVX-512, AVX2 and baseline
versions with the same bits, see `isa`); they agree with the generic
kernel to about 1e-6 (bit for bit where the order of operations is the
same, e.g. the forward and an SGD update).

Raw-id tables (`id_maps`) look their ids up with `find_keys` and
`touch_keys` (`_native_keys.cc`): `key_set.find`'s search and
`key_set.touch`'s last-use update, bit for bit, with the queries first put
in bucket order (so the set is read from low addresses to high) and the
cache misses of 32 queries overlapped; grow them with `insert_keys`:
`key_set.insert`'s result, bit for bit, in place, in linear passes (the
generic version scatters over the whole set); and
deduplicate the ids a shard receives from several sources with
`unique_keys` (`key_set.unique`'s result by a radix sort).

The backward takes a token that the forward outputs after its reads, so
XLA orders the in-place writes after them without copying a table, with or
without `configure_xla_cpu()`. Each optimizer declares how it is encoded
(`Optimizer.native()`: its case in `update_row`, its constants and its
slots in order); one that declares none (`Custom`) runs on the generic
kernel. The extension is built by `pip install` when a C++ compiler and
jaxlib's FFI headers are there; without it, "auto" picks the generic kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
from types import ModuleType
from typing import Any, ClassVar, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparse_embed.core import key_set
from sparse_embed.core import optimizers as opt
from sparse_embed.core.kernels.base import KernelBase
from sparse_embed.core.kernels.interface import Forward, Received
from sparse_embed.core.planning import StackPlan
from sparse_embed.core.shadowed import shadow_note, warn_if_shadowed
from sparse_embed.core.state import EmbeddingVariables

_SKIP_NONFINITE, _CLIP_GRADIENT, _CLIP_WEIGHT, _LINEAR = 1, 2, 4, 8  # the C++ code's flags
_TARGET = "sparse_embed_{}"
HUGE_PAGES_ENV = "SPARSE_EMBED_HUGE_PAGES"  # "0": leave the tables on the pages XLA gave them


_MODULE, _WHAT = "core/kernels/_native_cpu", "C++ lookup kernel"  # for `shadowed`'s messages


@functools.cache
def _extension() -> ModuleType | None:
    try:
        return importlib.import_module("sparse_embed.core.kernels._native_cpu")
    except ImportError:
        warn_if_shadowed(_MODULE, _WHAT, "the lookup runs on the generic kernel")
        return None


@functools.cache
def _register() -> None:
    """Registers the FFI targets with XLA, once, on first use."""
    for name, capsule in _extension().handlers().items():
        jax.ffi.register_ffi_target(_TARGET.format(name), capsule, platform="cpu")


def available() -> bool:
    """Whether the C++ extension was built."""
    return _extension() is not None


@functools.cache
def can_leave_uninitialized() -> bool:
    """Whether the extension has the FFI target of `uninitialized` (a build older than it has not)."""
    return available() and "uninitialized" in _extension().handlers()


def uninitialized(shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Inside jit (per device: under shard_map): an array that XLA allocates and nothing writes, so its values
    are whatever the memory held. For a buffer that is then written whole on the host: a restore's state
    (`io.direct`). Needs `can_leave_uninitialized()`."""
    _register()  # (a side effect: XLA never merges two of them into one buffer)
    return jax.ffi.ffi_call(_TARGET.format("uninitialized"), jax.ShapeDtypeStruct(shape, dtype),
                            has_side_effect=True)()


ISA_ENV = "SPARSE_EMBED_NATIVE_ISA"  # "avx2" or "baseline": run the hot loops on no more than that


def isa() -> str | None:
    """The instruction set of the native kernel's hot loops in this process: "avx512", "avx2" or "baseline"
    (None: not built).

    The best the CPU has, chosen once per process; `$SPARSE_EMBED_NATIVE_ISA=avx2|baseline` caps it, and
    `capped_isa` caps it inside a block (the tests run each). Every choice computes the same values.
    """
    return None if _extension() is None else _extension().isa()


@contextlib.contextmanager
def capped_isa(isa: str) -> Iterator[str]:
    """Inside the block, the hot loops of this process run on no more than `isa` ("avx512", "avx2" or
    "baseline"), as `$SPARSE_EMBED_NATIVE_ISA` caps a process from its start: the tests run the kernels on each
    instruction set in one process. Yields the set they run on. Every set computes the same values."""
    ext = _extension()
    if ext is None:
        raise RuntimeError("the native CPU kernel is not built: no instruction set to cap.")
    try:
        yield ext.cap_isa(isa)
    finally:
        ext.cap_isa(None)


def native_cases() -> dict[str, int]:
    """The optimizer cases the built extension implements, `{case: code}` (empty when it is not built)."""
    return {} if _extension() is None else dict(_extension().optimizers())


def _encoding(o: opt.Optimizer) -> opt.NativeEncoding:
    """The optimizer's own declaration (`Optimizer.native`) of how this kernel encodes it."""
    enc = opt.native_encoding(o)
    assert enc is not None and enc.case in native_cases(), "unsupported() turns these away"
    return enc


def _scalars(o: opt.Optimizer, enc: opt.NativeEncoding, step) -> jax.Array:
    """The step's learning rate, then the optimizer's step-dependent factors: f32 `[k]`."""
    lr = o.learning_rate_at(step)
    if enc.step_factors is None:
        return lr[None]
    return jnp.stack([lr, *enc.step_factors(step, lr)]).astype(jnp.float32)


def _options(stack: StackPlan, enc: opt.NativeEncoding, skip_nonfinite: bool, linear: bool) -> dict:
    o = stack.optimizer
    lo_g, hi_g = o.clip_gradient or (0.0, 0.0)
    lo_w, hi_w = o.clip_weight or (0.0, 0.0)
    flags = ((_SKIP_NONFINITE if skip_nonfinite else 0) | (_CLIP_GRADIENT if o.clip_gradient else 0)
             | (_CLIP_WEIGHT if o.clip_weight else 0) | (_LINEAR if linear else 0))
    # the constants as the case reads them (see `update_row` in _native_cpu.cc); none: one unread 0 (an empty
    # array attribute is not allowed)
    hyper = np.asarray(enc.hyper or (0.0,), np.float32)
    return dict(optimizer=np.int64(native_cases()[enc.case]), flags=np.int64(flags),
                max_norm=np.float32(stack.max_norm or 0.0), hyper=hyper,
                options=np.asarray([lo_g, hi_g, o.weight_decay, lo_w, hi_w], np.float32))


@dataclasses.dataclass(frozen=True)
class NativeCpuKernel(KernelBase):
    """The C++ implementation on CPU (see the module docstring).

    Attributes:
      threads: how many threads a call uses at most, counting the calling
        one; 0 = as many as XLA's CPU thread pool has (one per core).
        Results are the same for every value.
      huge_pages: back the tables and slots with 2 MiB pages (Linux
        `madvise`), once per buffer, when a call sees the same buffer a third
        time (a donated table), and again for a new buffer at a freed one's
        address: far fewer TLB misses for the random rows of large tables.
        `$SPARSE_EMBED_HUGE_PAGES=0` turns it off for "auto" plans.
    """

    threads: int = 0
    huge_pages: bool = True
    name: ClassVar[str] = "native"

    def _attrs(self) -> dict:
        huge = self.huge_pages and os.environ.get(HUGE_PAGES_ENV) != "0"
        return dict(threads=np.int64(self.threads), huge_pages=np.int64(huge))

    def unsupported(self, stack: StackPlan) -> str | None:
        if not available():
            note = shadow_note(_MODULE, _WHAT)
            return ("its C++ extension is not built (pip install builds it when a C++ compiler and jaxlib's "
                    "headers are there" + (f"; {note}" if note else "") + ")")
        enc, name = opt.native_encoding(stack.optimizer), type(stack.optimizer).__name__
        if enc is None:
            return f"{name} optimizers run on the generic kernel"
        if enc.case not in native_cases():
            return f"{name} optimizers declare the native case {enc.case!r}, which this build of the extension lacks"
        if stack.row_sums():
            return ("its rows are split by columns and it needs statistics of whole rows (max_norm or a row-wise "
                    "optimizer), which the generic kernel sums across devices")
        if stack.dtype not in (jnp.float32, jnp.bfloat16):
            return f"its tables are {stack.dtype}, not float32 or bfloat16"
        return None

    def forward(self, stack: StackPlan, rec: Received, table: jax.Array) -> Forward:
        _register()
        D, dim = stack.num_shards, stack.embedding_dim
        blocks = stack.out_blocks or (stack.rows_per_device,)  # the output rows, in one array or in blocks
        out = [jax.ShapeDtypeStruct((1,), jnp.float32), *(jax.ShapeDtypeStruct((D, n, dim), jnp.float32)
                                                          for n in blocks)]
        token, *partials = jax.ffi.ffi_call(_TARGET.format("forward"), out)(
            table, rec.col_ids, rec.row_ids, rec.values,
            max_norm=np.float32(stack.max_norm or 0.0), **self._attrs())
        # the token orders the backward's writes after these reads
        return Forward(tuple(partials) if stack.out_blocks else partials[0], table, token)

    def backward(self, stack: StackPlan, rec: Received, saved, variables: EmbeddingVariables, grads: Any,
                 step, skip_nonfinite: bool) -> EmbeddingVariables:
        _register()
        o = stack.optimizer
        enc = _encoding(o)
        linear = o.is_linear and stack.max_norm is None and variables.table.dtype == jnp.float32
        state = [variables.table, *(variables.slots[k] for k in enc.slots)]
        blocks = grads if isinstance(grads, tuple) else (grads,)  # read where they are: no copy into one array
        fixed = (rec.col_ids, rec.row_ids, rec.values, _scalars(o, enc, step), saved, *blocks)
        out = jax.ffi.ffi_call(
            _TARGET.format("backward"), [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state],
            input_output_aliases={len(fixed) + i: i for i in range(len(state))},
        )(*fixed, *state, blocks=np.int64(len(blocks)), **self._attrs(),
          **_options(stack, enc, skip_nonfinite, linear))
        return EmbeddingVariables(out[0], dict(zip(enc.slots, out[1:])))

    def find_keys(self, keys: key_set.KeySet, queries: jax.Array) -> jax.Array:
        _register()  # `_native_keys.cc`: queries in bucket order, each bucket searched (AVX-512 compares or halving)
        return jax.ffi.ffi_call(_TARGET.format("find_keys"), jax.ShapeDtypeStruct(queries.shape[:1], jnp.int32))(
            *self._set(keys), queries, threads=np.int64(self.threads))

    def touch_keys(self, keys: key_set.KeySet, queries: jax.Array, step: jax.Array,
                   stale_before: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self.touch_keys_many([(keys, queries, stale_before)], step)[0]

    def touch_keys_many(self, sets: Sequence[tuple], step: jax.Array) -> list[tuple[jax.Array, ...]]:
        """`touch_keys` of several `(keys, queries, stale_before[, (slot_of, values)])` in one call: the sets spread
        over the threads (XLA would run one call per set one after another); with entries (every set or none),
        each set's `key_set.entry_rows` too, in the same pass."""
        _register()  # `find_keys`, then the found keys' last-use steps set in place (`last` aliased)
        i32 = lambda x: jnp.asarray(x, jnp.int32)
        entries = [s[3] if len(s) > 3 else None for s in sets]
        with_entries = all(e is not None for e in entries)
        if not with_entries and any(e is not None for e in entries):
            raise ValueError("touch_keys_many: entries for every set or for none")
        args, out = [], []
        for (keys, queries, stale_before, *_), e in zip(sets, entries):
            args += [*self._set(keys), queries, i32(stale_before), keys.last]
            # results typed like the inputs (inside shard_map: varying over its axes, as `last` is)
            out += [jax.typeof(queries).update(shape=queries.shape[:1]), jax.typeof(keys.last),
                    jax.typeof(keys.size).update(shape=())]
            if with_entries:
                args += [i32(e[0]), e[1].astype(jnp.float32)]
                out += [jax.typeof(e[0]).update(dtype=jnp.int32), jax.typeof(e[1]).update(dtype=jnp.float32)]
        per_arg, per_out = (10, 5) if with_entries else (8, 3)
        res = jax.ffi.ffi_call(_TARGET.format("touch_keys_many"), out,
                               input_output_aliases={1 + per_arg * i + 7: per_out * i + 1 for i in range(len(sets))})(
            i32(step), *args, threads=np.int64(self.threads), entries=np.int64(with_entries))
        return [tuple(res[per_out * i: per_out * (i + 1)]) for i in range(len(sets))]

    def insert_keys(self, keys: key_set.KeySet, capacity: jax.Array, queries: jax.Array, want: jax.Array,
                    removed: jax.Array | None, step: jax.Array) -> key_set.Inserted:
        _register()  # `key_set.insert` in place (the set's arrays and `last` aliased), O(N) passes, no sort of the set
        i32 = lambda x: jnp.asarray(x, jnp.int32)
        state = (*self._set(keys), keys.last)
        out = [jax.typeof(x) for x in state] + [jax.typeof(want).update(dtype=jnp.int32), jax.typeof(keys.size)]
        none = jnp.zeros((0,), bool)  # no removed slots
        *new, last, slots, evicted = jax.ffi.ffi_call(
            _TARGET.format("insert_keys"), out, input_output_aliases={i: i for i in range(len(state))})(
            *state, i32(capacity), queries, want, none if removed is None else removed, i32(step))
        sorted_keys, order, size, directory, span = new
        return key_set.Inserted(key_set.KeySet(sorted_keys, last, order, size, directory, span), slots, evicted)

    def unique_keys(self, queries: jax.Array) -> tuple[jax.Array, jax.Array]:
        _register()  # `key_set.unique`, bit for bit, by a radix sort (linear; XLA:CPU's sort compares)
        out = (jax.typeof(queries), jax.typeof(queries).update(shape=queries.shape[:1]))
        return tuple(jax.ffi.ffi_call(_TARGET.format("unique_keys"), out)(queries))

    def take_rows(self, values: jax.Array, index: jax.Array, fill: int) -> jax.Array:
        _register()  # `key_set.take` for int32 rows, over the thread pool (several calls per step)
        out = jax.typeof(index).update(dtype=jnp.int32)
        return jax.ffi.ffi_call(_TARGET.format("take_rows"), out)(
            values.astype(jnp.int32), index.astype(jnp.int32), jnp.asarray(fill, jnp.int32),
            threads=np.int64(self.threads))

    @staticmethod
    def _set(keys: key_set.KeySet) -> tuple[jax.Array, ...]:
        return keys.sorted_keys, keys.order, keys.size, keys.directory, keys.span
