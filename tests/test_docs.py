"""The README's examples run as they stand; every docs/ snippet compiles and names only real API."""

from __future__ import annotations

import ast
import pathlib
import re

import jax
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
    programs = []  # the dense state starts where the step returns it: one train step program, not two
    listen = lambda event, secs, fun_name=None, **kw: programs.append(fun_name) if event.endswith(
        "backend_compile_duration") else None
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        ns, after = _run(style, 20)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert np.isfinite(float(ns["loss"])) and ns["step"] == 19
    assert programs.count("jit(train_step)") == 1, programs
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


# ---- a formula the docs state is the code's: the owner shard of a raw id (docs/raw_ids.md) ------------------------


def _documented_owner_shard():
    """`owner_shard(raw_id, S)` as docs/raw_ids.md states it (its Python block, run as it stands)."""
    (code,) = [b for b in python_blocks((ROOT / "docs" / "raw_ids.md").read_text()) if "def owner_shard(" in b]
    ns: dict = {}
    exec(compile(code, "docs/raw_ids.md", "exec"), ns)
    return ns["owner_shard"]


def _edge_and_random_ids(seed: int) -> np.ndarray:
    """0, 1, 2**63 - 1, 2**64 - 1 (what -1 is as uint64), words' edges, and random 64-bit ids."""
    edges = np.array([0, 1, 2**31 - 1, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1], np.uint64)
    return np.concatenate([edges, np.random.default_rng(seed).integers(0, 2**64, 4000, dtype=np.uint64)])


@pytest.mark.parametrize("S", [1, 2, 3, 5, 8, 12, 1000, 2**31 - 1])
def test_the_documented_owner_shard_is_owner_shards(S):
    from sparse_embed.core.raw_keys import owner_shards

    owner, ids = _documented_owner_shard(), _edge_and_random_ids(S)
    assert owner_shards(ids, S).tolist() == [owner(int(i), S) for i in ids]
    assert owner_shards(ids.view(np.int64), S).tolist() == [owner(int(i), S) for i in ids]  # int64 input alike


def test_the_documented_owner_shard_is_not_splitmix64_with_its_increment():
    """The doc's point: a user simulating `splitmix64(id) % S` with the usual increment gets other shards."""
    owner, M = _documented_owner_shard(), 2**64 - 1

    def splitmix64(x: int) -> int:
        z = (x + 0x9E3779B97F4A7C15) & M
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
        return z ^ (z >> 31)

    assert splitmix64(0) == 0xE220A8397B1DCDAF  # the reference implementation's first output from seed 0
    ids = [int(i) for i in _edge_and_random_ids(0)]
    assert sum(owner(i, 8) != splitmix64(i) % 8 for i in ids) > len(ids) // 2


@pytest.mark.parametrize("path", ["C", "numpy"])
@pytest.mark.parametrize("S", [2, 3, 8])
def test_preprocess_sends_each_raw_id_to_its_documented_owner(monkeypatch, path, S):
    """Every id of a raw-id batch sits in the segment of the shard the doc's formula names (the C extension's
    partitioning and numpy's)."""
    import sparse_embed as se
    from conftest import make_mesh
    from sparse_embed.host import native

    if path == "C" and native.extension() is None:
        pytest.skip("the C extension (sparse_embed.host._native) is not built")
    if path == "numpy":
        monkeypatch.setattr(native, "extension", lambda: None)
    owner = _documented_owner_shard()
    table = se.TableSpec("users", 10_000, 4, dynamic=se.Dynamic())
    plan = se.plan([se.FeatureSpec("u", table, 24)], make_mesh(S))
    ids = _edge_and_random_ids(S)[:24 * 40] % np.uint64(2**63)  # raw ids lie in [0, 2**63)
    batch, _ = se.preprocess(plan, {"u": ids.reshape(24, 40).astype(np.int64)}, device_put=False)
    coo = batch["users"]
    keys = np.asarray(coo.keys).reshape(S, -1, 2)  # [device, S * capacity, (hi, lo)]
    cap = keys.shape[1] // S
    seen = set()
    for d in range(S):
        real = keys[d, :, 0] != -1
        words = keys[d][real].view(np.uint32).astype(np.uint64)  # (hi, lo) int32 words, as the batch holds ids
        for at, i in zip(np.flatnonzero(real), ((words[:, 0] << np.uint64(32)) | words[:, 1]).tolist()):
            assert at // cap == owner(i, S), (i, d, at // cap)
            seen.add(i)
    assert seen == {int(i) for i in ids}
