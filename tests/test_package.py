"""The package's shape: layers import only downward, no import-time side effects, modules not shadowed, short functions."""

from __future__ import annotations

import ast
import importlib
import json
import os
import pathlib
import pkgutil
import platform
import re
import shutil
import subprocess
import sys
import time
import types

import pytest

import sparse_embed
from conftest import RESOLUTIONS_ENV

ROOT = pathlib.Path(sparse_embed.__file__).resolve().parent
LAYERS = ["core", "host", "tiers", "io", "integrations"]  # each imports only those before it
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
    env = {"python_version": python, "platform_machine": "x86_64", "sys_platform": "linux"}
    picked = [Requirement(r) for r in project["optional-dependencies"]["tpu"]]
    picked = [str(r.specifier) for r in picked if r.name == "jax-tpu-embedding" and r.marker.evaluate(env)]
    assert picked == [want]
    assert not any(Requirement(r).name == "jax-tpu-embedding" for r in project["dependencies"])  # core: not needed


# ---- every combination of the extras installs on every supported Python (pip's resolver, --dry-run) -------------
#
# jax-tpu-embedding's wheels are manylinux x86_64 only: 0.1.0 has cp311-cp314 wheels, 0.2.0 requires Python >= 3.12
# (and jax >= 0.10.1, flax >= 0.10.3). Elsewhere the tpu extra installs nothing, and the resolution below checks that.
# pip's `--python-version` does not evaluate the requirements' markers for the target Python (it picks the running
# Python's line), so each Python's own interpreter runs the resolver: `pip --python TARGET` where the running pip is
# >= 25.3 (the test extra asks for it), else TARGET's own pip. The registry this runs against serves no metadata
# files, so pip reads each wheel's metadata with range requests (`--use-feature=fast-deps`; a dry run of pip >= 25.3
# then downloads no wheel); an older pip downloads every wheel it considers (~1.5 GB for the bench extra's CUDA torch
# on 3.12+, nothing is cached here). Either way most of it is waiting on the index: they start with the session.

PYTHONS = ("3.11", "3.12", "3.13")
EXTRAS = ("test", "tpu", "bench")
_NETWORK_TROUBLE = ("connection broken by", "NewConnectionError", "ConnectTimeout", "ReadTimeout",
                    "Could not fetch URL", "Max retries exceeded", "Temporary failure in name resolution",
                    "Network is unreachable")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _project() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]


def _requirements(extras) -> list[str]:
    """What `pip install ".[extras]"` asks for, read from pyproject.toml (the project's own name expanded in place),
    so that pip need not build the project's metadata (its build environment would fetch jaxlib for every Python)."""
    from packaging.requirements import Requirement

    project, out, todo, seen = _project(), [], [*extras], set()
    out += project["dependencies"]
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for line in project["optional-dependencies"][extra]:
            req = Requirement(line)
            if _canonical(req.name) == _canonical(project["name"]):
                todo += sorted(req.extras)  # a self-reference, e.g. "sparse-embed[tpu]"
            else:
                out.append(line)
    return out


def _interpreter(version: str) -> str | None:
    """Python `version`: the running one, pyenv's, or one on PATH, whichever reports that version and has pip."""
    if "%d.%d" % sys.version_info[:2] == version:
        return sys.executable
    pyenv = pathlib.Path(os.environ.get("PYENV_ROOT", pathlib.Path.home() / ".pyenv")) / "versions"
    found = [str(p) for p in sorted(pyenv.glob(f"{version}.*/bin/python{version}"), reverse=True)]
    found += [p for p in [shutil.which(f"python{version}")] if p]
    probe = "import sys, pip; print('%d.%d' % sys.version_info[:2])"
    for path in found:
        try:
            out = subprocess.run([path, "-c", probe], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == version:
            return path
    return None


def _pip_version(python: str) -> tuple[int, ...]:
    probe = [python, "-c", "import pip; print(pip.__version__)"]
    out = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    return tuple(int(x) for x in re.findall(r"\d+", out.stdout)[:2]) if out.returncode == 0 else (0,)


def _resolve_command(python: str, extras, workdir: pathlib.Path, new_pip: bool) -> list[str]:
    """pip's dry run installing `extras` for `python`; its report goes to `<workdir>/<extras>.json`."""
    name = "_".join(extras)
    reqs = workdir / f"{name}.txt"
    reqs.write_text("\n".join(_requirements(extras)) + "\n")
    if new_pip:  # metadata by range requests, and no wheel downloaded
        pip = [sys.executable, "-m", "pip", *(["--python", python] if python != sys.executable else []),
               "install", "--use-feature=fast-deps"]
    else:
        pip = [python, "-m", "pip", "install"]
    return [*pip, "--dry-run", "--ignore-installed", "--quiet", "--no-input", "--disable-pip-version-check",
            "--timeout", "30", "--retries", "2", "--report", str(workdir / f"{name}.json"), "-r", str(reqs)]


# Runs a command with its output into argv[1], then writes its exit code into argv[2] (whole, by a rename): the
# `resolutions` fixture may run in another process than the one that started it (an xdist worker, see
# `start_resolutions`).
_WRAP = ("import os, subprocess, sys\n"
         "with open(sys.argv[1], 'w') as f:\n"
         "    code = subprocess.run(sys.argv[3:], stdout=f, stderr=subprocess.STDOUT).returncode\n"
         "open(sys.argv[2] + '.tmp', 'w').write(str(code))\n"
         "os.replace(sys.argv[2] + '.tmp', sys.argv[2])\n")
RESOLVE_TIMEOUT = 420.0  # seconds from the start


_STARTED: list[subprocess.Popen] = []  # this process's resolutions, reaped by `stop_resolutions`


def start_resolutions(workdir: pathlib.Path) -> None:
    """Starts pip's resolver for each Python of PYTHONS that is installed, on every extra together (a subset of an
    installable set is installable, so this covers every combination of the extras) and on the tpu extra alone
    (what a [tpu] user gets), all at once in the background, each in its own process group; what they give lands
    in `workdir` (its `runs.json` lists them). tests/conftest.py calls this when the session starts, so that the
    ~1.5 minutes of waiting on the package index overlap the other tests."""
    runs, new_pip = [], _pip_version(sys.executable) >= (25, 3)
    for version in PYTHONS:
        python = _interpreter(version)
        for extras in (EXTRAS, ("tpu",)) if python is not None else ((),):
            run = {"version": version, "python": python, "extras": list(extras), "pid": None}
            if python is not None:
                name = f"py{version}_{'_'.join(extras)}"
                (workdir / name).mkdir()
                cmd = _resolve_command(python, extras, workdir / name, new_pip)
                run.update(dir=str(workdir / name), report=str(workdir / name / f"{'_'.join(extras)}.json"))
                _STARTED.append(subprocess.Popen([sys.executable, "-c", _WRAP, run["dir"] + "/out", run["dir"] + "/rc",
                                                  *cmd], start_new_session=True))
                run["pid"] = _STARTED[-1].pid
            runs.append(run)
    (workdir / "runs.json").write_text(json.dumps({"started": time.time(), "runs": runs}))


def stop_resolutions(workdir: pathlib.Path) -> None:
    """Kills what `start_resolutions` started and is still running (the session ends, or a run timed out)."""
    for run in json.loads((workdir / "runs.json").read_text())["runs"]:
        if run["pid"] is not None and not os.path.exists(run["dir"] + "/rc"):
            try:
                os.killpg(run["pid"], 9)
            except ProcessLookupError:
                pass
    while _STARTED:  # reaped (a dropped Popen still running warns when it is collected)
        _STARTED.pop().wait()


@pytest.fixture(scope="module")
def resolutions(tmp_path_factory):
    """{python: (interpreter, {extras: (pip's return code, its output, {package: version} or None)})}, from the
    resolutions started with the session (`start_resolutions`), or now; the seconds they took in "elapsed"."""
    workdir = pathlib.Path(os.environ.get(RESOLUTIONS_ENV) or tmp_path_factory.mktemp("resolutions"))
    if not (workdir / "runs.json").exists():
        start_resolutions(workdir)
    index = json.loads((workdir / "runs.json").read_text())
    deadline, out = index["started"] + RESOLVE_TIMEOUT, {}
    while time.time() < deadline and not all(r["pid"] is None or os.path.exists(r["dir"] + "/rc")
                                              for r in index["runs"]):
        time.sleep(0.5)
    stop_resolutions(workdir)
    for run in index["runs"]:
        versions = out.setdefault(run["version"], (run["python"], {}))[1]
        if run["python"] is None:
            continue
        rc_file, text = pathlib.Path(run["dir"]) / "rc", (pathlib.Path(run["dir"]) / "out").read_text()
        rc = int(rc_file.read_text()) if rc_file.exists() else None
        if rc is None:
            text += f"\n(pip was stopped after {RESOLVE_TIMEOUT:.0f} s: ReadTimeout?)"
        noise = ("' is ignored: it is neither a file", "pip is using lazily downloaded wheels")
        lines = "\n".join(line for line in text.splitlines() if not any(n in line for n in noise))
        got = None
        if rc == 0:
            got = {_canonical(i["metadata"]["name"]): i["metadata"]["version"]
                   for i in json.loads(pathlib.Path(run["report"]).read_text())["install"]}
        versions[tuple(run["extras"])] = (rc, lines, got)
    out["elapsed"] = (max((os.path.getmtime(r["dir"] + "/rc") for r in index["runs"] if r["pid"] is not None
                           and os.path.exists(r["dir"] + "/rc")), default=time.time()) - index["started"])
    return out


def test_the_test_extra_asks_for_the_jax_tpu_embedding_the_tpu_extra_asks_for():
    """So that the SparseCore tests run against what a [tpu] user gets, on every Python and platform."""
    from packaging.requirements import Requirement

    def jte(extra):
        return sorted(r for r in _requirements([extra]) if _canonical(Requirement(r).name) == "jax-tpu-embedding")

    assert jte("tpu") and jte("test") == jte("tpu")


def test_the_requirement_expansion_follows_self_references(monkeypatch):
    project = {"name": "sparse-embed", "dependencies": ["numpy"],
               "optional-dependencies": {"a": ["Sparse_Embed[b]", "x"], "b": ["y; python_version >= '3.12'"]}}
    monkeypatch.setitem(globals(), "_project", lambda: project)
    assert _requirements(["a"]) == ["numpy", "x", "y; python_version >= '3.12'"]



@pytest.mark.parametrize("version", PYTHONS)
def test_every_combination_of_the_extras_resolves(resolutions, version):
    """pip's resolver (`pip install --dry-run`) on each supported Python: [test,tpu,bench] installs, so does every
    combination of them, and jax-tpu-embedding comes in the same version with every extra as with [tpu] alone:
    0.1.0 on 3.11, >= 0.2.0 on 3.12+, on x86_64 Linux (on other machines, none)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    assert Version(version) in SpecifierSet(_project()["requires-python"])
    python, runs = resolutions[version]
    if python is None:
        why = f"Python {version} is not installed (pyenv install {version}, or python{version} on PATH)"
        if os.environ.get("CI"):  # CI's machine image has pyenv's 3.11, 3.12 and 3.13: the check must not vanish
            pytest.fail(why)
        pytest.skip(why)
    print(f"pip resolved {len(PYTHONS)} Pythons x 2 sets of extras in {resolutions['elapsed']:.0f} s, in parallel")
    for extras, (rc, text, _) in runs.items():
        if rc != 0 and any(t in text for t in _NETWORK_TROUBLE) and not os.environ.get("CI"):
            pytest.skip(f"the package index cannot be reached: {text.splitlines()[-1] if text else rc}")
        assert rc == 0, f"pip cannot install .[{','.join(extras)}] on Python {version} ({python}):\n{text}"
    every, tpu_alone = runs[EXTRAS][2], runs[("tpu",)][2]
    assert every.get("jax-tpu-embedding") == tpu_alone.get("jax-tpu-embedding")
    jte = every.get("jax-tpu-embedding")
    if platform.machine() != "x86_64" or sys.platform != "linux":
        assert jte is None
    elif version == "3.11":
        assert jte == "0.1.0"
    else:
        assert jte is not None and Version(jte) >= Version("0.2.0")
        assert Version(every["jax"]) >= Version("0.10.1")  # jax-tpu-embedding 0.2.0's own requirement
