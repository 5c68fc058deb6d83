"""The table store: streamed chunk by chunk, against plain numpy arrays and tensorstore's own reads of the files."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts

import sparse_embed as se
from sparse_embed.core.tables import empty_tables
from sparse_embed.io import store
from conftest import make_mesh
from test_integrity import reference_checksum


def _plan(devices: int, stacking="auto", vocab=(1000, 37, 301)):
    a = se.TableSpec("users", vocab[0], 8, optimizer=se.optimizers.Adam(0.1))
    b = se.TableSpec("items", vocab[1], 8, optimizer=se.optimizers.Adam(0.1))
    c = se.TableSpec("ctx", vocab[2], 4, dtype=jnp.bfloat16)
    return se.plan([se.FeatureSpec("u", a, 8), se.FeatureSpec("i", b, 8), se.FeatureSpec("c", c, 8)],
                   make_mesh(devices), stacking=stacking)


def _random_state(plan, seed=0):
    rng = np.random.default_rng(seed)
    tables = {n: rng.standard_normal((t.vocabulary_size, t.embedding_dim)).astype(np.float32)
              for n, t in plan.tables.items()}
    slots = {n: {k: rng.standard_normal((t.vocabulary_size, s.width)).astype(np.float32)
                 for k, s in t.resolved_optimizer.slots(t.embedding_dim).items()} for n, t in plan.tables.items()}
    state = se.stack_tables(plan, tables, slots)
    return state, se.unstack_state(plan, state)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(store, "CHUNK_BYTES", 512)  # many chunks, and a last partial one


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_written_arrays_are_the_tables_in_id_order(tmp_path, small_chunks, devices):
    plan = _plan(devices)
    state, want = _random_state(plan)
    sums = store.write_state(str(tmp_path), plan, state)
    for name, keys in want.items():
        for key, a in keys.items():
            path = store.array_path(str(tmp_path), name, key)
            got = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}).result().read().result()
            assert got.dtype == a.dtype and got.shape == a.shape
            np.testing.assert_array_equal(got, a)
            assert sums[f"{name}/{key}"] == f"{reference_checksum(a)} {a.dtype} {a.shape}"  # bound: dtype, shape


@pytest.mark.parametrize("saved, restored", [(8, 1), (1, 8), (2, 8), (8, 2)])
def test_restore_onto_any_mesh_and_stacking_is_exact(tmp_path, small_chunks, saved, restored):
    plan = _plan(saved)
    state, want = _random_state(plan, seed=saved)
    sums = store.write_state(str(tmp_path), plan, state)
    for stacking in ("auto", [["users"], ["items"], ["ctx"]]):
        target = _plan(restored, stacking)
        valid = {n: t.vocabulary_size for n, t in target.tables.items()}
        got, got_sums = store.read_into_state(str(tmp_path), target, empty_tables(target), valid)
        assert got_sums == sums
        _assert_state(se.unstack_state(target, got), want)
        for v in got.values():
            assert v.table.sharding == target.table_sharding()


def test_a_larger_vocabulary_keeps_the_initial_values_of_the_new_rows(tmp_path, small_chunks):
    plan = _plan(2)
    state, want = _random_state(plan)
    store.write_state(str(tmp_path), plan, state)
    bigger = _plan(8, vocab=(1500, 40, 400))
    fresh = se.init_tables(bigger, jax.random.key(3))
    expected = se.unstack_state(bigger, fresh)
    valid = {n: t.vocabulary_size for n, t in plan.tables.items()}
    got, _ = store.read_into_state(str(tmp_path), bigger, fresh, valid)
    got = se.unstack_state(bigger, got)
    for name, keys in want.items():
        for key, a in keys.items():
            np.testing.assert_array_equal(got[name][key][: len(a)], a)
            np.testing.assert_array_equal(got[name][key][len(a):], expected[name][key][len(a):])


def test_a_missing_or_wrong_array_is_named(tmp_path, small_chunks):
    plan = _plan(2)
    state, _ = _random_state(plan)
    store.write_state(str(tmp_path), plan, state)
    valid = {n: t.vocabulary_size for n, t in plan.tables.items()}
    other = _plan(2, vocab=(2000, 37, 301))  # more rows than stored, none of them declared new
    with pytest.raises(store.StoreReadError) as e:
        store.read_into_state(str(tmp_path), other, empty_tables(other), {**valid, "users": 2000})
    assert e.value.array == ("users", "table")
    slot = sorted(plan.tables["items"].resolved_optimizer.slots(8))[-1]
    shutil.rmtree(store.array_path(str(tmp_path), "items", slot))
    with pytest.raises(store.StoreReadError) as e:
        store.read_into_state(str(tmp_path), plan, empty_tables(plan), valid)
    assert e.value.array == ("items", slot)


def _assert_state(got, want):
    for name, keys in want.items():
        for key, a in keys.items():
            np.testing.assert_array_equal(np.asarray(got[name][key]), a, err_msg=f"{name}/{key}")
