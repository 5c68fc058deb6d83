"""Test configuration: a simulated 8-device CPU mesh, set before JAX starts."""

import os
import tempfile

# 8 simulated devices; region-analysis copy insertion keeps the generic kernel's train steps copy-free
# (sparse_embed.configure_xla_cpu() adds the same flag).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_cpu_copy_insertion_use_region_analysis=true"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402


jax.config.update("jax_numpy_rank_promotion", "raise")
# One XLA compilation cache for the session, in a fresh directory: many tests build the same programs from
# fresh closures, and a hit skips XLA's compile (never the tracing). Fresh per run, so no stale entries; this
# process only (subprocesses compile for themselves: jax's cache files are not written atomically), except
# that a test running pytest in subprocesses one after another may hand them one (XLA_CACHE_ENV).
XLA_CACHE_ENV = "SPARSE_EMBED_TESTS_XLA_CACHE"
_XLA_CACHE = tempfile.TemporaryDirectory(prefix="sparse_embed_tests_xla_cache_")
jax.config.update("jax_compilation_cache_dir", os.environ.get(XLA_CACHE_ENV) or _XLA_CACHE.name)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


from sparse_embed.core.kernels import native_cpu  # noqa: E402

LOOKUP_KERNELS = ["generic", "native"]


@pytest.fixture(params=LOOKUP_KERNELS)
def each_kernel(request, monkeypatch) -> str:
    """Runs a test once per implementation of the lookup's per-shard work.

    Plans made with the default `kernel="auto"` take it from `$SPARSE_EMBED_KERNEL`.
    """
    if request.param == "native" and not native_cpu.available():
        pytest.skip("the native CPU kernel (sparse_embed.core.kernels._native_cpu) is not built")
    monkeypatch.setenv("SPARSE_EMBED_KERNEL", request.param)
    return request.param


def make_mesh(n: int, axis: str = "x") -> Mesh:
    devices = jax.devices()
    if len(devices) < n:
        pytest.skip(f"needs {n} devices, have {len(devices)}")
    return Mesh(np.array(devices[:n]), (axis,))


@pytest.fixture(params=[1, 2, 8], ids=lambda n: f"mesh{n}")
def mesh(request) -> Mesh:
    return make_mesh(request.param)


@pytest.fixture
def mesh8() -> Mesh:
    return make_mesh(8)
