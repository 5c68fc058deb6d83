"""The README's examples run as they stand; every docs/ snippet compiles and names only real API."""

from __future__ import annotations

import ast
import pathlib
import re

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
ALIASES = {"se": "sparse_embed", "sel": "sparse_embed.flax.linen", "sen": "sparse_embed.flax.nnx"}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def readme_examples() -> tuple[str, dict[str, str]]:
    """The README's shared set-up block and its example block under each `###` heading."""
    section = (ROOT / "README.md").read_text().split("## Use it in your own train step", 1)[1].split("\n## ", 1)[0]
    setup, *styles = section.split("\n### ")
    (setup_code,) = python_blocks(setup)
    return setup_code, {s.split("\n", 1)[0]: "".join(python_blocks(s)) for s in styles}


SETUP, STYLES = readme_examples()


def test_readme_has_one_example_per_style():
    assert sorted(STYLES) == ["Flax linen", "Flax nnx", "Plain JAX"] and all(STYLES.values())


def _run(style: str, steps: int) -> tuple[dict, dict[str, np.ndarray]]:
    """Runs the set-up and one style's block as a script, for `steps` batches; its namespace and tables."""
    import sparse_embed as se

    ns: dict = {"__name__": "readme"}
    exec(compile(SETUP, "README:setup", "exec"), ns)
    exec(compile(STYLES[style].replace("data(20)", f"data({steps})"), f"README:{style}", "exec"), ns)
    where = {"Flax linen": "params", "Flax nnx": "model", "Plain JAX": "tables"}[style]
    tables = se.unstack_tables(ns["plan"], _tables_in(ns[where]))
    return ns, {k: np.asarray(v) for k, v in tables.items()}


@pytest.mark.parametrize("style", sorted(STYLES))
def test_readme_example_trains(mesh8, style):
    """The loss is finite, and the tables changed in exactly some of the rows the 20 batches touched."""
    _, before = _run(style, 0)
    ns, after = _run(style, 20)
    assert np.isfinite(float(ns["loss"])) and ns["step"] == 19
    touched = {"items": set(), "users": set()}
    for ids, _ in ns["data"](20):
        touched["items"] |= set(np.concatenate([ids["clicked"].ravel(), ids["history"].ravel()]).tolist()) - {-1}
        touched["users"] |= set(ids["user"].tolist())
    assert set(after) == set(touched)
    for name, rows in touched.items():
        changed = set(np.nonzero(~np.isclose(after[name], before[name]).all(axis=1))[0].tolist())
        assert changed and changed <= rows, name


def _tables_in(where):
    """The {stack: EmbeddingVariables} of plain tables, a linen params tree or an nnx model with `embed`."""
    if hasattr(where, "embed"):
        return where.embed.embedding_variables()
    found = [v["tables"] for v in where.values() if isinstance(v, dict) and "tables" in v]
    return found[0] if found else where


def undefined_api(code: str) -> list[str]:
    """Attributes `se.x`, `sel.x`, `sen.x` in `code` that the package does not have."""
    import importlib

    missing = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ALIASES:
            if not hasattr(importlib.import_module(ALIASES[node.value.id]), node.attr):
                missing.append(f"{node.value.id}.{node.attr}")
    return missing


def test_undefined_api_is_caught():
    assert sorted(undefined_api("se.lookup(plan); se.no_such_thing(); sen.Embed; sel.Nope")) == ["se.no_such_thing", "sel.Nope"]


@pytest.mark.parametrize("doc", DOCS + [ROOT / "README.md"], ids=lambda p: p.name)
def test_doc_snippets_compile_and_name_real_api(doc):
    for code in python_blocks(doc.read_text()):
        tree = ast.parse(code)   # a SyntaxError fails the test
        for node in tree.body:   # imports must resolve
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                exec(compile(ast.Module([node], []), str(doc), "exec"), {})
        assert not undefined_api(code), f"{doc.name}: {undefined_api(code)}"


@pytest.mark.parametrize("doc", DOCS + [ROOT / "README.md"], ids=lambda p: p.name)
def test_doc_links_resolve(doc):
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
        assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"


def test_optimizer_table_is_the_docstring_table():
    import sparse_embed.core.optimizers as opt

    table = [line for line in opt.__doc__.splitlines() if line.startswith("|")]
    assert len(table) >= 10 and "\n".join(table) in (ROOT / "docs" / "optimizers.md").read_text()


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
