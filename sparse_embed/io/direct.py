"""Restoring the table store straight into a CPU state's buffers: one copy, no compile, every core.

The general restore (`store._read_table`) reads each chunk with tensorstore
into a new host array, copies it to the devices and writes it into the
stacked state with a compiled, donated relayout: right for any device and
any layout, but on CPU that is three copies of the state, each into
freshly faulted memory, and a compile per stack in every fresh process
(where a restore after a preemption runs). So when the state is on CPU in
this one process and each device's rows of each table hold ids in an
arithmetic progression (`table_runs`: a MOD shard, a table's block, a
replica), each stored chunk's file is read straight into the device buffer
that holds its rows (or, where its rows are spread over devices, into a
reused buffer and from there into each), by several threads, checked as
tensorstore checks it:

- the file's size: at least a whole chunk (edge chunks are stored whole) and its CRC32C;
- the CRC32C (zarr3's `crc32c` codec, in C: `host/_native.c`);
- a missing file reads as the fill value, zero (zarr's rule; the value checksum decides);

and the value checksum (`io.integrity`) is summed from the same bytes while
they are in cache. The file's pages are then dropped from the page cache
(`FORGET_READ_FILES`): the state needs that memory more. The caller checks the array's metadata first
(`store.metadata_problem`), so the files mean what this reads them as.

The state's buffers stay XLA's own, so a train step still donates them in
place (a numpy buffer handed to jax would be copied on its first donation),
and its rows are written through a view of each device's buffer, which
nothing else holds yet. A fresh state (`new_state`) is allocated by XLA
and left unwritten (an FFI call of the C++ kernel's extension that does
nothing): XLA's zero fill would fault in every page on one thread before
the reads start; here each task faults in the pages it is about to write
with one system call (MADV_POPULATE_WRITE), and the rows no chunk gives
(padding) get their initial values (`fill_rest`).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import functools
import mmap
import os
import sys
import threading
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from sparse_embed.core.kernels import native_cpu
from sparse_embed.core.planning import EmbeddingPlan, StackPlan
from sparse_embed.core.relayout import TABLE_KEY, stack_rows
from sparse_embed.core.state import SLOT_DTYPE, EmbeddingVariables
from sparse_embed.host.native import extension
from sparse_embed.io.integrity import partial_sums, words_per_value

ENABLED = True  # False: every restore takes the general path (tests compare the two)
READERS = min(32, max(4, os.cpu_count() or 1))  # threads reading chunk files (more than cores: a cold read waits)
# After reading a chunk file, tell the kernel its pages will not be needed again (POSIX_FADV_DONTNEED): a restore
# reads each byte once, into new memory as large as what it reads, so where memory is short the kernel would
# otherwise reclaim page cache (these files' own pages, or others') page by page to fault in the state.
FORGET_READ_FILES = True
_BLOCK = 1 << 18  # rows of a device's buffer whose stack rows are worked out at once (`table_runs`)
_MAX_RUNS = 4  # runs per device and table, at most; more: the general path


class Run(NamedTuple):
    """Rows `pos + t` (`t < n`) of `view` (a device's buffer) hold ids `first + step * t` of one table."""

    view: np.ndarray
    pos: int
    first: int
    step: int
    n: int


def available(arrays: Sequence[jax.Array]) -> bool:
    """Whether the direct path may restore into these arrays: CPU, one process, the C extension, little-endian."""
    return available_on([d for a in arrays for d in a.sharding.device_set])


def available_on(devices: Iterable[jax.Device]) -> bool:
    """`available` for arrays on `devices`."""
    native = extension()
    return (ENABLED and native is not None and hasattr(native, "crc32c") and sys.byteorder == "little"
            and jax.process_count() == 1 and all(d.platform == "cpu" for d in devices))


def new_state(plan: EmbeddingPlan, *, with_slots: bool = True) -> dict[str, EmbeddingVariables] | None:
    """The plan's state with its buffers allocated but not written (any values; huge pages advised), for
    `store.read_into_state(..., initialized=False)`; None where the direct path or the C++ extension is not."""
    if not (available_on(plan.mesh.devices.flat) and native_cpu.can_leave_uninitialized()):
        return None
    return jax.block_until_ready(_allocate_fn(plan, with_slots)())


@functools.lru_cache(maxsize=16)
def _allocate_fn(plan: EmbeddingPlan, with_slots: bool) -> Callable[[], dict[str, EmbeddingVariables]]:
    def per_device():
        return {s.name: EmbeddingVariables(
            native_cpu.uninitialized((s.rows_per_shard, s.array_dim), s.dtype),
            {k: native_cpu.uninitialized((s.rows_per_shard, w), SLOT_DTYPE) for k, w in s.slot_widths().items()}
            if with_slots else {}) for s in plan.stacks}

    fn = jax.shard_map(per_device, mesh=plan.mesh, in_specs=(), out_specs=P(plan.axis_name), check_vma=False)
    return jax.jit(fn, out_shardings=plan.table_sharding())


def fill_value(stack: StackPlan, key: str) -> Any:
    """What a row of array `key` ("table" or a slot) holds before any is written: 0, or the slot's initial value."""
    return 0 if key == TABLE_KEY else stack.optimizer.slots(stack.embedding_dim)[key].init


def fill_rest(views: list[tuple[int, np.ndarray]], runs: list[list[Run]], value: Any) -> None:
    """Writes `value` into every row of the buffers `views` that no run of `runs` covers (padding rows, ids past
    a table's stored rows), so that an unwritten buffer (`new_state`) ends as `empty_tables` would."""
    for _, view in views:
        covered = sorted((r.pos, r.pos + r.n) for table in runs for r in table if r.view is view)
        at = 0
        for lo, hi in [*covered, (view.shape[0], view.shape[0])]:
            if lo > at:
                view[at:lo] = value
            at = max(at, hi)


def device_views(a: jax.Array) -> list[tuple[int, np.ndarray]] | None:
    """`(first global row, writable view of its buffer)` for each device's whole-row shard of `a` (ready, on
    CPU), or None where the buffers cannot be written in place (columns split, another layout, shared)."""
    out, spans = [], []
    for shard in a.addressable_shards:
        x = shard.data
        rows, cols = shard.index[0], shard.index[1] if len(shard.index) > 1 else slice(None)
        if a.ndim != 2 or cols.indices(a.shape[1]) != (0, a.shape[1], 1) or x.shape[1] != a.shape[1]:
            return None
        try:
            layout = x.format.layout
            row_major = tuple(layout.major_to_minor) == (0, 1) and not layout.tiling
            ptr = x.unsafe_buffer_pointer()
        except Exception:  # noqa: BLE001 - an array that does not say: the general path
            return None
        if not row_major:
            return None
        nbytes = x.size * x.dtype.itemsize
        view = np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), x.dtype).reshape(x.shape) if nbytes else \
            np.empty(x.shape, x.dtype)
        spans.append((ptr, ptr + nbytes))
        out.append((rows.indices(a.shape[0])[0], view))
    spans.sort()
    if any(b[0] < e[1] for e, b in zip(spans, spans[1:])):  # two shards in one buffer: never write through it
        return None
    return out


def rewrapped(a: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """A new array of `a`'s buffers (not a copy), so no host copy that jax cached of `a` outlives the writes;
    with `sharding` where it is equivalent to `a`'s (jit may say `P()` for `P(axis)` on one device)."""
    if not a.sharding.is_equivalent_to(sharding, a.ndim):
        sharding = a.sharding
    return jax.make_array_from_single_device_arrays(a.shape, sharding, [s.data for s in a.addressable_shards])


def table_runs(stack: StackPlan, views: list[tuple[int, np.ndarray]],
               valid: Mapping[str, int]) -> list[list[Run]] | None:
    """Per table of `stack`, the runs of its ids `< valid[name]` in the device buffers `views` (`device_views`
    of one of the stack's arrays); None where a device's stack rows do not increase with its rows (e.g. a
    SparseCore stack's rotated shards) or a table's ids there are no arithmetic progression."""
    spans, limits = tuple((lo, v.shape[0]) for lo, v in views), tuple(valid[p.table.name] for p in stack.tables)
    runs = _stack_runs(stack, spans, limits)  # the same for every array of the stack: worked out once (cached)
    if runs is None:
        return None
    by_lo = dict(views)
    return [[Run(by_lo[lo], *r) for lo, *r in table] for table in runs]


@functools.lru_cache(maxsize=8)
def _stack_runs(stack: StackPlan, spans: tuple[tuple[int, int], ...],
                valid: tuple[int, ...]) -> list[list[tuple[int, int, int, int, int]]] | None:
    """`table_runs` for devices whose buffers hold global rows `[lo, lo + rows)`: per table,
    `(lo, pos, first id, step, count)`."""
    if len({lo for lo, _ in spans}) != len(spans):
        return None
    out: list[list[tuple[int, int, int, int, int]]] = [[] for _ in stack.tables]
    index = np.int32 if max(stack.array_rows, stack.total_rows) < 2**30 else np.int64  # half the memory traffic
    for lo, rows in spans:
        runs: list[list[int]] = [[] for _ in stack.tables]  # per table: [pos, first, step, n]
        for b in range(0, rows, _BLOCK):
            g = np.arange(lo + b, lo + min(rows, b + _BLOCK), dtype=index)
            r = np.asarray(stack_rows(stack, g))
            d = np.diff(r)
            if not (d > 0).all():  # then each table's rows below are one slice of the block
                return None
            for i, p in enumerate(stack.tables):
                a, z = np.searchsorted(r, [p.row_offset, p.row_offset + valid[i]])
                if a == z:
                    continue
                step = int(d[a]) if z - a > 1 else 1
                if (d[a: z - 1] != step).any():
                    return None
                _extend(runs[i], [b + int(a), int(r[a]) - p.row_offset, step, int(z - a)])
        for i, table in enumerate(runs):
            out[i] += [(lo, *run) for run in table]
    for want, table in zip(valid, out):  # every id, once or on each of k replicas
        held = sum(n for *_, n in table)
        if len(table) > _MAX_RUNS * len(spans) or (want and (held < want or held % want)):
            return None
    return out


def _extend(runs: list[list[int]], new: list[int]) -> None:
    """Appends run `new` ([pos, first, step, n]) to one table's `runs`, joined to the last one where it
    continues it (the next rows, the same progression)."""
    if runs:
        pos, first, step, n = runs[-1]
        gap = new[1] - (first + step * (n - 1))
        if pos + n == new[0] and gap >= 1 and (n == 1 or gap == step) and (new[3] == 1 or new[2] == gap):
            runs[-1] = [pos, first, gap, n + new[3]]
            return
    runs.append(new)


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_libc: list = []


def _populate(a: np.ndarray) -> None:
    """Faults in the pages of `a` (C-contiguous) with one system call (MADV_POPULATE_WRITE), before a read
    writes them: far cheaper than a fault per page (in a VM especially). Advice only: values are kept, and
    where the kernel does not know it, it is not asked again."""
    if not _libc:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc.append(libc)
        except (OSError, AttributeError):
            _libc.append(None)
    libc, page = _libc[0], mmap.PAGESIZE
    if libc is None or not a.nbytes:
        return
    lo = a.ctypes.data // page * page
    if libc.madvise(lo, -(-(a.ctypes.data + a.nbytes - lo) // page) * page, _MADV_POPULATE_WRITE) and \
            ctypes.get_errno() == errno.EINVAL:
        _libc[0] = None


class ChunkError(Exception):
    """A stored chunk that cannot be read as it should be (its size or CRC32C)."""


_local = threading.local()


def _scratch(shape: tuple[int, int], dtype: np.dtype) -> np.ndarray:
    """This thread's reused buffer of `shape` (a chunk spread over several devices is read into it)."""
    key = (shape, np.dtype(dtype).str)
    if getattr(_local, "key", None) != key:
        _local.key, _local.buf = key, np.empty(shape, dtype)
    return _local.buf


def _read_file(path: str, data: np.ndarray) -> bool:
    """Reads a chunk file into `data` (C-contiguous) and checks its size and CRC32C; False: no such file."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        body, tail = memoryview(data.reshape(-1).view(np.uint8)), bytearray(4)  # the data, then its CRC32C
        total, want = 0, len(body) + 4
        while total < want:
            got = os.preadv(fd, [body[total:], tail] if total < len(body) else [memoryview(tail)[total - len(body):]],
                            total)
            if got == 0:
                break
            total += got
        if FORGET_READ_FILES:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if total != want:  # (bytes after the CRC32C are not read, as tensorstore does not read them)
        raise ChunkError(f"chunk file {path} has {total} bytes, expected {want}")
    crc, stored = extension().crc32c(body), int.from_bytes(tail, "little")
    if crc != stored:
        raise ChunkError(f"chunk file {path}: CRC32C {crc:08x} of its data, but {stored:08x} stored")
    return True


def read_table(array_dir: str, runs: list[Run], rows: int, chunk: int, width: int,
               dtype: Any) -> list[Callable[[], tuple[int, int]]]:
    """Tasks that read the stored array `[rows, width]` at `array_dir` (zarr3, `chunk` rows per chunk) into the
    device buffers of `runs`, one per chunk; each returns the value checksum's sums of its rows."""
    row_words = width * words_per_value(dtype)

    def task(i: int) -> tuple[int, int]:
        c = i * chunk
        m = min(chunk, rows - c)
        ends = [(r, max(0, -(-(c - r.first) // r.step)), min(r.n, -(-(c + m - r.first) // r.step))) for r in runs]
        hit = [(r, t0, t1) for r, t0, t1 in ends if t0 < t1]
        whole = m == chunk and len(hit) == 1 and hit[0][0].step == 1 and hit[0][2] - hit[0][1] == m
        buf = hit[0][0].view[hit[0][0].pos + hit[0][1]: hit[0][0].pos + hit[0][2]] if whole else \
            _scratch((chunk, width), dtype)
        for r, t0, t1 in hit:
            _populate(r.view[r.pos + t0: r.pos + t1])
        if not _read_file(os.path.join(array_dir, "c", str(i), "0"), buf):
            buf[:m] = 0  # a chunk that was never stored: zarr's fill value
        sums = partial_sums(buf[:m], c * row_words)
        if not whole:
            for r, t0, t1 in hit:
                start = r.first + r.step * t0 - c
                r.view[r.pos + t0: r.pos + t1] = buf[start: start + r.step * (t1 - t0 - 1) + 1: r.step]
        return sums

    return [lambda i=i: task(i) for i in range(-(-rows // chunk))]


def run(tasks: Sequence[tuple[Any, Callable[[], tuple[int, int]]]]) -> dict[Any, tuple[int, int]]:
    """Runs `(key, task)` pairs on `READERS` threads; returns each key's summed sums. The first failure is
    raised as `(key, exception)` in a `TaskError`, the tasks not yet started cancelled."""
    sums: dict[Any, tuple[int, int]] = {}
    with concurrent.futures.ThreadPoolExecutor(min(READERS, max(1, len(tasks)))) as pool:
        futures = [(key, pool.submit(fn)) for key, fn in tasks]
        try:
            for key, f in futures:
                try:
                    a, b = f.result()
                except Exception as e:  # noqa: BLE001 - raised below, naming the array
                    raise TaskError(key, e) from None
                sa, sb = sums.get(key, (0, 0))
                sums[key] = sa + a, sb + b
        except TaskError:
            for _, f in futures:
                f.cancel()
            raise
    return sums


class TaskError(Exception):
    def __init__(self, key: Any, cause: Exception):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.key, self.cause = key, cause
