"""The machine a benchmark runs on: devices, threads, versions, allocator settings."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:  # jax is imported after XLA_FLAGS is set
    import jax


def configure_devices(n: int) -> None:
    """Asks XLA:CPU for at least `n` host devices (only effective before JAX starts a backend).

    A larger count already in XLA_FLAGS (e.g. a test's simulated mesh) is kept.
    """
    flag = "--xla_force_host_platform_device_count"
    flags = os.environ.get("XLA_FLAGS", "")
    current = re.search(rf"{flag}=(\d+)", flags)
    if n > 1 and (current is None or int(current.group(1)) < n):
        flags = re.sub(rf"{flag}=\d+", "", flags)
        os.environ["XLA_FLAGS"] = f"{flags} {flag}={n}".strip()


def make_mesh(n: int) -> "jax.sharding.Mesh":
    """A 1-D mesh ("x") over the first n devices."""
    import jax

    devices = jax.devices()
    if len(devices) < n:
        raise SystemExit(f"--devices {n}: JAX has only {len(devices)} devices (was it initialised before main?).")
    return jax.sharding.Mesh(np.array(devices[:n]), ("x",))


def cpu_threads() -> int:
    """The cores this process may run on: what XLA:CPU uses, and what torch is set to."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_model() -> str:
    """The CPU's model name (Linux), else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def library_version() -> dict[str, Any]:
    """sparse_embed's version, git commit and whether its sources differ from that commit."""
    import sparse_embed

    root = os.path.dirname(os.path.dirname(os.path.abspath(sparse_embed.__file__)))

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", "-C", root, *cmd], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"version": sparse_embed.__version__, "commit": git("rev-parse", "--short", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--", "sparse_embed"))}


def package_versions(names: Sequence[str]) -> dict[str, str | None]:
    """Installed distribution versions (None: not installed), without importing them."""
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def environment(argv: Sequence[str] | None, threads: int, script: str = "benchmarks/step.py") -> dict[str, Any]:
    """What a results file records about the run: command, versions, machine, allocator and load."""
    import jax
    import jaxlib

    return {
        "command": " ".join([f"python {script}", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "sparse_embed": library_version(),
        "peers": package_versions(("torch", "fbgemm-gpu-cpu", "fbgemm-gpu", "flax", "optax", "numpy")),
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "jax_devices": len(jax.devices()),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": threads,  # XLA:CPU's and torch.set_num_threads
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))},
        "openmp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_", "MKL_"))},
        "loadavg_start": os.getloadavg(),  # others' work on the machine: torch's OpenMP suffers most from it
    }
