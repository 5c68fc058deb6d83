"""The native kernel's tests on each instruction set its hot loops can run on here, in this process.

The instruction set is chosen inside the C++ code at each call (`native_cpu.capped_isa` caps it for a block), so
the programs are the same on every set: a test run again under each cap compiles nothing new.
"""

from __future__ import annotations

import functools
import os
import pathlib
import platform

from sparse_embed.core.kernels import native_cpu

ISAS = ["avx512", "avx2", "baseline"]  # best first


def cpu_isas() -> list[str]:
    """The instruction sets the native hot loops can run on here, best first (from /proc/cpuinfo)."""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if platform.machine() == "x86_64" and cpuinfo.exists() else []
    return [i for i in ISAS if i == "baseline" or {"avx512": "avx512f", "avx2": "avx2"}[i] in flags]


def isas_here() -> list[str]:
    """`cpu_isas()` at or below `$SPARSE_EMBED_NATIVE_ISA` (a cap for the whole process), best first."""
    cap = ISAS.index(os.environ.get(native_cpu.ISA_ENV) or ISAS[0])
    return [i for i in cpu_isas() if ISAS.index(i) >= cap]


def on_each_isa(test):
    """Runs `test` once on each of `isas_here()`, best first, in this process: every set must pass what the best
    passes. A failure names the set. Without the native extension (the test itself skips or checks the generic
    kernel), once."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        if native_cpu.isa() is None:
            return test(*args, **kwargs)
        for isa in isas_here():
            with native_cpu.capped_isa(isa) as running:
                assert running == isa, (running, isa)
                try:
                    test(*args, **kwargs)
                except BaseException as e:
                    e.add_note(f"(the native hot loops on {isa})")
                    raise

    return run
