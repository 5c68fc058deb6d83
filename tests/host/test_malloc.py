"""`configure_cpu_allocator`: a freed large block comes back from the heap (no fresh pages), and bad input."""

import os
import subprocess
import sys

import pytest

import sparse_embed as se

# Allocates, touches and frees a 64 MiB block (above glibc's 32 MiB cap on its dynamic mmap threshold) five
# times; prints whether the last block was mmapped (glibc's chunk header: the size word before the block has
# bit 2) and the page faults of the last four. With glibc's defaults each is a fresh mapping (16k faults of
# 4 KiB pages, fewer where transparent huge pages back it); once the thresholds are above it, the heap hands
# the same block back (~0).
_PROBE = """
import ctypes, resource, sys
import sparse_embed as se
if sys.argv[1] == "tuned":
    assert se.tuning.configure_cpu_allocator(128 << 20)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
n, faults = 64 << 20, []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    mapped = bool(ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value & 2)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(int(mapped), sum(faults[1:]))
"""


def _probe(mode: str) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], env=env, capture_output=True, text=True, check=True)
    mapped, faults = out.stdout.split()
    return mapped == "1", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_large_block_is_reused_once_the_thresholds_are_raised():
    default_mapped, default_faults = _probe("default")
    tuned_mapped, tuned_faults = _probe("tuned")
    assert default_mapped and not tuned_mapped  # a fresh mapping each time / a block of the heap
    assert default_faults > 10 * max(tuned_faults, 1)


@pytest.mark.parametrize("bad", [0, -1, 2**31, 1.5, "1", True, None])
def test_bad_thresholds_are_refused(bad):
    with pytest.raises(ValueError, match="threshold must be an int of bytes"):
        se.tuning.configure_cpu_allocator(bad)
