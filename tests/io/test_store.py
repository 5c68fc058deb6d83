"""The table store: streamed chunk by chunk, against plain numpy arrays and tensorstore's own reads of the files.

A restore reads through one of two paths (`io.direct` on CPU into a state it owns, else tensorstore and a
compiled relayout): each restore test runs both.
"""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts

import sparse_embed as se
from sparse_embed.core.tables import empty_tables
from sparse_embed.io import direct, store
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


@pytest.fixture(params=["direct", "general"])
def read_path(request, monkeypatch):
    """Which path `read_into_state(..., owned=True)` takes; "direct" asserts that it was taken."""
    if request.param == "general":
        monkeypatch.setattr(direct, "ENABLED", False)
        yield request.param
        return
    calls = []
    monkeypatch.setattr(direct, "read_table", lambda *a, _f=direct.read_table: calls.append(1) or _f(*a))
    yield request.param
    assert calls, "the direct path was not taken"


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
def test_restore_onto_any_mesh_and_stacking_is_exact(tmp_path, small_chunks, read_path, saved, restored):
    plan = _plan(saved)
    state, want = _random_state(plan, seed=saved)
    sums = store.write_state(str(tmp_path), plan, state)
    for stacking in ("auto", [["users"], ["items"], ["ctx"]]):
        target = _plan(restored, stacking)
        valid = {n: t.vocabulary_size for n, t in target.tables.items()}
        got, got_sums = store.read_into_state(str(tmp_path), target, empty_tables(target), valid, owned=True)
        assert got_sums == sums
        _assert_state(se.unstack_state(target, got), want)
        for v in got.values():
            assert v.table.sharding == target.table_sharding()


@pytest.mark.parametrize("saved, restored", [(2, 1), (1, 8), (8, 2)])
def test_an_unwritten_state_ends_as_empty_tables_would_every_row_and_padding(tmp_path, small_chunks, saved,
                                                                             restored):
    """`direct.new_state` (buffers XLA allocates and nothing writes; here filled with NaN first) restored with
    `initialized=False` equals empty_tables restored through the general path, bit for bit, padding rows and
    slots' initial values (Adagrad's 0.1) included."""
    def plan_of(devices, stacking="auto"):
        a = se.TableSpec("users", 1000, 8, optimizer=se.optimizers.Adagrad(0.1, initial_accumulator_value=0.1))
        b = se.TableSpec("items", 37, 8, optimizer=se.optimizers.Adagrad(0.1, initial_accumulator_value=0.1))
        c = se.TableSpec("ctx", 301, 4, dtype=jnp.bfloat16)
        return se.plan([se.FeatureSpec("u", a, 8), se.FeatureSpec("i", b, 8), se.FeatureSpec("c", c, 8)],
                       make_mesh(devices), stacking=stacking)

    plan = plan_of(saved)
    state, want = _random_state(plan, seed=saved)
    sums = store.write_state(str(tmp_path), plan, state)
    for stacking in ("auto", [["users"], ["items"], ["ctx"]]):
        target = plan_of(restored, stacking)
        valid = {n: t.vocabulary_size for n, t in target.tables.items()}
        fresh = direct.new_state(target)
        assert fresh is not None
        for v in fresh.values():
            for a in (v.table, *v.slots.values()):
                for _, view in direct.device_views(a):
                    view.view(np.uint8)[...] = 0xFF  # NaN: whatever the memory held
        got, got_sums = store.read_into_state(str(tmp_path), target, fresh, valid, owned=True, initialized=False)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(direct, "ENABLED", False)
            ref, ref_sums = store.read_into_state(str(tmp_path), target, empty_tables(target), valid, owned=True)
        assert got_sums == ref_sums == sums
        for name in ref:
            for a, b in [(got[name].table, ref[name].table)] + [(got[name].slots[k], ref[name].slots[k])
                                                                  for k in ref[name].slots]:
                assert a.sharding == b.sharding == target.table_sharding()
                np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
        _assert_state(se.unstack_state(target, got), want)


@pytest.mark.parametrize("devices", [1, 8])
def test_a_larger_vocabulary_keeps_the_initial_values_of_the_new_rows(tmp_path, small_chunks, read_path, devices):
    plan = _plan(2)
    state, want = _random_state(plan)
    store.write_state(str(tmp_path), plan, state)
    bigger = _plan(devices, vocab=(1500, 40, 400))
    expected = se.unstack_state(bigger, se.init_tables(bigger, jax.random.key(3)))
    valid = {n: t.vocabulary_size for n, t in plan.tables.items()}
    got, _ = store.read_into_state(str(tmp_path), bigger, se.init_tables(bigger, jax.random.key(3)), valid, owned=True)
    got = se.unstack_state(bigger, got)
    for name, keys in want.items():
        for key, a in keys.items():
            np.testing.assert_array_equal(got[name][key][: len(a)], a)
            np.testing.assert_array_equal(got[name][key][len(a):], expected[name][key][len(a):])


def test_a_missing_or_wrong_array_is_named(tmp_path, small_chunks, read_path):
    plan = _plan(2)
    state, _ = _random_state(plan)
    store.write_state(str(tmp_path), plan, state)
    valid = {n: t.vocabulary_size for n, t in plan.tables.items()}
    other = _plan(2, vocab=(2000, 37, 301))  # more rows than stored, none of them declared new
    with pytest.raises(store.StoreReadError) as e:
        store.read_into_state(str(tmp_path), other, empty_tables(other), {**valid, "users": 2000}, owned=True)
    assert e.value.array == ("users", "table")
    store.read_into_state(str(tmp_path), plan, empty_tables(plan), valid, owned=True)  # for read_path's check
    slot = sorted(plan.tables["items"].resolved_optimizer.slots(8))[-1]
    shutil.rmtree(store.array_path(str(tmp_path), "items", slot))
    with pytest.raises(store.StoreReadError) as e:
        store.read_into_state(str(tmp_path), plan, empty_tables(plan), valid, owned=True)
    assert e.value.array == ("items", slot)


def _chunk_file(directory, name, key, i):
    return os.path.join(store.array_path(str(directory), name, key), "c", str(i), "0")


@pytest.mark.parametrize("devices", [1, 2])
def test_a_damaged_chunk_file_fails_to_read_and_a_missing_one_reads_as_zeros(tmp_path, small_chunks, read_path,
                                                                            devices):
    """A chunk file one byte short, or with a flipped bit, fails (its size, its CRC32C), naming the array, on
    both paths (bytes after the CRC32C are never read); a missing one reads as zarr's fill value, zero, which
    the checksum then catches."""
    plan = _plan(devices)
    state, want = _random_state(plan)
    sums = store.write_state(str(tmp_path), plan, state)
    valid = {n: t.vocabulary_size for n, t in plan.tables.items()}
    read = lambda: store.read_into_state(str(tmp_path), plan, empty_tables(plan), valid, owned=True)  # noqa: E731
    path = _chunk_file(tmp_path, "users", "table", 3)
    with open(path, "rb") as f:
        original = f.read()
    for damaged in (original[:-1], original[:40] + bytes([original[40] ^ 4]) + original[41:]):
        with open(path, "wb") as f:
            f.write(damaged)
        with pytest.raises(store.StoreReadError) as e:
            read()
        assert e.value.array == ("users", "table")
    with open(path, "wb") as f:
        f.write(original + b"\0")
    got, got_sums = read()
    assert got_sums == sums
    _assert_state(se.unstack_state(plan, got), want)
    os.remove(path)
    got, got_sums = read()
    rows = 512 // (8 * 4)  # the stored chunk's rows (CHUNK_BYTES of one device's piece)
    users = se.unstack_state(plan, got)["users"]
    table = want["users"]["table"].copy()
    table[3 * rows: 4 * rows] = 0
    np.testing.assert_array_equal(np.asarray(users["table"]), table)
    assert got_sums["users/table"] != sums["users/table"]
    assert {k: v for k, v in got_sums.items() if k != "users/table"} == \
        {k: v for k, v in sums.items() if k != "users/table"}


def test_a_restored_cpu_state_is_donated_in_place(tmp_path):
    """The direct path writes into XLA's own buffers (not numpy's): a train step that donates them updates
    them in place, with no copy of the table."""
    plan = _plan(1)
    state, want = _random_state(plan)
    with se.CheckpointManager(tmp_path) as m:
        m.save(1, plan, state)
    del state
    restored = se.restore_embeddings(plan, tmp_path)
    _assert_state(se.unstack_state(plan, restored), want)
    table = restored["items_users"].table
    where = table.unsafe_buffer_pointer()
    step = jax.jit(lambda x: x.at[0].add(1), donate_argnums=0)
    restored = None
    assert step(table).unsafe_buffer_pointer() == where


def _assert_state(got, want):
    for name, keys in want.items():
        for key, a in keys.items():
            np.testing.assert_array_equal(np.asarray(got[name][key]), a, err_msg=f"{name}/{key}")
