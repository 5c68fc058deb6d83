"""glibc's malloc thresholds for XLA:CPU's per-step buffers: reuse them instead of faulting in fresh pages.

XLA:CPU allocates the temporaries of each run of a compiled program as one
block with `malloc` and frees it when the run ends. glibc serves a block
above its mmap threshold (adjusted as blocks are freed, but never above 32
MiB) from a fresh `mmap`, so every run faults in, and the kernel zeroes,
every page of the block that the run touches. A train step with raw-id
tables has a large block (`map_ids`' insert works on whole id maps: ~55 MiB
at 1M rows per shard, more with more rows), so even its steps without an
insert pay a page fault, and the zeroing of a page, for every page of it
they touch. Raising the mmap and trim thresholds above the block makes
glibc keep it in the heap and hand it back on the next run.

The settings are process-wide and last until the process ends. Their cost:
up to `threshold` bytes of freed memory stay with the process instead of
going back to the system, and blocks below it come from the heap.
"""

from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
DEFAULT_THRESHOLD = 256 << 20


def configure_cpu_allocator(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Sets glibc's mmap and trim thresholds to `threshold` bytes (see the module docstring); returns whether set.

    For CPU training, especially with raw-id tables: call it once, at start.
    Returns False (and changes nothing) where the C library is not glibc.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, int) or not 0 < threshold < 2**31:
        raise ValueError(f"configure_cpu_allocator: threshold must be an int of bytes in [1, 2**31), "
                         f"got {threshold!r}")
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None)  # the C library this process runs on
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc (e.g. musl): other thresholds, other calls
        return False
    return libc.mallopt(_M_MMAP_THRESHOLD, threshold) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, threshold) == 1
