"""Specs and plan(): validation, stacking, hashing."""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import sparse_embed as se
from sparse_embed import optimizers as opt
from conftest import devices as conftest_devices, make_mesh


def _t(name="t", vocab=10, dim=4, **kw):
    return se.TableSpec(name, vocab, dim, **kw)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(vocabulary_size=0), "vocabulary_size must be a positive int"),
        (dict(embedding_dim=2.5), "embedding_dim must be a positive int"),
        (dict(combiner="max"), "combiner must be one of"),
        (dict(max_norm=-1.0), "max_norm must be > 0"),
        (dict(dtype=np.int32), "dtype must be a float dtype"),
    ],
)
def test_table_spec_validation(kwargs, match):
    args = dict(name="tbl", vocabulary_size=10, embedding_dim=4) | kwargs
    with pytest.raises(ValueError, match=f"'tbl'.*{match}"):
        se.TableSpec(**args)


@pytest.mark.parametrize("max_norm", [True, "2", (1.0,), np.bool_(True)])
def test_max_norm_that_is_not_a_number_is_refused(max_norm):
    with pytest.raises(TypeError, match=r"Table 'tbl': max_norm must be a number .* or None, got"):
        se.TableSpec("tbl", 10, 4, max_norm=max_norm)
    for ok in [2, np.float32(0.5), jax.numpy.float32(3.0)]:  # numbers of any kind: taken as floats
        assert se.TableSpec("tbl", 10, 4, max_norm=ok).max_norm == float(ok)


@pytest.mark.parametrize("name", [".", "..", "a/../b", "a//b", "/a", "a/", "a\0b"])
def test_a_table_name_that_cannot_be_a_directory_is_refused(name):
    """A table is a directory of its checkpoints: "." and ".." failed in tensorstore after the save had started
    ("Invalid file path"), and "a/../b" would have written into table "b"'s directory."""
    with pytest.raises(ValueError, match=f"Table name {re.escape(repr(name))} cannot name a directory"):
        se.TableSpec(name, 10, 4)
    se.TableSpec(name.replace("..", "x").replace(".", "y").strip("/").replace("//", "/").replace("\0", "_"), 10, 4)


def test_table_spec_rejects_optax_transform():
    with pytest.raises(TypeError, match="'tbl'.*sparse_embed.optimizers"):
        se.TableSpec("tbl", 10, 4, optimizer=optax.adam(0.1))
    with pytest.raises(TypeError, match="'tbl': initializer must be a function f\\(key, shape, dtype\\)"):
        se.TableSpec("tbl", 10, 4, initializer="normal")  # (it failed only in init_tables: 'str' is not callable)


def test_optimizer_validation():
    with pytest.raises(TypeError, match="learning_rate"):
        opt.SGD("fast")
    with pytest.raises(ValueError, match="initial_accumulator_value"):
        opt.Adagrad(0.1, initial_accumulator_value=0.0)


def test_feature_spec_validation():
    with pytest.raises(ValueError, match="'f'.*batch_size"):
        se.FeatureSpec("f", _t(), 0)
    with pytest.raises(ValueError, match="'f'.*max_sequence_length"):
        se.FeatureSpec("f", _t(), 8, max_sequence_length=-1)
    with pytest.raises(TypeError, match="'f'.*TableSpec"):
        se.FeatureSpec("f", "t", 8)


def test_specs_are_hashable_and_compare_by_value():
    assert _t(optimizer=opt.Adagrad(0.1)) == _t(optimizer=opt.Adagrad(0.1))
    assert hash(_t(optimizer=opt.SGD(0.1))) == hash(_t(optimizer=opt.SGD(0.1)))
    assert _t(optimizer=opt.SGD(0.1)) != _t(optimizer=opt.Adagrad(0.1))
    f = se.FeatureSpec("f", _t(), 8)
    assert f.output_shape == (8, 4)
    assert se.FeatureSpec("f", _t(), 8, max_sequence_length=3).output_shape == (8, 3, 4)


def test_plan_is_a_valid_static_jit_argument(mesh8):
    feats = {"f": se.FeatureSpec("f", _t(), 8)}
    p1, p2 = se.plan(feats, mesh8), se.plan(feats, mesh8)
    assert p1 == p2 and hash(p1) == hash(p2)
    f = jax.jit(lambda p, x: x + p.num_shards, static_argnums=0)
    assert int(f(p1, 1)) == 9 and int(f(p2, 1)) == 9
    assert f._cache_size() == 1


def test_auto_stacking_separates_incompatible_tables(mesh8):
    feats = {
        "f1": se.FeatureSpec("f1", _t("a", optimizer=opt.SGD(0.1)), 8),
        "f2": se.FeatureSpec("f2", _t("b", optimizer=opt.SGD(0.1)), 8),
        "f3": se.FeatureSpec("f3", _t("c", optimizer=opt.Adagrad(0.1)), 8),
        "f4": se.FeatureSpec("f4", _t("d", dim=8), 8),
        "f5": se.FeatureSpec("f5", _t("e", combiner="sum"), 8),
        "f6": se.FeatureSpec("f6", _t("g", max_norm=1.0), 8),
    }
    assert set(se.plan(feats, mesh8).stack_names) == {"a_b", "c", "d", "e", "g"}


def test_plan_layout(mesh8):
    a, b = _t("a", vocab=10), _t("b", vocab=17)
    feats = {"x": se.FeatureSpec("x", a, 16), "y": se.FeatureSpec("y", b, 8, max_sequence_length=3)}
    p = se.plan(feats, mesh8)
    (s,) = p.stacks
    assert [(t.table.name, t.row_offset, t.padded_rows) for t in s.tables] == [("a", 0, 16), ("b", 16, 24)]
    assert s.rows_per_shard == 5 and s.total_rows == 40
    assert [(f.feature.name, f.row_offset, f.rows_per_device) for f in s.features] == [("x", 0, 2), ("y", 2, 3)]
    assert s.rows_per_device == 5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(stacking=[["a", "c"]]), r"Tables 'a' and 'c' cannot be stacked: optimizer"),
        (dict(stacking=[["a", "zz"]]), "table 'zz', which no feature reads"),
        (dict(stacking=[["a", "b"], ["a"]]), "names table 'a' more than once"),
        (dict(stacking="all"), "stacking must be"),
        (dict(stacking=["a", "b"]), "list of lists"),
        (dict(capacity={"nope": 8}), r"capacity names unknown stacks \['nope'\]"),
        (dict(capacity=0), "capacity must be a positive int"),
        (dict(on_overflow="ignore"), "on_overflow must be one of"),
        (dict(nonfinite_gradients="zero"), r"nonfinite_gradients must be one of \('skip', 'apply'\)"),
        (dict(axis_name="y"), "axis_name 'y' is not an axis"),
    ],
)
def test_plan_errors(mesh8, kwargs, match):
    feats = {
        "fa": se.FeatureSpec("fa", _t("a"), 8),
        "fb": se.FeatureSpec("fb", _t("b"), 8),
        "fc": se.FeatureSpec("fc", _t("c", optimizer=opt.Adagrad(0.1)), 8),
    }
    with pytest.raises(ValueError, match=match):
        se.plan(feats, mesh8, **kwargs)


def test_batch_size_must_divide_over_devices(mesh8):
    with pytest.raises(ValueError, match=r"Feature 'odd': batch_size 12 does not divide evenly over the 8 devices"):
        se.plan({"odd": se.FeatureSpec("odd", _t(), 12)}, mesh8)


def test_plan_input_errors(mesh8):
    with pytest.raises(ValueError, match="differs from its FeatureSpec name"):
        se.plan({"x": se.FeatureSpec("f", _t(), 8)}, mesh8)
    with pytest.raises(ValueError, match="Two different tables are named 't'"):
        se.plan([se.FeatureSpec("f", _t(), 8), se.FeatureSpec("g", _t(vocab=11), 8)], mesh8)
    with pytest.raises(ValueError, match="at least one"):
        se.plan({}, mesh8)
    with pytest.raises(TypeError, match="Mesh"):
        se.plan({"f": se.FeatureSpec("f", _t(), 8)}, "mesh")


def test_two_axis_mesh_needs_axis_name():
    devices = conftest_devices(8).reshape(2, 4)
    mesh = Mesh(devices, ("data", "model"))
    feats = {"f": se.FeatureSpec("f", _t(), 8)}
    with pytest.raises(ValueError, match="pass axis_name"):
        se.plan(feats, mesh)
    assert se.plan(feats, mesh, axis_name="model").num_shards == 4


def test_an_explicit_mesh_axis_is_refused_at_plan_time():
    """jax.make_mesh's axes are Explicit by default: init_tables failed with a jax error about sharding
    constraints; the plan names the axis and the fix. Another axis may be Explicit; an Auto one trains."""
    feats = {"f": se.FeatureSpec("f", _t(), 8)}
    devices = conftest_devices(8)
    explicit, auto = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto
    with pytest.raises(ValueError, match=r"The mesh's axis 'd' is Explicit: .* axis_types=\(jax.sharding.AxisType.Auto"):
        se.plan(feats, Mesh(devices, ("d",), axis_types=(explicit,)))
    mesh = Mesh(devices.reshape(2, 4), ("data", "model"), axis_types=(explicit, auto))
    plan = se.plan(feats, mesh, axis_name="model")
    batch = se.preprocess(plan, {"f": np.arange(8)})[0]
    assert se.lookup(plan, batch, se.init_tables(plan, jax.random.key(0)))["f"].shape == (8, 4)


def test_replicas_over_the_other_axes_must_be_in_one_process():
    """A 2-D mesh whose other axis spans processes: each process would train its replica on its own samples (the
    copies diverged silently on 2 processes); one whose other axis stays in a process is fine."""
    from types import SimpleNamespace

    from sparse_embed.core.planning import check_replicas_in_one_process

    def devices(process_of):  # [data=2, model=2]
        return np.array([[SimpleNamespace(process_index=process_of(i, j)) for j in range(2)] for i in range(2)])

    check_replicas_in_one_process(devices(lambda i, j: i), ("data", "model"), "data")  # replicas in one process
    check_replicas_in_one_process(devices(lambda i, j: 0), ("data", "model"), "model")
    with pytest.raises(ValueError, match=r"The mesh's axes \['data'\] besides the plan's axis 'model' span several "
                                         "processes"):
        check_replicas_in_one_process(devices(lambda i, j: i), ("data", "model"), "model")


def test_default_mesh_uses_all_devices():
    p = se.plan({"f": se.FeatureSpec("f", _t(), 8)})
    assert p.num_shards == len(jax.devices()) == make_mesh(8).size


def test_plan_repr_is_a_short_summary(mesh8):
    t, u = _t("t"), _t("u", optimizer=opt.Adam(0.1))
    p = se.plan({"a": se.FeatureSpec("a", t, 8), "s": se.FeatureSpec("s", t, 8, max_sequence_length=3),
                 "b": se.FeatureSpec("b", u, 8)}, mesh8, capacity={"u": 64})
    text = repr(p)
    assert text.splitlines() == [
        "EmbeddingPlan(8 shards on mesh axis 'x', on_overflow='error')",
        "  stack 't': [16, 4] SGD, tables t[10]; features a, s[seq 3]; capacity auto",
        "  stack 'u': [16, 4] Adam, tables u[10]; features b; capacity 64",
    ]


@pytest.mark.parametrize("needed", [1, 14, 100, 5_000, 655_360])
def test_auto_capacity_headroom(needed):
    from sparse_embed.host.plan_state import auto_capacity_for

    cap = auto_capacity_for(needed)
    assert cap % 8 == 0 and cap >= needed + max(0.1 * needed, 3 * needed**0.5)
    assert cap <= 1.3 * needed + 64  # coarse grid, but not wasteful
    assert auto_capacity_for(needed, bound=needed) == -(-needed // 8) * 8  # no room past the bound
    assert auto_capacity_for(needed, bound=10 * needed) == cap  # a bound far off changes nothing
