"""`configure_cpu_allocator`: a freed large block comes back from the heap (no fresh pages), and bad input."""

import subprocess
import sys

import pytest

import sparse_embed as se

# Allocates, touches and frees a 64 MiB block (above glibc's 32 MiB cap on its dynamic mmap threshold) five
# times, and prints the page faults of the last four: with glibc's defaults each is a fresh mmap (~16k faults
# of 4 KiB pages), once the thresholds are above it the heap hands the same block back (~0).
_PROBE = """
import ctypes, resource, sys
import sparse_embed as se
if sys.argv[1] == "tuned":
    assert se.configure_cpu_allocator(128 << 20)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
n, faults = 64 << 20, []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[1:]))
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_large_block_is_reused_once_the_thresholds_are_raised():
    pages = (64 << 20) // 4096 * 4  # four allocations' worth of 4 KiB pages
    assert _faults("default") > pages // 2  # glibc's defaults: a fresh mapping each time
    assert _faults("tuned") < pages // 50  # the heap's block again


@pytest.mark.parametrize("bad", [0, -1, 2**31, 1.5, "1", True, None])
def test_bad_thresholds_are_refused(bad):
    with pytest.raises(ValueError, match="threshold must be an int of bytes"):
        se.configure_cpu_allocator(bad)
