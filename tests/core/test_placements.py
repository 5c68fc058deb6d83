"""The placement seam (`core.placements`): every placement a full strategy, no name compared outside it, and a
new placement added with one module and one registration."""

from __future__ import annotations

import ast
import pathlib

import jax
import numpy as np
import pytest

import sparse_embed as se
from sparse_embed import optimizers as opt
from sparse_embed.core import placements
from sparse_embed.core.placements.base import Placement
from sparse_embed.core.placements.row import Row

PACKAGE = pathlib.Path(se.__file__).parent


def test_every_placement_implements_what_has_no_default():
    required = [m for m, f in vars(Placement).items() if callable(f) and _raises_not_implemented(f)]
    assert len(required) > 10
    for name in placements.names():
        p = placements.get(name)
        missing = [m for m in required if getattr(type(p), m) is getattr(Placement, m)]
        assert not missing, (name, missing)
    assert placements.names()[0] == placements.DEFAULT and placements.get(placements.DEFAULT).raw_ids


def _raises_not_implemented(f) -> bool:
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(f))).body[0].body
    return any(isinstance(s, ast.Raise) and "NotImplementedError" in ast.unparse(s) for s in body)


def test_unknown_placements_are_refused():
    with pytest.raises(ValueError, match="Unknown placement 'diagonal'"):
        placements.get("diagonal")
    with pytest.raises(ValueError, match="already registered"):
        placements.register(Row())
    with pytest.raises(ValueError, match=r"placement must be one of \('row', 'table', 'replicated', 'column', 'auto'\)"):
        se.plan([se.FeatureSpec("f", se.TableSpec("t", 10, 4), 8)], placement="diagonal")


def _compared_names(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines that compare something with a placement name (`== "row"`, `in ("column", ...)`)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                consts = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                if any(isinstance(c, ast.Constant) and c.value in names for c in consts):
                    lines.append(node.lineno)
    return lines


def test_no_placement_name_is_compared_outside_the_placements_package():
    names = set(placements.names())
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "placements" in path.relative_to(PACKAGE).parts:
            continue
        lines = _compared_names(ast.parse(path.read_text()), names)
        if lines:
            found[str(path.relative_to(PACKAGE))] = lines
    assert not found, found


def test_the_plan_holds_no_collective():
    """The plan is a value: planning neither defines nor runs a collective (they live in `core.collectives`
    and the placements' exchange)."""
    source = (PACKAGE / "core" / "planning.py").read_text()
    for collective in ("psum", "all_gather", "all_to_all", "pmax", "ppermute", "axis_index"):
        assert collective not in source, collective


class _Mod2(Row):
    """A copy of "row" under another name: what a new placement module needs (one class, one registration)."""

    name = "row_again"


def test_a_registered_placement_plans_looks_up_and_trains(mesh, monkeypatch):
    monkeypatch.setattr(placements, "_REGISTRY", dict(placements._REGISTRY))
    placements.register(_Mod2())
    t = se.TableSpec("t", 50, 8, optimizer=opt.Adagrad(0.1))
    feats = [se.FeatureSpec("f", t, 16), se.FeatureSpec("g", t, 8, max_sequence_length=2)]
    plans = {p: se.plan(feats, mesh, placement=p) for p in (placements.DEFAULT, "row_again")}
    assert plans["row_again"].stacks[0].placement == "row_again"
    assert "row_again" in repr(plans["row_again"]) and "row_again" in plans["row_again"].describe()
    assert plans["row_again"].collective_bytes() == plans[placements.DEFAULT].collective_bytes()
    rng = np.random.default_rng(0)
    ids = {"f": rng.integers(0, 50, (16, 3)), "g": rng.integers(0, 50, (8, 2))}
    out = {}
    for p, plan in plans.items():
        tables = se.init_tables(plan, jax.random.key(0))
        batch, _ = se.preprocess(plan, ids)
        grads = jax.jit(jax.grad(lambda t, b: sum(x.sum() for x in se.lookup(plan, b, t).values())))(tables, batch)
        out[p] = se.unstack_state(plan, grads)
    for k in ("table", "accumulator"):
        np.testing.assert_array_equal(out["row_again"]["t"][k], out[placements.DEFAULT]["t"][k])
