"""Each optimizer owns its native encoding: every built-in one declares a case of the native kernel, or none.

An optimizer is its rule (`core/optimizers.py`) plus, if it wants one, a
case in `_native_cpu.cc`'s `update_row`, joined by its own `native()`
declaration. These tests need no build: they read the C++ source's list of
cases, so a missing case fails here even where the extension is not built.
"""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

import sparse_embed as se
from sparse_embed import optimizers as public
from sparse_embed.core import kernels
from sparse_embed.core import optimizers as opt
from sparse_embed.core.kernels import GenericKernel, NativeCpuKernel, native_cpu

needs_native = pytest.mark.usefixtures("needs_native_kernel")  # a skip, or under CI a failure
SOURCE = pathlib.Path(native_cpu.__file__).with_name("_native_cpu.cc").read_text()


def _builtin_classes() -> list[type]:
    """Every optimizer class that `sparse_embed.optimizers` or `core.optimizers` exports (not the base)."""
    names = set(public.__all__) | set(opt.__all__)
    found = {getattr(opt, n) for n in names if inspect.isclass(getattr(opt, n, None))}
    return sorted((c for c in found if issubclass(c, opt.Optimizer) and c is not opt.Optimizer),
                  key=lambda c: c.__name__)


def _instance(cls: type) -> opt.Optimizer:
    return cls(lambda rows, slots, grads, step: (rows, slots)) if cls is opt.Custom else cls()


def _source_cases() -> list[tuple[str, str]]:
    """`[(enumerator, case name)]` of the C++ list `SPARSE_EMBED_OPTIMIZERS`, in order (the order is the code)."""
    block = re.search(r"#define SPARSE_EMBED_OPTIMIZERS\(X\)((?:[^\n]*\\\n)*[^\n]*\n)", SOURCE)
    assert block, "_native_cpu.cc has no SPARSE_EMBED_OPTIMIZERS list"
    return re.findall(r'X\((k\w+),\s*"(\w+)"\)', block.group(1))


def _switch_labels() -> set[str]:
    """The `case` labels of `update_row`'s switch over the optimizer."""
    body = SOURCE[SOURCE.index("void update_row("):]
    body = body[: body.index("\n}\n")]
    return set(re.findall(r"\bcase (k\w+):", body))


BUILTINS = _builtin_classes()


def test_the_builtin_optimizers_are_all_found():
    assert {c.__name__ for c in BUILTINS} >= {"SGD", "Adagrad", "RowwiseAdagrad", "Adam", "AdagradMomentum", "FTRL",
                                              "LaProp", "Custom"}


@pytest.mark.parametrize("cls", BUILTINS, ids=lambda c: c.__name__)
def test_every_builtin_optimizer_declares_a_native_case_or_generic_only(cls):
    """`native()` in the class itself: an encoding whose case the C++ code has, or None (generic only)."""
    assert "native" in vars(cls), (
        f"{cls.__name__} does not declare how a native kernel encodes it: define `native()` returning a "
        "NativeEncoding (with its case in _native_cpu.cc's update_row), or None if it runs on the generic kernel only")
    o = _instance(cls)
    enc = o.native()
    assert enc == opt.native_encoding(o)
    if enc is None:
        return
    assert isinstance(enc, opt.NativeEncoding)
    assert enc.case in dict((n, k) for k, n in _source_cases()), (
        f"{cls.__name__} declares the native case {enc.case!r}, which _native_cpu.cc's SPARSE_EMBED_OPTIMIZERS lacks")
    assert sorted(enc.slots) == sorted(o.slots(8)) and len(set(enc.slots)) == len(enc.slots), (
        f"{cls.__name__}: the native encoding must name each of its slots once")
    assert all(isinstance(h, float) and np.isfinite(np.float32(h)) for h in enc.hyper)
    assert enc.step_factors is None or callable(enc.step_factors)


def test_every_case_of_the_native_list_is_in_the_switch_and_declared_by_an_optimizer():
    listed = _source_cases()
    assert len({k for k, _ in listed}) == len({n for _, n in listed}) == len(listed)
    assert {k for k, _ in listed} == _switch_labels(), "update_row's switch and SPARSE_EMBED_OPTIMIZERS differ"
    declared = {enc.case for c in BUILTINS if (enc := _instance(c).native()) is not None}
    assert declared == {n for _, n in listed}, "a native case no built-in optimizer declares"


@needs_native
def test_the_built_extension_has_the_sources_cases():
    assert native_cpu.native_cases() == {n: code for code, (_, n) in enumerate(_source_cases())}


def test_a_subclass_does_not_inherit_its_parents_native_case(mesh8):
    @dataclasses.dataclass(frozen=True)
    class HalfSGD(opt.SGD):
        def rule(self, rows, slots, grads, step, lr, row_mean):
            return rows - 0.5 * lr * grads, slots

    assert opt.native_encoding(HalfSGD(0.1)) is None and opt.native_encoding(opt.SGD(0.1)) is not None
    plan = se.plan({"a": se.FeatureSpec("a", se.TableSpec("t", 40, 8, optimizer=HalfSGD(0.1)), 16)}, mesh8)
    assert isinstance(kernels.for_stack(plan, plan.stack("t")), GenericKernel)
    assert "HalfSGD optimizers run on the generic kernel" in NativeCpuKernel().unsupported(plan.stack("t"))


@needs_native
def test_a_case_the_build_lacks_runs_on_the_generic_kernel(mesh8, monkeypatch):
    plan = se.plan({"a": se.FeatureSpec("a", se.TableSpec("t", 40, 8, optimizer=opt.Adam(0.1)), 16)}, mesh8)
    assert NativeCpuKernel().unsupported(plan.stack("t")) is None
    monkeypatch.setattr(native_cpu, "native_cases", lambda: {"sgd": 0})  # as an extension built before Adam's case
    assert "declare the native case 'adam', which this build" in NativeCpuKernel().unsupported(plan.stack("t"))
    assert isinstance(kernels.for_stack(plan, plan.stack("t")), GenericKernel)


@needs_native
def test_the_encoding_reaches_the_kernel_as_declared():
    """What the backward's FFI call gets: the case's code, the constants as f32, the step's factors after lr."""
    o = opt.Adam(0.05, b1=0.8, b2=0.9)
    enc = native_cpu._encoding(o)

    class Stack:  # the two fields `_options` reads
        optimizer, max_norm = o, None

    got = native_cpu._options(Stack, enc, False, False)
    assert int(got["optimizer"]) == native_cpu.native_cases()["adam"]
    np.testing.assert_array_equal(got["hyper"], np.float32([1 - 0.8, 1 - 0.9]))
    scalars = native_cpu._scalars(o, enc, jnp.int32(2))
    np.testing.assert_array_equal(scalars, jnp.stack([jnp.float32(0.05), *o.bias_corrected(jnp.int32(2), 0.05)]))
    sgd = opt.SGD(0.1)
    Stack.optimizer = sgd
    np.testing.assert_array_equal(native_cpu._options(Stack, native_cpu._encoding(sgd), False, False)["hyper"],
                                  np.float32([0.0]))  # no constants: one unread 0 (FFI arrays are not empty)
