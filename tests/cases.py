"""Several test cases in one plan, so their programs compile once: XLA's compiles dominate these tests.

Each case's features and tables are renamed apart (`{case}_{name}`), the merged plan stacks each case's tables as
a plan of that case alone stacks them (the programs hold the same stacks), and every case is checked against its
own reference; `Failures` reports all failing cases together, each by name.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

import sparse_embed as se


def renamed(case: str, feats: dict[str, se.FeatureSpec]) -> dict[str, se.FeatureSpec]:
    """The case's features and their tables named `{case}_{name}`; tables shared within the case stay shared."""
    tables: dict[str, se.TableSpec] = {}
    out = {}
    for name, f in feats.items():
        t = tables.setdefault(f.table.name, dataclasses.replace(f.table, name=f"{case}_{f.table.name}"))
        out[f"{case}_{name}"] = dataclasses.replace(f, name=f"{case}_{name}", table=t)
    return out


def merged_plan(cases: dict[str, tuple[dict[str, se.FeatureSpec], object]], mesh, **plan_kw) -> se.EmbeddingPlan:
    """One plan of every case's renamed features: `cases` maps a case to (its features, its `stacking`); each
    case's stacks are those of `se.plan(features, mesh, stacking=stacking, **plan_kw)`."""
    feats, groups = {}, []
    for case, (case_feats, stacking) in cases.items():
        feats |= renamed(case, case_feats)
        alone = se.plan(case_feats, mesh, stacking=stacking, **plan_kw)
        groups += [[f"{case}_{t.table.name}" for t in stack.tables] for stack in alone.stacks]
    return se.plan(feats, mesh, stacking=groups, **plan_kw)


class Failures:
    """Collects the failures of several cases checked in one test; `check()` raises them all, named by case.

    A case stops being checked at its first failure (`failed`): later steps of a diverged case say nothing new.
    """

    def __init__(self) -> None:
        self.messages: dict[str, str] = {}

    @contextlib.contextmanager
    def case(self, name: str):
        """Checks of case `name`: an AssertionError inside is recorded (its first one), not raised."""
        try:
            yield
        except AssertionError as e:
            self.messages.setdefault(name, f"[{name}] {str(e).strip()}")

    def failed(self, name: str) -> bool:
        return name in self.messages

    def check(self) -> None:
        if self.messages:
            raise AssertionError(f"{len(self.messages)} case(s) failed: {sorted(self.messages)}\n\n"
                                 + "\n\n".join(self.messages.values()))


def assert_states_close(got: dict, want: dict, *, rtol: float, atol: float, atol_relative: bool = False,
                        name=str) -> None:
    """Every table's arrays (`{table: {"table" or slot: array}}`) against the reference, all of them: one
    AssertionError listing each table whose slots differ and each array that differs, named by `name(table)`.
    `atol_relative`: atol times the largest magnitude of the wanted array (f32 cancellation near zero)."""
    failures = Failures()
    for t, arrays in want.items():
        with failures.case(name(t)):
            assert set(got[t]) == set(arrays), f"arrays {sorted(got[t])}, want {sorted(arrays)}"
        if failures.failed(name(t)):
            continue
        for k, w in arrays.items():
            with failures.case(f"{name(t)}: {k}"):
                tol = atol * np.abs(w).max() if atol_relative else atol
                np.testing.assert_allclose(got[t][k], w, rtol=rtol, atol=tol, err_msg=f"{name(t)}: {k}")
    failures.check()
