"""The package's shape: layers import only downward, no import-time side effects, modules not shadowed, short functions."""

from __future__ import annotations

import ast
import importlib
import os
import pathlib
import pkgutil
import subprocess
import sys
import types

import pytest

import sparse_embed

ROOT = pathlib.Path(sparse_embed.__file__).resolve().parent
LAYERS = ["core", "host", "io", "integrations"]  # each imports only those before it
MAX_FUNCTION_LINES = 60


def _modules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(sparse_embed.__path__, "sparse_embed.")]


def _sparse_embed_imports(path: pathlib.Path) -> set[str]:
    """The sparse_embed modules a source file imports (at any depth of the file)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("sparse_embed")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sparse_embed"):
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_imports_only_the_layers_below(layer):
    allowed = {f"sparse_embed.{lay}" for lay in LAYERS[: LAYERS.index(layer) + 1]}
    bad = {}
    for path in (ROOT / layer).rglob("*.py"):
        wrong = {m for m in _sparse_embed_imports(path)
                 if m != "sparse_embed" and not any(m == a or m.startswith(a + ".") for a in allowed)}
        wrong |= {m for m in _sparse_embed_imports(path) if m == "sparse_embed"}
        if wrong:
            bad[str(path.relative_to(ROOT))] = sorted(wrong)
    assert not bad, f"{layer}/ imports from above its layer: {bad}"


def test_the_layer_check_can_fail(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("from sparse_embed.io.checkpoint import CheckpointError\nimport sparse_embed\n")
    assert _sparse_embed_imports(bad) == {"sparse_embed.io.checkpoint", "sparse_embed.io.checkpoint.CheckpointError",
                                          "sparse_embed"}


def test_every_module_imports_as_a_module_and_is_not_shadowed():
    for name in _modules():
        mod = importlib.import_module(name)
        assert isinstance(mod, types.ModuleType), name
        parent, _, leaf = name.rpartition(".")
        assert getattr(importlib.import_module(parent), leaf) is mod, f"{name} is shadowed in {parent}"


def test_import_has_no_side_effects_on_the_environment():
    """`import sparse_embed` changes nothing in os.environ beyond what `import jax` itself sets."""
    code = ("import os, jax; before = dict(os.environ); import sparse_embed; "
            "print(sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_all_is_sorted_within_groups_and_importable():
    for name in sparse_embed.__all__:
        assert hasattr(sparse_embed, name), name
    assert len(set(sparse_embed.__all__)) == len(sparse_embed.__all__)
    source = (ROOT / "__init__.py").read_text()
    groups = source.split("__all__ = [", 1)[1].split("]", 1)[0].split("    # ")[1:]
    for group in groups:
        names = [line.strip().strip('",') for line in group.splitlines()[1:] if line.strip()]
        assert names == sorted(names), names


def _long_functions(path: pathlib.Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_over_60_lines_outside_tests():
    paths = [*ROOT.rglob("*.py"), *(ROOT.parent / "benchmarks").rglob("*.py")]
    long = [f for p in paths for f in _long_functions(p)]
    assert not long, long


@pytest.mark.parametrize("python, want", [("3.11", "==0.1.0"), ("3.12", ">=0.2.0"), ("3.13", ">=0.2.0")])
def test_the_tpu_extra_picks_the_jax_tpu_embedding_that_has_wheels_for_the_python(python, want):
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]
    env = {"python_version": python, "platform_machine": "x86_64"}
    picked = [Requirement(r) for r in project["optional-dependencies"]["tpu"]]
    picked = [str(r.specifier) for r in picked if r.name == "jax-tpu-embedding" and r.marker.evaluate(env)]
    assert picked == [want]
    assert not any(Requirement(r).name == "jax-tpu-embedding" for r in project["dependencies"])  # core: not needed
