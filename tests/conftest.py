"""Test configuration: a simulated 8-device CPU mesh, set before JAX starts."""

import importlib
import os
import pathlib
import shutil
import sys
import tempfile
import warnings

# 8 simulated devices; region-analysis copy insertion keeps the generic kernel's train steps copy-free
# (sparse_embed.tuning.configure_xla_cpu() adds the same flag). Each added once: pytest-xdist's workers and a test's
# pytest subprocess inherit the flags already added.
_TEST_XLA_FLAGS = ["--xla_force_host_platform_device_count=8", "--xla_cpu_copy_insertion_use_region_analysis=true"]
_flags = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in _TEST_XLA_FLAGS if f not in _flags])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's optimizations mostly off (LLVM at -O0, none of its expensive passes; the HLO passes run as ever): the
# same programs, compiled faster (compiling is the largest part of most tests). Float results may differ in their
# last bits from a fully optimized build of the same program, so every process of a test compiles alike:
# subprocesses inherit the variable, tests/host/multiprocess/launch.py passes it on.
# `JAX_DISABLE_MOST_OPTIMIZATIONS=0 pytest` runs the suite fully optimized, as users' programs compile.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402


jax.config.update("jax_numpy_rank_promotion", "raise")
# One XLA compilation cache for the session, in a fresh directory: many tests build the same programs from
# fresh closures, and a hit skips XLA's compile (never the tracing). Fresh per run, so no stale entries; this
# process only (subprocesses compile for themselves: jax's cache files are not written atomically).


def _made_cache_dir() -> str:
    """A fresh directory, or the one this file made when it was imported under its other name (pytest imports it
    as `conftest`, some tests as `tests.conftest`): one cache per process, the one `XLA_CACHE_DIR` names."""
    for name in ("conftest", "tests.conftest"):
        made = getattr(sys.modules.get(name), "XLA_CACHE_DIR", None)
        if made:
            return made
    global _XLA_CACHE
    _XLA_CACHE = tempfile.TemporaryDirectory(prefix="sparse_embed_tests_xla_cache_")
    return _XLA_CACHE.name


XLA_CACHE_DIR = _made_cache_dir()
jax.config.update("jax_compilation_cache_dir", XLA_CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


from sparse_embed.core.kernels import native_cpu  # noqa: E402
from sparse_embed.host import native  # noqa: E402

LOOKUP_KERNELS = ["generic", "native"]

# ---- the native extensions: optional for a user, required in CI -------------------------------------------------
# setup.py builds them as optional, so a broken build still installs and every native test would skip: a green
# suite on the generic path only. Under CI (CI=true or CI=1 in the environment, as .ci/run runs), a missing
# extension fails the session at its start and any test that needs it, naming the extension and the fix.
NATIVE_EXTENSIONS = {  # what: (module, is it there?, what building it needs)
    "kernel": ("sparse_embed.core.kernels._native_cpu", lambda: native_cpu.available(),
               "a C++17 compiler and jaxlib's XLA FFI headers (jaxlib/include/xla/ffi/api/ffi.h)"),
    "preprocess": ("sparse_embed.host._native", lambda: native.extension() is not None, "a C compiler"),
}


def native_required() -> bool:
    """Whether a missing native extension is a failure (CI) rather than a skip."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def importorfail(module: str):
    """`pytest.importorskip(module)` for a module the test extras install (or the README's test command, as it
    does torchrec): under CI, where a skip would hide a broken install, a failure naming the module instead."""
    if not native_required():
        return pytest.importorskip(module)
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"CI={os.environ['CI']}: could not import {module!r} ({e}), which the README's test command "
                    "installs, so its tests would skip", pytrace=False)


def _missing(what: str) -> str | None:
    """Why the native extension `what` ("kernel" or "preprocess") is missing, or None when it is there."""
    module, present, needs = NATIVE_EXTENSIONS[what]
    with warnings.catch_warnings(record=True) as said:  # a loader's note (a built copy shadowed) goes into the reason
        warnings.simplefilter("always")
        if present():
            return None
    why = f"the native extension {module} is not built"
    if what == "preprocess" and os.environ.get(native.ENV) == "0":
        why += f" or is switched off ({native.ENV}=0)"
    try:
        importlib.import_module(module)
    except ImportError as e:
        why += f" ({type(e).__name__}: {e})"
    return why + "".join(f"; {str(w.message).rstrip('.')}" for w in said)


def _fix(what: str) -> str:
    return (f"Building it needs {NATIVE_EXTENSIONS[what][2]}; install what is missing, then reinstall "
            f"(`pip install -e .`) and read setup.py's output for the compiler's error.")


def require_native(what: str) -> None:
    """Skips the calling test when the native extension `what` ("kernel" or "preprocess") is missing; under CI,
    fails it instead. The kernel's FFI targets are XLA:CPU's: on another backend (a GPU run of the suite with
    JAX_PLATFORMS=cuda) its tests skip."""
    if what == "kernel" and jax.default_backend() != "cpu":
        pytest.skip(f"the native kernel runs on CPU only; this run's backend is {jax.default_backend()}")
    why = _missing(what)
    if why is None:
        return
    if native_required():
        pytest.fail(f"CI={os.environ['CI']}: {why}. {_fix(what)}", pytrace=False)
    pytest.skip(why)


@pytest.fixture
def needs_native_kernel() -> None:
    require_native("kernel")


@pytest.fixture
def needs_native_preprocess() -> None:
    require_native("preprocess")


def pytest_sessionstart(session) -> None:
    """Under CI, a missing native extension stops the run before any test, loudly."""
    if not native_required():
        return
    missing = [f"{why}. {_fix(what)}" for what in NATIVE_EXTENSIONS if (why := _missing(what))]
    if missing:
        pytest.exit(f"CI={os.environ['CI']} and a native extension is missing, so the native tests would skip:\n- "
                    + "\n- ".join(missing), returncode=pytest.ExitCode.TESTS_FAILED)


RESOLUTIONS_ENV = "SPARSE_EMBED_TESTS_RESOLUTIONS"  # where `test_package.start_resolutions` started them


def _runs_test_package(config) -> bool:
    """Whether this session runs tests/test_package.py's resolver test: its paths reach the file, no -k or -m."""
    if config.option.keyword or config.option.markexpr or config.option.collectonly:
        return False
    target = os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_package.py")
    if not os.path.exists(target):  # a copy of the suite with some of its files (tests/test_ci.py)
        return False
    for arg in config.args:
        path = os.path.abspath(str(arg).split("::")[0])
        if target == path or target.startswith(path.rstrip(os.sep) + os.sep):
            return True
    return False


def pytest_configure(config) -> None:
    """pip's resolutions for tests/test_package.py start with the session, in the background (once: xdist's
    controller, or the one process without xdist; the workers find them by the environment), so that their wait
    on the package index overlaps the other tests."""
    if hasattr(config, "workerinput") or os.environ.get(RESOLUTIONS_ENV) or not _runs_test_package(config):
        return
    import test_package  # as pytest imports it (pyproject: pythonpath has tests/)

    workdir = tempfile.mkdtemp(prefix="sparse_embed_tests_resolutions_")
    test_package.start_resolutions(pathlib.Path(workdir))
    os.environ[RESOLUTIONS_ENV] = workdir
    config.add_cleanup(lambda: (test_package.stop_resolutions(pathlib.Path(workdir)),
                                shutil.rmtree(workdir, ignore_errors=True)))


# The slowest files (by `--durations`), slowest first, run before the rest: xdist (`--dist loadfile`, with
# `--no-loadscope-reorder` in pyproject.toml, else it orders files by their number of tests) hands out files in
# collection order, and one of these left for the end keeps one worker busy while the others are done.
SLOW_FILES_FIRST = ("core/test_id_maps.py", "test_dlrm_resume.py", "io/test_resume.py", "tiers/test_offload_raw_ids.py",
                    "core/test_placement.py", "host/test_multiprocess.py", "core/test_kernels.py",
                    "core/test_sparsecore.py", "core/test_optimizers.py", "test_benchmarks.py", "core/test_lookup.py",
                    "tiers/test_offload_training.py", "io/test_integrity.py")


def pytest_collection_modifyitems(session, config, items) -> None:
    """The slow files first (SLOW_FILES_FIRST's order), then every other file as collected."""
    tests = os.path.dirname(os.path.abspath(__file__))

    def rank(item) -> int:
        path = os.path.relpath(str(item.path), tests)
        return SLOW_FILES_FIRST.index(path) if path in SLOW_FILES_FIRST else len(SLOW_FILES_FIRST)

    items.sort(key=rank)  # stable: each file's tests keep their order


@pytest.fixture(params=LOOKUP_KERNELS)
def each_kernel(request, monkeypatch) -> str:
    """Runs a test once per implementation of the lookup's per-shard work (native: `require_native`).

    Plans made with the default `kernel="auto"` take it from `$SPARSE_EMBED_KERNEL`.
    """
    if request.param == "native":
        require_native("kernel")
    monkeypatch.setenv("SPARSE_EMBED_KERNEL", request.param)
    return request.param


def make_mesh(n: int, axis: str = "x") -> Mesh:
    return Mesh(devices(n), (axis,))


def devices(n: int) -> np.ndarray:
    """The first `n` devices (skips the test when there are fewer: a GPU run has one)."""
    have = jax.devices()
    if len(have) < n:
        pytest.skip(f"needs {n} devices, have {len(have)}")
    return np.array(have[:n])


def assert_trained_equal(got, want, err_msg: str = ""):
    """Trained values (rows, slots, losses, activations) of two runs of the same steps: bitwise on CPUs; a GPU adds
    a step's duplicate ids' gradients up in no fixed order (atomics), so there they agree to float32 rounding.
    Integers (maps, counts) are bitwise anywhere."""
    got, want = np.asarray(got), np.asarray(want)
    if jax.default_backend() == "cpu" or not np.issubdtype(want.dtype, np.inexact):
        np.testing.assert_array_equal(got, want, err_msg=err_msg)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=err_msg)


@pytest.fixture(params=[1, 2, 8], ids=lambda n: f"mesh{n}")
def mesh(request) -> Mesh:
    return make_mesh(request.param)


@pytest.fixture
def mesh8() -> Mesh:
    return make_mesh(8)
