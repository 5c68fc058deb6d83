"""The kernel seam: which implementation runs, the generic kernel's own paths, and native against generic."""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparse_embed as se
import test_lookup
from conftest import make_mesh
from lower_isa import ISAS, isas_here, on_each_isa
from sparse_embed import optimizers as opt
from sparse_embed.core import kernels
from sparse_embed.core.collectives import kernel_stack
from sparse_embed.core.kernels import GenericKernel, NativeCpuKernel, native_cpu
from sparse_embed.core.tables import table_key
from train_fixtures import assert_trees_equal

needs_native = pytest.mark.usefixtures("needs_native_kernel")  # a skip, or under CI a failure


def _custom(rows, slots, grads, step):
    return rows - 0.1 * grads, slots


def _plan(mesh, **kw):
    sgd = se.TableSpec("sgd", 40, 8, optimizer=opt.SGD(0.1))
    custom = se.TableSpec("custom", 30, 8, optimizer=opt.Custom(_custom))
    feats = {"a": se.FeatureSpec("a", sgd, 16), "b": se.FeatureSpec("b", custom, 16)}
    return se.plan(feats, mesh, **kw)


# ---------------------------------------------------------------- selection
@needs_native
def test_auto_runs_native_on_cpu_and_generic_for_custom_optimizers(mesh8):
    plan = _plan(mesh8)
    assert isinstance(kernels.for_stack(plan, plan.stack("sgd")), NativeCpuKernel)
    assert isinstance(kernels.for_stack(plan, plan.stack("custom")), GenericKernel)


def test_generic_forced_by_plan_and_by_environment(mesh8, monkeypatch):
    plan = _plan(mesh8, kernel="generic")
    assert all(isinstance(kernels.for_stack(plan, s), GenericKernel) for s in plan.stacks)
    monkeypatch.setenv("SPARSE_EMBED_KERNEL", "generic")
    assert _plan(mesh8).kernel == "generic"
    assert _plan(mesh8, kernel=GenericKernel(chunk=7)).kernel == GenericKernel(chunk=7)  # explicit beats env


def test_bad_kernel_choices_are_clear_errors(mesh8, monkeypatch):
    with pytest.raises(ValueError, match="kernel must be one of"):
        _plan(mesh8, kernel="fast")
    with pytest.raises(TypeError, match="kernel must be one of"):
        _plan(mesh8, kernel=42)
    monkeypatch.setenv("SPARSE_EMBED_KERNEL", "fast")
    with pytest.raises(ValueError, match=r"from \$SPARSE_EMBED_KERNEL"):
        _plan(mesh8)


@dataclasses.dataclass(frozen=True)
class _PerShardOnly(kernels.KernelBase):
    """A kernel that writes only the per-shard work (here: the generic kernel's); the rest is KernelBase's."""

    name = "per_shard_only"

    def forward(self, stack, received, table):
        return kernels.GENERIC.forward(stack, received, table)

    def backward(self, stack, received, saved, variables, grads, step, skip_nonfinite):
        return kernels.GENERIC.backward(stack, received, saved, variables, grads, step, skip_nonfinite)


def test_a_kernel_that_writes_only_its_per_shard_work_gets_the_rest_of_the_protocol(mesh8):
    """`KernelBase` gives every other method of the `Kernel` protocol a default (none is looked up by getattr)."""
    kernel = _PerShardOnly()
    assert isinstance(kernel, kernels.Kernel) and not kernel.needs_xla_cpu_flags
    test_lookup.test_multi_step_training_matches_reference(mesh8, "adagrad", "auto", kernel=kernel)


def test_a_kernel_missing_a_method_of_the_protocol_is_refused_by_the_plan(mesh8):
    class Partial:
        name = "partial"

        def forward(self, stack, received, table): ...
        def backward(self, *args): ...
        def unsupported(self, stack): ...

    with pytest.raises(TypeError, match=r"subclass sparse_embed.core.kernels.KernelBase.*lacks \[.*'lookup_forward'"):
        _plan(mesh8, kernel=Partial())


def test_the_lookup_imports_only_the_kernel_seam():
    """`sharded_lookup` asks the kernel registry for each stack's kernel and calls the `Kernel` protocol: no
    kernel implementation, no backend, no placement name."""
    import ast

    from sparse_embed.core import sharded_lookup

    source = pathlib.Path(sharded_lookup.__file__).read_text()
    imported = {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
    imported |= {f"{n.module}.{a.name}" for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)
                 for a in n.names}
    ours = {m for m in imported if m.startswith("sparse_embed")}
    assert not {m for m in ours if "generic" in m or "native" in m or "sparsecore" in m or "placements" in m}, ours
    assert "sparse_embed.core.kernels" in ours
    code = source.split('"""', 2)[2]  # after the module docstring
    assert not re.search(r"isinstance\([^)]*Kernel|getattr\(|sparsecore|GenericKernel|[\"']row[\"']", code)


def test_forcing_native_on_a_custom_optimizer_names_the_stack(mesh8):
    plan = _plan(mesh8, kernel="native")
    with pytest.raises(ValueError, match="Stack 'custom': the native kernel cannot run it: Custom optimizers"):
        kernels.for_stack(plan, plan.stack("custom"))


def test_without_the_extension_auto_is_generic_and_native_says_why():
    """As after an install without a C++ compiler: the import of the extension fails."""
    code = """
import sys; sys.modules["sparse_embed.core.kernels._native_cpu"] = None
import jax, numpy as np, sparse_embed as se
from sparse_embed.core import kernels
mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
feats = {"a": se.FeatureSpec("a", se.TableSpec("t", 10, 4), 4)}
plan = se.plan(feats, mesh)
print(type(kernels.for_stack(plan, plan.stacks[0])).__name__)
try:
    kernels.for_stack(se.plan(feats, mesh, kernel="native"), plan.stacks[0])
except ValueError as e:
    print(e)
"""
    env = {k: v for k, v in os.environ.items() if k != "SPARSE_EMBED_KERNEL"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    first, second = out.stdout.strip().splitlines()
    assert first == "GenericKernel" and "extension is not built" in second


def test_a_checkout_without_the_extensions_ahead_of_a_built_copy_warns(tmp_path):
    """`pip install .` (not -e), then a script run from the checkout: Python imports the checkout, which has no
    compiled extensions, ahead of the installed copy that has them. Each loader warns, naming both places, and
    falls back; run from elsewhere (the built copy imported), nothing is said."""
    import shutil

    checkout = tmp_path / "checkout"
    shutil.copytree(pathlib.Path(se.__file__).parent, checkout / "sparse_embed",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__", "build"))
    code = ("import warnings; warnings.simplefilter('always')\n"
            "import sparse_embed, sparse_embed.core.kernels.native_cpu as k, sparse_embed.host.native as h\n"
            "print(sparse_embed.__file__, k.available(), h.extension() is not None)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("SPARSE_EMBED_KERNEL", "SPARSE_EMBED_NATIVE")}
    shadowed = subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env, capture_output=True, text=True,
                              check=True)
    assert shadowed.stdout.split() == [str(checkout / "sparse_embed" / "__init__.py"), "False", "False"]
    warned = [line for line in shadowed.stderr.splitlines() if "ahead of the copy in" in line]
    assert len(warned) == 2 and all(f"imported from {checkout}, which has no compiled" in w and
                                    "pip install -e ." in w for w in warned), shadowed.stderr
    assert "C++ lookup kernel" in warned[0] + warned[1] and "C preprocessing" in warned[0] + warned[1]
    elsewhere = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                               check=True)
    assert elsewhere.stdout.split()[1:] == ["True", "True"] and "ahead of the copy" not in elsewhere.stderr


# ---------------------------------------------------------------- the generic kernel's paths
@pytest.mark.parametrize("name", list(test_lookup.OPTIMIZERS))
def test_generic_in_tiny_chunks_matches_reference(name):
    """Chunks of 5 entries (many chunks, with padding) instead of the default."""
    test_lookup.test_multi_step_training_matches_reference(make_mesh(2), name, "auto", kernel=GenericKernel(chunk=5))


def test_generic_sorted_dedup_path_matches_reference(mesh8):
    """Duplicates combined by the sort path (as for bf16 tables and 2**24+ entries) instead of representatives."""
    test_lookup.test_multi_step_training_matches_reference(mesh8, "adagrad", "auto",
                                                           kernel=GenericKernel(exact_index_limit=0))


# ---------------------------------------------------------------- native against generic
CASES = {
    "sgd": opt.SGD(0.1),
    "sgd_options": opt.SGD(0.1, clip_gradient=(-0.05, 0.05), weight_decay=0.3, clip_weight=(-0.3, 0.3)),
    "adagrad": opt.Adagrad(0.2),
    "rowwise_adagrad": opt.RowwiseAdagrad(0.2, epsilon=1e-3),
    "adam": opt.Adam(0.05, b1=0.8, b2=0.9),
    "adagrad_momentum": opt.AdagradMomentum(0.1, momentum=0.7, beta2=0.9, exponent=3.0, use_nesterov=True),
    "adagrad_momentum_sqrt": opt.AdagradMomentum(0.1, momentum=0.7),  # exponent 2: the kernel's sqrt path
    "adagrad_momentum_sqrt_beta2": opt.AdagradMomentum(0.1, momentum=0.7, beta2=0.9, use_nesterov=True),
    "ftrl": opt.FTRL(0.5, learning_rate_power=-0.7, l1=0.02, l2=0.1, beta=0.3),
    "ftrl_sqrt": opt.FTRL(0.5, l1=0.02, l2=0.1, beta=0.3),  # power -0.5: the kernel's sqrt path
    "ftrl_multiply_linear": opt.FTRL(0.5, l1=0.02, multiply_linear_by_learning_rate=True),
    "laprop_schedule": opt.LaProp(lambda step: 0.05 / (1.0 + step), b1=0.8, b2=0.9),
    "adam_options": opt.Adam(0.05, clip_gradient=(-0.1, 0.2), clip_weight=(-0.2, 0.25), weight_decay=0.1),
}


# A case of `_train`: (name in CASES, max_norm, dtype name); its tables `<name>_a` and `<name>_b` are one stack.
Case = tuple[str, float | None, str]


@functools.cache
def _initial_rows(table: str, vocab: int, dim: int, dtype: str) -> np.ndarray:
    """The rows `init_tables(plan, jax.random.key(1))` gives a table named `table` (its values depend on its name
    only): every case of `_train` starts from them, as it would alone. In float32, which holds bf16 values exactly
    (stack_tables refuses numpy's bfloat16 arrays as "not numeric")."""
    init = se.TableSpec(table, vocab, dim).resolved_initializer
    return np.asarray(init(table_key(jax.random.key(1), table), (vocab, dim), jnp.dtype(dtype)), np.float32)


def _train(kernel, cases: tuple[Case, ...], mesh, *, steps=3, bad_step=None, dim=8):
    """3 steps on a plan holding every case's stack of two tables (a sequence feature, a shared table, many
    duplicates): one compiled train step for them all; acts and state, keyed by feature and table."""
    feats = {}
    for name, max_norm, dtype in cases:
        a, b = (se.TableSpec(f"{name}_{t}", vocab, dim, combiner="sum", optimizer=CASES[name], max_norm=max_norm,
                             dtype=jnp.dtype(dtype)) for t, vocab in (("a", 61), ("b", 26)))
        feats |= {f"{name}_a1": se.FeatureSpec(f"{name}_a1", a, 16), f"{name}_a2": se.FeatureSpec(f"{name}_a2", a, 16),
                  f"{name}_bseq": se.FeatureSpec(f"{name}_bseq", b, 16, max_sequence_length=3)}
    plan = se.plan(feats, mesh, kernel=kernel, stacking=[[f"{n}_a", f"{n}_b"] for n, _, _ in cases])
    # each case draws its inputs as it would alone: its own generator, its features in order
    rngs = {n: np.random.default_rng(0) for n, _, _ in cases}
    cts = {n: rngs[n.rsplit("_", 1)[0]].normal(size=f.output_shape).astype(np.float32) for n, f in feats.items()}

    def loss(tables, batch, step, poison):
        acts = se.lookup(plan, batch, tables, step)
        return sum(jnp.sum(acts[k] * cts[k]) for k in cts) * poison, acts

    train = jax.jit(jax.grad(loss, has_aux=True), donate_argnums=0)
    rows = {f"{n}_{t}": _initial_rows(t, vocab, dim, dtype)
            for n, _, dtype in cases for t, vocab in (("a", 61), ("b", 26))}
    tables, outs = se.stack_tables(plan, rows), []
    for step in range(steps):
        pool = 3 if step == 1 else None  # step 1: ids from a pool of 3, within and across features
        ids = {n: rngs[n.rsplit("_", 1)[0]].integers(0, pool or f.table.vocabulary_size, (16, 5))
               for n, f in feats.items()}
        batch, _ = se.preprocess(plan, ids)
        tables, acts = train(tables, batch, jnp.int32(step), jnp.float32(np.nan if step == bad_step else 1.0))
        outs.append(acts)
    return jax.tree.map(np.asarray, (outs, se.unstack_state(plan, tables)))


# The generic kernel's results of `_train`, by cases: computed once per process (its programs do not depend on
# the native kernel's instruction set: each set's native results are compared with these).
_GENERIC: dict[str, tuple] = {}


def _generic(cases: tuple[Case, ...], devices: int, **kw):
    """`_train` on the generic kernel, for `cases` on `devices` devices (the same inputs every time)."""
    key = repr((cases, devices, sorted(kw.items())))
    if key not in _GENERIC:
        _GENERIC[key] = _train("generic", cases, make_mesh(devices), **kw)
    return _GENERIC[key]


def _assert_agree(got, want, tolerances: dict[str, tuple]) -> None:
    """Native (`got`) against generic (`want`), case by case: {case name: (activations' (rtol, atol), the final
    state's (rtol, atol), or None for bit for bit)}. Compared in float32; every array that differs is reported,
    named by its case, step, feature or table."""
    failures = []
    for name, (acts_tol, state_tol) in tolerances.items():
        pairs = [(f"{name}: step {i} activations of {n}", a, want[0][i][n], acts_tol)
                 for i, acts in enumerate(got[0]) for n, a in acts.items() if n.rsplit("_", 1)[0] == name]
        pairs += [(f"{name}: table {t} {k}", a, want[1][t][k], state_tol)
                  for t, arrays in got[1].items() if t.rsplit("_", 1)[0] == name for k, a in arrays.items()]
        for what, x, y, tol in pairs:
            try:
                if tol is None:
                    np.testing.assert_array_equal(x, y, err_msg=what)
                else:
                    np.testing.assert_allclose(np.float32(x), np.float32(y), rtol=tol[0], atol=tol[1], err_msg=what)
            except AssertionError as e:
                failures.append(str(e).strip())
    assert not failures, f"{len(failures)} array(s) differ from the generic kernel's:\n\n" + "\n\n".join(failures)


@needs_native
@pytest.mark.parametrize("max_norm", [None, 0.4], ids=["plain", "max_norm"])
@pytest.mark.parametrize("devices", [1, 2], ids=["1dev", "2dev"])  # 1: activations and gradients per feature
@on_each_isa
def test_native_agrees_with_generic(max_norm, devices):
    """Every optimizer case of CASES at once (a stack each; one compiled train step on each kernel). Width 8 on
    one device, 32 on two: the native loops for a width known only at run time, and compiled for a common one
    (16, 32, 64, 128)."""
    cases, dim = tuple((name, max_norm, "float32") for name in CASES), 8 if devices == 1 else 32
    want = _generic(cases, devices, dim=dim)
    got = _train("native", cases, make_mesh(devices), dim=dim)
    # Activations: the native forward sums a sample's rows in table-row order, the generic one in input order.
    # SGD without max_norm: the same update operations in the same order, bit for bit; otherwise a row's L2 norm
    # (max_norm) is a reduction whose order XLA chooses: a few ulps more, after 3 steps.
    state_tol = (1e-6 if max_norm is None else 1e-5, 1e-6)
    _assert_agree(got, want, {name: ((1e-6, 1e-6), None if name == "sgd" and max_norm is None else state_tol)
                              for name in CASES})


@needs_native
@pytest.mark.parametrize("dim", [16, 64, 128, 24])
@on_each_isa
def test_native_agrees_with_generic_at_every_width(dim):
    """Widths the native forward pools in registers (16, 64, 128) and one it does not (24; the others use 8): SGD,
    RowwiseAdagrad with max_norm, and Adagrad on bf16 tables, in one plan."""
    cases = (("sgd", None, "float32"), ("rowwise_adagrad", 0.4, "float32"), ("adagrad", None, "bfloat16"))
    want = _generic(cases, 2, dim=dim)
    got = _train("native", cases, make_mesh(2), dim=dim)
    # SGD: the same operations in the same order, bit for bit
    _assert_agree(got, want, {"sgd": ((1e-6, 1e-6), None), "rowwise_adagrad": ((1e-6, 1e-6),) * 2,
                              "adagrad": ((1e-2, 1e-2),) * 2})


@needs_native
def test_native_bf16_tables_agree_with_generic():
    cases = (("sgd", None, "bfloat16"), ("adagrad", None, "bfloat16"))
    want = _generic(cases, 8)
    got = _train("native", cases, make_mesh(8))
    assert got[1]["sgd_a"]["table"].dtype == jnp.bfloat16
    # bf16 rows: a 1-ulp difference in f32 may round to the neighbouring bf16 value
    _assert_agree(got, want, dict.fromkeys(("sgd", "adagrad"), ((1e-2, 1e-2),) * 2))


@needs_native
@on_each_isa
def test_native_skips_nonfinite_rows_like_generic():
    """A NaN cotangent on step 1: every touched row keeps its values on both kernels."""
    cases = tuple((name, None, "float32") for name in ("sgd", "adagrad", "adam"))
    want = _generic(cases, 2, bad_step=1)
    got = _train("native", cases, make_mesh(2), bad_step=1)
    _assert_agree(got, want, dict.fromkeys(("sgd", "adagrad", "adam"), ((1e-6, 1e-6),) * 2))
    assert all(np.isfinite(v).all() for t in got[1].values() for v in t.values())


# ---------------------------------------------------------------- instruction sets
@needs_native
def test_native_runs_on_the_best_instruction_set_under_the_cap():
    """The CPU's best instruction set, or the best at or below the cap: `capped_isa` in a block,
    `$SPARSE_EMBED_NATIVE_ISA` for a whole process (here a fresh one, capped to the baseline)."""
    assert native_cpu.isa() == isas_here()[0]
    for cap in ISAS:
        with native_cpu.capped_isa(cap) as running:
            assert running == native_cpu.isa() == next(i for i in isas_here() if ISAS.index(i) >= ISAS.index(cap))
    assert native_cpu.isa() == isas_here()[0]  # the block's cap is lifted at its end
    with pytest.raises(ValueError, match="cap_isa takes 'avx512', 'avx2', 'baseline' or None, got 'sse4'"):
        with native_cpu.capped_isa("sse4"):
            pass
    env = dict(os.environ, **{native_cpu.ISA_ENV: "baseline"})
    out = subprocess.run([sys.executable, "-c", "from sparse_embed.core.kernels import native_cpu as n; "
                          "print(n.isa())"], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["baseline"], out.stderr


_MOVES_NOTHING = {"parameter", "custom-call", "get-tuple-element", "bitcast", "tuple"}


def _entry_ops(hlo: str) -> list[tuple[str, str]]:
    """(shape, op) of each instruction of the compiled program's entry computation."""
    entry = hlo[hlo.index("ENTRY"):]
    return re.findall(r"^\s*(?:ROOT )?%\S+ = (.+?) ([a-z][\w-]*)\(", entry, re.M)


@needs_native
@pytest.mark.parametrize("placement,devices", [("row", 1), ("replicated", 2)])
def test_native_activations_and_gradients_per_feature_need_no_copy(placement, devices):
    """Where a shard's partial activations are the activations, the native forward writes each feature's into
    an array of its own and the backward reads each feature's gradient where it is: the forward program is the
    kernel call alone, and no op of the train step builds the stack's gradient array."""
    t = se.TableSpec("t", 300, 8, optimizer=opt.Adagrad(0.1))
    feats = {"a": se.FeatureSpec("a", t, 16), "s": se.FeatureSpec("s", t, 16, max_sequence_length=3)}
    plan = se.plan(feats, make_mesh(devices), kernel="native", placement=placement)
    assert plan.stacks[0].activations_per_feature
    rng = np.random.default_rng(0)
    batch, _ = se.preprocess(plan, {n: rng.integers(0, 300, (16, 4)) for n in feats})
    tables = se.init_tables(plan, jax.random.key(0))
    forward = jax.jit(lambda t, b: se.lookup(plan, b, t)).lower(tables, batch).compile().as_text()
    assert {op for _, op in _entry_ops(forward)} <= _MOVES_NOTHING | {"all-reduce"}, forward
    cts = {n: jnp.ones(f.output_shape) for n, f in feats.items()}
    def loss(tb, b, c):  # one lookup for both features
        acts = se.lookup(plan, b, tb, 0)
        return sum(jnp.sum(acts[k] * c[k]) for k in c)

    train = jax.jit(jax.grad(loss)).lower(tables, batch, cts).compile().as_text()
    rpd = plan.stacks[0].rows_per_device  # 16 + 48 rows of one device
    assert not [op for shape, op in _entry_ops(train) if f"[{rpd},8]" in shape or f"[1,{rpd},8]" in shape], train
    if devices == 1:  # nothing to exchange: no collective (XLA:CPU copies the array of a one-device all_gather)
        collectives = {"all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter"}
        assert not [op for _, op in _entry_ops(train) if op in collectives], train


# ---------------------------------------------------------------- native determinism
def _big_batch_train(threads: int, optimizer, rows: int = 5000, kernel=None):
    """Enough entries per shard (16384) for many forward and backward work chunks, with hot rows; ids < 5000."""
    t = se.TableSpec("t", rows, 16, combiner="mean", optimizer=optimizer)
    feats = {"f": se.FeatureSpec("f", t, 1024), "s": se.FeatureSpec("s", t, 1024, max_sequence_length=4)}
    plan = se.plan(feats, make_mesh(1), kernel=kernel or NativeCpuKernel(threads=threads))
    rng = np.random.default_rng(3)
    ids = {n: (rng.zipf(1.3, (1024, 8)) % 5000) for n in feats}
    batch, _ = se.preprocess(plan, ids)
    cts = {n: rng.normal(size=f.output_shape).astype(np.float32) for n, f in feats.items()}

    def loss(tables):
        acts = se.lookup(plan, batch, tables, 0)
        return sum(jnp.sum(acts[k] * cts[k]) for k in cts), acts

    tables, acts = jax.jit(jax.grad(loss, has_aux=True))(se.init_tables(plan, jax.random.key(0)))
    return jax.tree.map(np.asarray, (acts, se.unstack_state(plan, tables)))


@needs_native
@pytest.mark.parametrize("optimizer", [opt.SGD(0.1), opt.Adagrad(0.1)], ids=["sgd", "adagrad"])
@on_each_isa
def test_native_results_do_not_depend_on_the_thread_count(optimizer):
    one = _big_batch_train(1, optimizer)
    assert_trees_equal(_big_batch_train(2, optimizer), one)
    assert_trees_equal(_big_batch_train(3, optimizer), one)


@needs_native
def test_native_ids_in_a_small_part_of_a_large_table():
    """Ids in the first 5000 of 2**20 rows: the backward sorts by the bits of the ids present (it counts them
    again), with the generic kernel's results, whatever the thread count."""
    one = _big_batch_train(1, opt.Adagrad(0.1), rows=1 << 20)
    assert_trees_equal(_big_batch_train(2, opt.Adagrad(0.1), rows=1 << 20), one)
    want = _big_batch_train(0, opt.Adagrad(0.1), rows=1 << 20, kernel="generic")
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6), one, want)


@needs_native
def test_native_huge_pages_change_no_value():
    """A table over the kernel's 64 MiB threshold, seen 3+ times: Linux may back it with huge pages; no value moves."""
    t = se.TableSpec("big", 1 << 20, 24, combiner="sum", optimizer=opt.Adagrad(0.1))
    feats = {"f": se.FeatureSpec("f", t, 64)}
    rng = np.random.default_rng(0)
    batches = [se.preprocess(se.plan(feats, make_mesh(1)), {"f": rng.integers(0, 1 << 20, (64, 6))})[0]
               for _ in range(4)]
    results = []
    for huge in (False, True):
        plan = se.plan(feats, make_mesh(1), kernel=NativeCpuKernel(huge_pages=huge))
        train = jax.jit(jax.grad(lambda tb, b: jnp.sum(se.lookup(plan, b, tb, 0)["f"] ** 2)), donate_argnums=0)
        tables = se.init_tables(plan, jax.random.key(0))
        for b in batches:
            tables = train(tables, b)
        acts = se.lookup(plan, batches[0], tables)["f"]
        results.append(jax.tree.map(np.asarray, (acts, tables)))
    assert_trees_equal(results[1], results[0])


def _anon_huge_kib(lo: int, hi: int) -> int:
    """AnonHugePages (KiB) of this process's mappings in [lo, hi) (from /proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                inside = int(head[1], 16) < hi and lo < int(head[2], 16)
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


@needs_native
@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_native_huge_pages_back_a_new_table_at_a_freed_tables_address():
    """The kernel asks Linux for huge pages once per buffer; a table freed and a new one allocated at its
    address (a fresh mapping, on small pages) is noticed and backed too. Skipped where Linux gives none."""
    t = se.TableSpec("big", 1 << 20, 32, combiner="sum", optimizer=opt.SGD(0.1))  # 128 MiB
    plan = se.plan({"f": se.FeatureSpec("f", t, 64)}, make_mesh(1), kernel=NativeCpuKernel(huge_pages=True))
    batch = se.preprocess(plan, {"f": np.arange(128).reshape(64, 2)})[0]
    train = jax.jit(jax.grad(lambda tb, b: jnp.sum(se.lookup(plan, b, tb, 0)["f"] ** 2)), donate_argnums=0)

    def trained_table(seed):
        tables = se.init_tables(plan, jax.random.key(seed))
        for _ in range(12):
            tables = train(tables, batch)
        return jax.block_until_ready(max(jax.tree.leaves(tables), key=lambda x: x.nbytes))

    seen = set()
    for seed in range(8):  # new tables until one lands where an earlier one was
        table = trained_table(seed)
        address = table.unsafe_buffer_pointer()
        huge = _anon_huge_kib(address, address + table.nbytes)
        if not seen and huge == 0:
            pytest.skip("Linux backs no table with huge pages here (THP off, or no MADV_COLLAPSE)")
        if address in seen:
            assert huge > 0
            return
        seen.add(address)
        del table
    pytest.skip("the allocator placed no new table at a freed table's address")


@needs_native
@pytest.mark.parametrize("dim", [64, 8])
@pytest.mark.parametrize("order", ["sorted", "unsorted"])
@pytest.mark.parametrize("blocks", [False, True])
@on_each_isa
def test_native_forward_of_any_entry_order_matches_numpy(dim, order, blocks):
    """The per-shard forward on hand-made entries: rows in order (chunks own row ranges, rows without entries
    are zero) or shuffled (one chunk, a row's entries in several runs), with padding, against numpy; written
    in one array or in blocks of rows of uneven sizes (one array each)."""
    t = se.TableSpec("t", 300, dim)
    plan = se.plan({"f": se.FeatureSpec("f", t, 16)}, make_mesh(2), kernel="native")
    stack = kernel_stack(plan.stacks[0])
    D, rpd, R = stack.num_shards, stack.rows_per_device, stack.rows_per_shard
    if blocks:
        stack = dataclasses.replace(stack, out_blocks=(1, rpd // 3, rpd - rpd // 3 - 1))
    rng = np.random.default_rng(7)
    C = 20_000  # several forward chunks per segment

    def forward(t, rec):
        partials = NativeCpuKernel().forward(stack, rec, t).partials
        assert isinstance(partials, tuple) == blocks
        if blocks:
            assert [p.shape for p in partials] == [(D, n, dim) for n in stack.out_blocks]
        return jnp.concatenate(partials, axis=1) if blocks else partials

    forward = jax.jit(forward)
    for i in range(3):  # a later call may get an output buffer that still holds an earlier call's values
        cols = rng.integers(0, R, (D, C)).astype(np.int32)
        rows = np.sort(rng.integers(0, rpd // 2, (D, C)), axis=1).astype(np.int32) * 2 + i % 2  # half the rows empty
        vals = rng.normal(size=(D, C)).astype(np.float32)
        cols[:, -50:], rows[:, -50:], vals[:, -50:] = R, rpd, 0.0  # padding at the end of each segment
        if order == "unsorted":
            perm = rng.permutation(C)
            cols, rows, vals = cols[:, perm], rows[:, perm], vals[:, perm]
        table = rng.normal(size=(R, dim)).astype(np.float32)
        got = np.asarray(forward(jnp.asarray(table), kernels.Received(*map(jnp.asarray, (cols, rows, vals)))))
        want = np.zeros((D, rpd, dim), np.float64)
        for d in range(D):
            ok = rows[d] < rpd
            np.add.at(want[d], rows[d][ok], table[cols[d][ok]].astype(np.float64) * vals[d][ok, None])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        assert not got[:, 1 - i % 2::2].any()  # rows without entries are zero
