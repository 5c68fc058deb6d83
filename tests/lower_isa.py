"""The native kernel's tests again in processes capped to each instruction set below the CPU's best.

The instruction set of the native hot loops is chosen once per process (`$SPARSE_EMBED_NATIVE_ISA` caps it), so
each capped run is a pytest process of its own. Each test file that has kernel tests reruns its own (the last
test of the file): the files' reruns then run on whichever pytest workers run the files, in parallel, and each
rerun is handed its own process's XLA compilation cache, which holds the programs the file's tests just compiled.
"""

from __future__ import annotations

import os
import pathlib
import platform
import re
import subprocess
import sys

import pytest

from conftest import XLA_CACHE_DIR, XLA_CACHE_ENV
from sparse_embed.core.kernels import native_cpu

ISAS = ["avx512", "avx2", "baseline"]  # best first


def cpu_isas() -> list[str]:
    """The instruction sets the native hot loops can run on here, best first (from /proc/cpuinfo)."""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if platform.machine() == "x86_64" and cpuinfo.exists() else []
    return [i for i in ISAS if i == "baseline" or {"avx512": "avx512f", "avx2": "avx2"}[i] in flags]


def rerun_on_each_lower_isa(test_file: str, select: str, passed_at_least: int, env: dict | None = None) -> None:
    """Runs the tests of `test_file` that `select` (pytest's -k) picks in a process capped to each instruction
    set below the CPU's best, one after the other, each in one process (no pytest workers); each must pass at
    least `passed_at_least` tests (none skipped away). `env`: more environment variables for them.

    The processes are handed this process's XLA compilation cache: the programs are the same whatever the cap
    (the instruction set is chosen inside the C++ code when it runs), so where this process ran the same tests
    first (earlier in the file), they trace but compile nothing; where it did not, the first capped process
    compiles for the rest. This process only waits meanwhile: one writer of the cache at a time.
    """
    if os.environ.get(native_cpu.ISA_ENV):
        pytest.skip("this process is itself capped")
    lower = ISAS[ISAS.index(cpu_isas()[0]) + 1:]
    if not lower:
        pytest.skip(f"this CPU's best is {cpu_isas()[0]}: the rest of the suite runs on it")
    for isa in lower:
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                              "-k", select, test_file],
                             env=dict(os.environ, **(env or {}), **{native_cpu.ISA_ENV: isa, XLA_CACHE_ENV: XLA_CACHE_DIR}),
                             capture_output=True, text=True)
        passed = re.search(r"(\d+) passed", out.stdout)
        assert out.returncode == 0 and passed and int(passed.group(1)) >= passed_at_least, (
            isa, out.stdout[-3000:] + out.stderr[-3000:])
