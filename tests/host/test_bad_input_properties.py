"""Property-based: random malformed input gets a ValueError that names what is wrong, and nothing else.

`preprocess`: each example takes a good batch for a plan with a pooled, a
sequence and a raw-id feature (2 devices) and spoils one feature's ids or
weights, or the set of features: random nesting, ragged rows of any depth,
weights shaped unlike the ids, wrong dtypes (floats, strings, objects, bools,
complex), values past int64, NaN/inf weights, wrong batch sizes. Some random
input is valid, so it may be accepted; if not, the error must be a
`ValueError` that names the feature (numpy's errors, a `KeyError`, an
`OverflowError` or a warning, an exception under pytest's `-W error`, fail).

`map_ids`: a batch of another plan (same table names, but static and
auto-stacked, or unstacked, or on another mesh), or this plan's batch with a
stack dropped, renamed or added, its keys gone, or one array reshaped or
retyped, must raise a `ValueError` naming the stack. Derandomized, so CI
always runs the same examples; both tests take a few seconds.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import sparse_embed as se
from sparse_embed.host import native
from conftest import make_mesh

B = 4  # samples per feature
HUGE = [2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 2**100]
SCALARS = st.one_of(
    st.integers(-2, 25), st.sampled_from(HUGE), st.floats(), st.booleans(),
    st.complex_numbers(max_magnitude=1e3, allow_nan=False), st.text(max_size=2), st.none(), st.builds(object),
)
# Python structures of any depth and raggedness: lists and tuples of scalars, lists, tuples and small arrays.
NESTED = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=B + 1) | st.tuples(inner, inner)
                      | st.lists(st.integers(0, 5), max_size=3).map(np.array), max_leaves=12)
DTYPES = [np.int8, np.int32, np.int64, np.uint32, np.uint64, np.float16, np.float32, np.float64, np.bool_,
          np.complex64, np.dtype("U2"), np.dtype(object)]
SIZES = [0, 1, 2, B - 1, B, B + 1, 2 * B]


@st.composite
def arrays(draw, max_rank: int = 3) -> np.ndarray:
    """A numpy array of any dtype (extreme values included), rank 0 to `max_rank`, of small sizes."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = tuple(draw(st.lists(st.sampled_from(SIZES), max_size=max_rank)))
    elements = SCALARS if dtype == object else None
    return draw(hnp.arrays(dtype, shape, elements=elements))


def anything(max_rank: int = 3):
    return st.one_of(arrays(max_rank), NESTED)


VOCAB = 20  # of the static table; the raw-id table takes any id in [0, 2**63)
NON_FINITE = [np.nan, np.inf, -np.inf, 1e300, "x", None, 1j]  # never a valid weight (1e300: inf as float32)


def _out_of_range(name: str, value: int) -> bool:
    return value < -1 or value > 2**63 - 1 or (name != "user" and value >= VOCAB)


@st.composite
def ids_like(draw, name: str) -> tuple:
    """(one feature's ids in some format, most of them malformed; whether preprocess must refuse them)."""
    kind = draw(st.sampled_from(["dense", "extreme_value", "extreme_value", "list", "list", "pair", "tuple", "any"]))
    n = draw(st.sampled_from([B - 1, B, B, B, B + 1, 2 * B]))
    if kind == "extreme_value":  # good ids but one extreme value, in a dtype that holds it (or a Python list)
        a = np.ones((n, 2), object)
        value = draw(st.sampled_from(HUGE + [-1, -2, VOCAB - 1, VOCAB]))
        a[draw(st.integers(0, n - 1)), draw(st.integers(0, 1))] = value
        try:
            ids = np.array(a.tolist(), draw(st.sampled_from([np.int64, np.uint64, object, None])))
        except OverflowError:
            ids = a.tolist()
        return ids, _out_of_range(name, value) or n != B
    if kind == "dense":
        return draw(arrays()), False
    if kind == "list":  # rows of any depth
        return draw(st.lists(st.one_of(anything(2), st.just(np.array([1, 2]))), min_size=n, max_size=n)), False
    if kind == "pair":
        return (draw(anything(2)), draw(st.one_of(anything(2), st.just(np.ones(n, np.int64))))), False
    if kind == "tuple":
        return tuple(draw(st.lists(anything(1), max_size=3))), False
    return draw(anything()), False


@st.composite
def weights_for(draw, ids) -> tuple:
    """(weights that mirror the ids' structure with one thing wrong, or anything; whether that must fail if the
    ids are good)."""
    kind = draw(st.sampled_from(["non_finite", "non_finite", "shape", "any"]))
    bad = draw(st.sampled_from(NON_FINITE))
    if kind == "non_finite" and isinstance(ids, np.ndarray) and ids.size:
        w = np.ones(ids.shape, object)
        w.flat[draw(st.integers(0, ids.size - 1))] = bad
        try:
            return w.astype(np.float64), True
        except (ValueError, TypeError):
            return w.tolist(), True
    if kind == "non_finite" and isinstance(ids, list) and ids and all(_has_shape(r) for r in ids):
        return [np.full(np.shape(r), bad, object).tolist() if i == 0 else np.ones(np.shape(r))
                for i, r in enumerate(ids)], np.size(ids[0]) > 0
    if kind == "shape" and _has_shape(ids) and np.ndim(ids):
        shape = np.shape(ids)
        return np.ones((*shape[:-1], shape[-1] + 1)), True
    return draw(anything()), False


def _has_shape(x) -> bool:
    try:
        np.shape(x)
        return True
    except ValueError:
        return False


@functools.cache
def _plan() -> se.EmbeddingPlan:
    t = se.TableSpec("tbl", VOCAB, 4, combiner="mean")
    users = se.TableSpec("users", 50, 4, combiner="mean", dynamic=se.Dynamic())
    return se.plan([se.FeatureSpec("bag", t, B), se.FeatureSpec("seq", t, B, max_sequence_length=2),
                    se.FeatureSpec("user", users, B)], make_mesh(2))


def _good() -> tuple[dict, dict]:
    ids = {"bag": np.ones((B, 2), np.int64), "seq": [np.array([1, 2])] * B, "user": np.arange(B) * 2**40}
    return ids, {"bag": np.ones((B, 2)), "seq": [np.ones(2)] * B, "user": np.ones(B)}


@st.composite
def spoiled_inputs(draw) -> tuple:
    """(ids, weights, the name the error must carry, whether preprocess must refuse them): one feature's ids or
    weights spoiled, or a feature missing or added."""
    ids, weights = _good()
    name = draw(st.sampled_from(sorted(ids)))
    what = draw(st.sampled_from(["ids", "ids", "weights", "weights", "both", "missing", "extra"]))
    if what == "missing":  # from the ids (an error) or from the weights (all 1)
        from_ids = draw(st.booleans())
        del (ids if from_ids else weights)[name]
        return ids, weights, name, from_ids
    if what == "extra":
        draw(st.sampled_from([ids, weights]))["extra"] = draw(ids_like("extra"))[0]
        return ids, weights, "extra", True
    must_fail = False
    if what in ("ids", "both"):
        ids[name], must_fail = draw(ids_like(name))
    if what in ("weights", "both"):
        weights[name], bad_weights = draw(weights_for(ids[name]))
        must_fail |= bad_weights and what == "weights"
    return ids, weights if what != "ids" else None, name, must_fail


def _preprocess(ids, weights, native_path: bool) -> str | None:
    """None if `preprocess` accepts the input on that path (C or numpy), else its ValueError's message."""
    old = os.environ.get(native.ENV)
    os.environ[native.ENV] = "1" if native_path else "0"
    try:
        se.preprocess(_plan(), ids, weights, device_put=False)
        return None
    except ValueError as e:
        return str(e)
    finally:
        os.environ.pop(native.ENV) if old is None else os.environ.__setitem__(native.ENV, old)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(spoiled_inputs())
def test_preprocess_names_the_feature_of_any_malformed_input(case):
    """On the C path and the numpy path alike, with the same message."""
    ids, weights, name, must_fail = case
    paths = [True, False] if native.extension() is not None else [False]
    got = [_preprocess(ids, weights, p) for p in paths]
    assert got[0] == got[-1], f"the C and the numpy path differ: {got}"
    msg = got[0]
    if msg is None:
        assert not must_fail, f"accepted: feature {name!r}: ids {ids.get(name)!r}, weights {weights}"
    else:
        assert msg.startswith(f"Feature {name!r} (table ") or (
            "features" in msg and repr(name) in msg), f"the error does not name feature {name!r}: {msg}"


# ---------------------------------------------------------------- map_ids on a batch that is not this plan's
@functools.cache
def _batches() -> dict[str, dict]:
    """Batches of the raw-id plan and of plans with the same table names that `map_ids` must refuse."""
    plan, ids = _plan(), {**_good()[0], "user": np.arange(B)}  # ids any of the plans takes
    static = [dataclasses.replace(f, table=dataclasses.replace(f.table, dynamic=None)) for f in plan.features.values()]
    others = {
        "static_auto_stacked": se.plan(static, plan.mesh),
        "static_unstacked": se.plan(static, plan.mesh, stacking=None),
        "one_device": se.plan(list(plan.features.values()), make_mesh(1)),
    }
    assert others["static_auto_stacked"].stack_names == ("tbl_users",)
    out = {k: se.preprocess(p, ids, device_put=False)[0] for k, p in others.items()}
    return {"own": se.preprocess(plan, ids, device_put=False)[0], **out}


@st.composite
def foreign_batches(draw):
    batches = _batches()
    source = draw(st.sampled_from(sorted(batches)))
    batch = dict(batches[source])
    if source != "own":
        return batch
    change = draw(st.sampled_from(["drop", "rename", "add", "no_keys", "reshape", "retype", "swap"]))
    stack = draw(st.sampled_from(sorted(batch)))
    if change == "drop":
        del batch[stack]
    elif change == "rename":
        batch[stack.upper()] = batch.pop(stack)
    elif change == "add":
        batch["tbl_users"] = batch[stack]
    elif change == "swap":  # another plan's entry under this plan's name
        other = batches[draw(st.sampled_from(["static_unstacked", "one_device"]))]
        batch["users"] = other["users"]
    else:
        coo = batch["users"]
        field = draw(st.sampled_from(["shard_starts", "shard_ends", "col_ids", "row_ids", "values", "keys"]))
        x = getattr(coo, field)
        if change == "no_keys":
            coo = se.ShardedCooMatrix(*coo[:5])
        elif change == "reshape":
            coo = coo._replace(**{field: x[..., :-1] if draw(st.booleans()) else x[:1]})
        else:
            coo = coo._replace(**{field: x.astype(draw(st.sampled_from([np.int64, np.float32, np.int16, np.float64]))
                                                  if x.dtype != np.float32 else np.int32)})
        batch["users"] = coo
    return batch


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(foreign_batches())
def test_map_ids_names_the_stack_of_a_batch_built_by_another_plan(batch):
    plan = _plan()
    tables, maps = _state()
    with pytest.raises(ValueError) as e:
        se.map_ids(plan, batch, tables, maps, 0)
    msg = str(e.value)
    assert msg.startswith("Stack 'users'") or ("batch has stacks" in msg and "built by another plan" in msg), msg


@functools.cache
def _state():
    plan = _plan()
    return se.init_tables(plan, jax.random.key(0)), se.init_id_maps(plan, jax.random.key(0))


def test_map_ids_takes_this_plans_batch():
    """The checks refuse nothing of this plan's own: its batch maps (numpy arrays or placed on the mesh)."""
    plan, (ids, weights) = _plan(), _good()
    tables, maps = _state()
    for batch in (_batches()["own"], se.preprocess(plan, ids, weights)[0]):
        mapped, *_ = se.map_ids(plan, batch, tables, maps, 0)
        assert type(mapped["users"]) is se.ShardedCooMatrix
