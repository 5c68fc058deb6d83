"""Under CI (CI=true in the environment), a missing native extension fails the suite instead of skipping its tests.

setup.py builds the extensions as optional, so a broken build installs fine and, without this, every native test
skips and the suite is green on the generic path alone.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import conftest
import sparse_embed

ROOT = pathlib.Path(sparse_embed.__file__).resolve().parent.parent


@pytest.mark.parametrize("ci, fails", [("true", True), ("1", True), ("TRUE", True), ("false", False), ("", False)])
def test_require_native_fails_under_ci_and_skips_elsewhere(monkeypatch, ci, fails):
    monkeypatch.setattr(conftest.native_cpu, "available", lambda: False)
    monkeypatch.setenv("CI", ci)
    outcome = pytest.fail.Exception if fails else pytest.skip.Exception
    with pytest.raises(outcome, match=r"sparse_embed\.core\.kernels\._native_cpu is not built") as raised:
        conftest.require_native("kernel")
    assert ("C++17 compiler" in str(raised.value)) == fails  # the fix, where it fails


def test_require_native_passes_where_the_extension_is_there(monkeypatch):
    monkeypatch.setattr(conftest.native, "extension", lambda: object())
    monkeypatch.setenv("CI", "true")
    conftest.require_native("preprocess")


_TINY = '''
def test_kernel(each_kernel):
    pass


def test_preprocess(needs_native_preprocess):
    pass
'''


@pytest.fixture(scope="module")
def checkout_without_extensions(tmp_path_factory) -> pathlib.Path:
    """The package and tests/conftest.py copied without compiled extensions, and a tiny test file that needs both."""
    copy = tmp_path_factory.mktemp("no_native")
    shutil.copytree(ROOT / "sparse_embed", copy / "sparse_embed",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__", "build"))
    (copy / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", copy / "tests" / "conftest.py")
    (copy / "tests" / "test_tiny.py").write_text(_TINY)
    return copy


def _pytest_in(copy: pathlib.Path, ci: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "SPARSE_EMBED_KERNEL", "SPARSE_EMBED_NATIVE")}
    env["PYTHONPATH"] = os.pathsep.join([str(copy), str(copy / "tests")])  # ahead of the built checkout
    if ci is not None:
        env["CI"] = ci
    cmd = [sys.executable, "-m", "pytest", "tests/test_tiny.py", "-q", "-rs", "-p", "no:cacheprovider", "-n", "0",
           "-W", "ignore::UserWarning"]  # (the loaders warn that a built copy is shadowed)
    return subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=300)


def test_a_checkout_without_its_extensions_fails_under_ci(checkout_without_extensions):
    probe = subprocess.run([sys.executable, "-c", "import sparse_embed; print(sparse_embed.__file__)"],
                           cwd=checkout_without_extensions, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONPATH": str(checkout_without_extensions)})
    assert probe.stdout.strip() == str(checkout_without_extensions / "sparse_embed" / "__init__.py")
    out = _pytest_in(checkout_without_extensions, "true")
    text = out.stdout + out.stderr
    assert out.returncode == pytest.ExitCode.TESTS_FAILED, text
    assert "CI=true and a native extension is missing" in text, text
    for module in ("sparse_embed.core.kernels._native_cpu", "sparse_embed.host._native"):
        assert f"{module} is not built" in text, text
    assert "passed" not in text


def test_a_checkout_without_its_extensions_skips_elsewhere(checkout_without_extensions):
    out = _pytest_in(checkout_without_extensions, None)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed, 2 skipped" in out.stdout and "is not built" in out.stdout, out.stdout


def test_the_slow_files_run_first_and_each_is_there():
    """conftest's SLOW_FILES_FIRST names test files that exist (a renamed one would silently go back to the end),
    and the collection puts them first, in that order."""
    tests = pathlib.Path(conftest.__file__).parent
    assert [f for f in conftest.SLOW_FILES_FIRST if not (tests / f).is_file()] == []

    class Item:
        def __init__(self, path):
            self.path = tests / path

    items = [Item(p) for p in ("core/test_tables.py", "test_benchmarks.py", "core/test_id_maps.py",
                               "core/test_tables.py")]
    conftest.pytest_collection_modifyitems(None, None, items)
    assert [str(i.path.relative_to(tests)) for i in items] == [
        "core/test_id_maps.py", "test_benchmarks.py", "core/test_tables.py", "core/test_tables.py"]
