"""The public face: light to import, at most 35 top-level names, specialist names in namespaces of their own, and
the old top-level spellings kept one release behind a DeprecationWarning that names the new one."""

from __future__ import annotations

import importlib
import pathlib
import re
import subprocess
import sys
import warnings

import pytest

import sparse_embed as se
from sparse_embed import _lazy

ROOT = pathlib.Path(se.__file__).resolve().parent.parent
HEAVY = ("flax", "optax", "orbax", "tensorstore")
# The namespaces that hold the specialist names, and what each re-exports (from where)
NAMESPACES = {
    "sparse_embed.jte": {"CsrBatch": "sparse_embed.core.sparsecore.batch",
                         "JteTableLayout": "sparse_embed.integrations.jte",
                         "SparseCoreBatch": "sparse_embed.core.sparsecore.batch",
                         "from_jte": "sparse_embed.integrations.jte", "jte_layout": "sparse_embed.integrations.jte",
                         "jte_layout_from_specs": "sparse_embed.integrations.jte",
                         "sparsecore_csr": "sparse_embed.integrations.jte",
                         "to_jte": "sparse_embed.integrations.jte"},
    "sparse_embed.tuning": {"configure_cpu_allocator": "sparse_embed.host.malloc",
                            "configure_xla_cpu": "sparse_embed.core.kernels.generic"},
    "sparse_embed.raw_ids": {"IdMap": "sparse_embed.core.id_maps", "IdMapStats": "sparse_embed.core.id_maps",
                             "IdTable": "sparse_embed.io.id_tables", "MappedIdBatch": "sparse_embed.core.batch",
                             "RawIdBatch": "sparse_embed.core.batch", "id_table_contents": "sparse_embed.io.id_tables",
                             "load_id_tables": "sparse_embed.io.id_tables"},
}
NEW_NAMES = {"MappedIdBatch", "RawIdBatch", "SparseCoreBatch"}  # added to a namespace: never top-level names
OLD_NAMES = {name: ns for ns, names in NAMESPACES.items() for name in names
             if name not in NEW_NAMES}  # sparse_embed.<name> until 0.3


def _heavy_after(code: str) -> list[str]:
    """Which of HEAVY a fresh interpreter has in `sys.modules` after running `code`."""
    probe = f"{code}\nimport sys\nprint(*sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


EVERY_CORE_MODULE = ("import importlib, pkgutil, sparse_embed.core\n"
                     "for m in pkgutil.walk_packages(sparse_embed.core.__path__, 'sparse_embed.core.'):\n"
                     "    importlib.import_module(m.name)")


@pytest.mark.parametrize("code, allowed", [
    ("import sparse_embed.core", ()),
    (EVERY_CORE_MODULE, ()),  # all of core: the lookup, the kernels, the plan
    ("import sparse_embed", ()),  # (the issue asks for orbax and tensorstore only: flax and optax are out too)
    # the daily names of core and host, and the namespaces, load none of them either
    ("import sparse_embed as se\nse.plan, se.init_tables, se.preprocess, se.prefetch, se.lookup, se.map_ids\n"
     "import sparse_embed.jte, sparse_embed.tuning, sparse_embed.raw_ids", ()),
], ids=["core", "every_core_module", "sparse_embed", "daily_names"])
def test_importing_loads_no_checkpoint_or_integration_library(code, allowed):
    assert set(_heavy_after(code)) <= set(allowed)


def test_the_checkpoint_names_load_orbax_on_first_use():
    """The probe above can see them: the first use of a checkpoint name loads orbax and tensorstore."""
    assert {"orbax", "tensorstore"} <= set(_heavy_after("import sparse_embed as se\nse.CheckpointManager"))


def test_all_has_at_most_35_names_and_each_resolves_without_a_warning():
    assert len(se.__all__) <= 35, len(se.__all__)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in se.__all__:
            assert getattr(se, name) is not None, name
        star: dict = {}
        exec("from sparse_embed import *", star)
    assert set(se.__all__) <= set(star)


def test_dir_lists_all_and_the_namespaces_but_no_old_name():
    listed = dir(se)
    assert set(se.__all__) <= set(listed)
    assert {"jte", "tuning", "raw_ids", "flax", "distributed", "optimizers", "initializers"} <= set(listed)
    assert not set(OLD_NAMES) & set(listed) and not set(OLD_NAMES) & set(se.__all__)


@pytest.mark.parametrize("namespace", sorted(NAMESPACES))
def test_each_namespace_resolves_its_names_to_the_implementation(namespace):
    module = importlib.import_module(namespace)
    assert getattr(se, namespace.rpartition(".")[2]) is module
    assert sorted(module.__all__) == sorted(NAMESPACES[namespace]) and set(module.__all__) <= set(dir(module))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name, where in NAMESPACES[namespace].items():
            assert getattr(module, name) is getattr(importlib.import_module(where), name), name
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        module.nothing


@pytest.mark.parametrize("namespace", se._SUBMODULES)
def test_every_name_a_namespace_lists_is_there(namespace):
    """Each namespace (`se.serving`, `se.offload`, `se.data`, ...) is its module, and each name its `__all__` lists
    loads (a lazy entry that names a missing module or attribute fails here), without a warning."""
    module = importlib.import_module(f"sparse_embed.{namespace}")
    assert getattr(se, namespace) is module and module.__all__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        missing = [name for name in module.__all__ if getattr(module, name, None) is None]
    assert not missing, f"sparse_embed.{namespace} lists {missing} but has none of them"


@pytest.mark.parametrize("name", sorted(OLD_NAMES))
def test_each_old_name_still_resolves_with_a_warning_naming_the_new_spelling(name):
    new = f"{OLD_NAMES[name]}.{name}"
    with pytest.warns(DeprecationWarning, match=rf"sparse_embed\.{name} has moved to {re.escape(new)}\b"):
        old = getattr(se, name)
    assert old is getattr(importlib.import_module(OLD_NAMES[name]), name)
    with pytest.warns(DeprecationWarning, match=re.escape(new)):
        exec(f"from sparse_embed import {name}", {})


def test_an_unknown_name_is_an_attribute_error_and_a_name_listed_twice_is_refused():
    assert not hasattr(se, "to_jtee")
    with pytest.raises(ValueError, match="'x' is listed under both a and b"):
        _lazy.attach("p", {"a": ("x",), "b": ("x",)})


# an old spelling as code writes it: se.<old name>, sparse_embed.<old name>, or imported from sparse_embed
_OLD_USE = re.compile(rf"\b(?:se|sparse_embed)\.({'|'.join(OLD_NAMES)})\b"
                      rf"|from sparse_embed import [^\n]*\b({'|'.join(OLD_NAMES)})\b")


def test_nothing_here_uses_an_old_spelling():
    """The package, tests, benchmarks, README, docs and notebook use the namespaces' spelling."""
    paths = [*(ROOT / "sparse_embed").rglob("*.py"), *(ROOT / "tests").rglob("*.py"),
             *(ROOT / "benchmarks").glob("*.py"), ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
             *(ROOT / "notebooks").glob("*.ipynb")]
    found = [f"{p.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
             for p in paths for text in [p.read_text()] for m in _OLD_USE.finditer(text)]
    assert not found, "\n".join(found)
