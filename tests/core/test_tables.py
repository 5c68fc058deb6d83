"""init_tables, stack_tables, unstack_tables / unstack_state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparse_embed as se
from sparse_embed import optimizers as opt
from sparse_embed.core.relayout import from_shard_major
from conftest import make_mesh

STACKINGS = ["auto", None, [["a", "c"]]]


def _features(o=None):
    o = o or opt.Adagrad(0.1, initial_accumulator_value=0.25)
    a = se.TableSpec("a", 37, 8, optimizer=o)
    b = se.TableSpec("b", 100, 8, optimizer=o)
    c = se.TableSpec("c", 5, 8, optimizer=o)
    return {n: se.FeatureSpec(n, t, 8) for n, t in (("fa", a), ("fb", b), ("fc", c), ("fa2", a))}


@pytest.mark.parametrize("stacking", STACKINGS, ids=["auto", "none", "explicit"])
def test_init_layout_sharding_and_padding(mesh, stacking):
    plan = se.plan(_features(), mesh, stacking=stacking)
    tables = se.init_tables(plan, jax.random.key(0))
    for s in plan.stacks:
        v = tables[s.name]
        assert v.table.shape == (s.total_rows, 8) and v.table.dtype == jnp.float32
        assert v.table.sharding.is_equivalent_to(plan.table_sharding(), 2)
        assert set(v.slots) == {"accumulator"}
        np.testing.assert_array_equal(np.asarray(v.slots["accumulator"]), 0.25)
        assert v.slots["accumulator"].sharding.is_equivalent_to(plan.table_sharding(), 2)
        # padding rows (past each table's vocabulary) are zero, real rows are not
        rows = from_shard_major(s, np.asarray(v.table))
        for p in s.tables:
            block = rows[p.row_offset : p.row_offset + p.padded_rows]
            assert (np.abs(block[: p.table.vocabulary_size]).sum(1) > 0).all()
            np.testing.assert_array_equal(block[p.table.vocabulary_size :], 0)


def test_init_values_independent_of_stacking_and_mesh():
    want = se.unstack_tables(p := se.plan(_features(), make_mesh(1)), se.init_tables(p, jax.random.key(7)))
    for n, stacking in ((8, "auto"), (2, None), (8, [["a", "c"]])):
        p = se.plan(_features(), make_mesh(n), stacking=stacking)
        got = se.unstack_tables(p, se.init_tables(p, jax.random.key(7)))
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    other = se.unstack_tables(p, se.init_tables(p, jax.random.key(8)))
    assert not np.array_equal(other["a"], want["a"])


def test_default_initializer_statistics(mesh8):
    t = se.TableSpec("t", 4000, 16)
    plan = se.plan({"f": se.FeatureSpec("f", t, 8)}, mesh8)
    w = se.unstack_tables(plan, se.init_tables(plan, jax.random.key(0)))["t"]
    # stddev 1/sqrt(16) before truncation at 2 sigma (as TF's TruncatedNormal): std 0.8796 * 0.25
    assert abs(w.std() - 0.25 * 0.87962566) < 0.005
    assert abs(w.mean()) < 0.01
    assert np.abs(w).max() <= 2 * 0.25 + 1e-6


def test_custom_initializer_and_dtype(mesh8):
    t = se.TableSpec("t", 30, 4, initializer=jax.nn.initializers.constant(0.5), dtype=jnp.bfloat16)
    plan = se.plan({"f": se.FeatureSpec("f", t, 8)}, mesh8)
    tables = se.init_tables(plan, jax.random.key(0))
    assert tables["t"].table.dtype == jnp.bfloat16
    np.testing.assert_array_equal(se.unstack_tables(plan, tables)["t"].astype(np.float32), 0.5)


def test_init_never_holds_a_whole_table_on_one_device(mesh8):
    t = se.TableSpec("t", 80_000, 64)
    plan = se.plan({"f": se.FeatureSpec("f", t, 8)}, mesh8)
    table_bytes = 80_000 * 64 * 4
    compiled = jax.jit(lambda k: se.init_tables(plan, k)).lower(jax.random.key(0)).compile()
    mem = compiled.memory_analysis()
    assert mem.output_size_in_bytes <= table_bytes / 8 * 1.01
    assert mem.temp_size_in_bytes < table_bytes * 0.75  # a few shards' worth, never the whole table


def test_initializer_with_wrong_shape_is_an_error(mesh8):
    t = se.TableSpec("bad", 30, 4, initializer=lambda k, shape, dtype: jnp.zeros((3, 4), dtype))
    plan = se.plan({"f": se.FeatureSpec("f", t, 8)}, mesh8)
    with pytest.raises(ValueError, match="'bad'.*initializer returned shape"):
        se.init_tables(plan, jax.random.key(0))


@pytest.mark.parametrize("rng, got", [(0, "int 0"), (np.int64(3), r"int64 of shape \(\)"),
                                      (jax.random.split(jax.random.key(0), 2), r"key<fry> of shape \(2,\)"),
                                      (jnp.zeros((2, 2), jnp.uint32), r"uint32 of shape \(2, 2\)")])
def test_an_rng_that_is_not_one_key_is_named(rng, got):
    """An int seed or a batch of keys: a TypeError saying what rng must be (jax said "invalid PRNG key data:
    expected key_data.ndim >= 1", or asked for jax.vmap); both key kinds are taken, alike."""
    t = se.TableSpec("t", 30, 4, optimizer=opt.Adagrad(0.1))
    raw = se.TableSpec("r", 30, 4, optimizer=opt.Adagrad(0.1), dynamic=se.Dynamic())
    plan = se.plan({"f": se.FeatureSpec("f", t, 8), "g": se.FeatureSpec("g", raw, 8)}, make_mesh(2))
    for init in (se.init_tables, se.init_id_maps):
        with pytest.raises(TypeError, match=rf"rng must be one PRNG key, jax.random.key\(seed\).*, got {got}\."):
            init(plan, rng)
    typed, raw_key = se.init_tables(plan, jax.random.key(4)), se.init_tables(plan, jax.random.PRNGKey(4))
    np.testing.assert_array_equal(np.asarray(typed["t"].table), np.asarray(raw_key["t"].table))


@pytest.mark.parametrize("stacking", STACKINGS, ids=["auto", "none", "explicit"])
def test_stack_unstack_round_trip_with_slots(mesh, stacking):
    plan = se.plan(_features(), mesh, stacking=stacking)
    rng = np.random.default_rng(0)
    arrays = {n: rng.normal(size=(t.vocabulary_size, 8)).astype(np.float32) for n, t in plan.tables.items()}
    slots = {"b": {"accumulator": rng.uniform(size=(100, 8)).astype(np.float32)}}
    tables = se.stack_tables(plan, arrays, slots)
    for s in plan.stacks:
        assert tables[s.name].table.sharding.is_equivalent_to(plan.table_sharding(), 2)
    state = se.unstack_state(plan, tables)
    for n in arrays:
        np.testing.assert_array_equal(state[n]["table"], arrays[n])
        want = slots["b"]["accumulator"] if n == "b" else np.full((plan.tables[n].vocabulary_size, 8), 0.25)
        np.testing.assert_array_equal(state[n]["accumulator"], want)
    back = se.unstack_tables(plan, tables)
    assert set(back) == set(arrays)


def test_a_bf16_tables_unstacked_state_stacks_back(mesh8):
    """unstack_state's bfloat16 arrays (ml_dtypes) go back through stack_tables unchanged; strings do not."""
    t = se.TableSpec("h", 20, 4, dtype=jnp.bfloat16, optimizer=se.optimizers.Adagrad(0.1))
    plan = se.plan({"f": se.FeatureSpec("f", t, 8)}, mesh8)
    w = np.random.default_rng(0).normal(size=(20, 4)).astype(jnp.bfloat16)
    acc = np.full((20, 4), 0.5, np.float32)
    state = se.unstack_state(plan, se.stack_tables(plan, {"h": w}, {"h": {"accumulator": acc}}))
    assert state["h"]["table"].dtype == jnp.bfloat16
    again = se.unstack_state(plan, se.stack_tables(plan, {"h": state["h"]["table"]},
                                                   {"h": {"accumulator": state["h"]["accumulator"]}}))
    np.testing.assert_array_equal(again["h"]["table"].view(np.uint16), w.view(np.uint16))
    np.testing.assert_array_equal(again["h"]["accumulator"], acc)
    with pytest.raises(ValueError, match="Table 'h': array dtype <U1 is not numeric"):
        se.stack_tables(plan, {"h": np.full((20, 4), "x")})
    with pytest.raises(ValueError, match="Table 'h': array dtype complex64 is complex; a table holds real numbers"):
        se.stack_tables(plan, {"h": np.full((20, 4), 1 + 2j, np.complex64)})
    with pytest.raises(ValueError, match="Table 'h': slot 'accumulator' dtype complex64 is complex"):
        se.stack_tables(plan, {"h": w}, {"h": {"accumulator": acc + 0j}})


def test_state_that_is_not_embedding_variables_is_named():
    """A stack's value of another type (a dict, an array) in unstack_state, lookup and save: a TypeError naming
    the stack (was an AttributeError on `.table`)."""
    t = se.TableSpec("t", 30, 4, optimizer=opt.Adagrad(0.1))
    plan = se.plan({"f": se.FeatureSpec("f", t, 8)}, make_mesh(2))
    tables = se.init_tables(plan, jax.random.key(0))
    batch, _ = se.preprocess(plan, {"f": np.arange(16).reshape(8, 2) % 30})
    for bad in ({"t": tables["t"]._asdict()}, {"t": tables["t"].table}):
        for use in (lambda: se.unstack_state(plan, bad), lambda: se.lookup(plan, batch, bad, 0)):
            with pytest.raises(TypeError, match=r"Stack 't': expected the EmbeddingVariables init_tables \(or "
                                                r"stack_tables\) made, got (dict|ArrayImpl)\."):
                use()


def test_stacked_layout_is_mod_sharding(mesh8):
    """Row r of a table lives on shard r % 8 (in a single-table stack)."""
    t = se.TableSpec("t", 64, 2)
    plan = se.plan({"f": se.FeatureSpec("f", t, 8)}, mesh8)
    w = np.repeat(np.arange(64, dtype=np.float32)[:, None], 2, 1)
    tables = se.stack_tables(plan, {"t": w})
    for shard in tables["t"].table.addressable_shards:
        s = shard.index[0].start // 8
        np.testing.assert_array_equal(np.asarray(shard.data)[:, 0], np.arange(8) * 8 + s)


def test_stack_tables_bad_input(mesh8):
    plan = se.plan(_features(), mesh8)
    good = {n: np.zeros((t.vocabulary_size, 8), np.float32) for n, t in plan.tables.items()}
    with pytest.raises(ValueError, match=r"missing \['c'\]"):
        se.stack_tables(plan, {k: v for k, v in good.items() if k != "c"})
    with pytest.raises(ValueError, match=r"unknown \['zz'\]"):
        se.stack_tables(plan, {**good, "zz": good["a"]})
    with pytest.raises(ValueError, match=r"Table 'b': array has shape \(99, 8\)"):
        se.stack_tables(plan, {**good, "b": np.zeros((99, 8))})
    with pytest.raises(ValueError, match=r"Table 'a': slot 'accumulator' has shape"):
        se.stack_tables(plan, good, {"a": {"accumulator": np.zeros((37, 3))}})
    with pytest.raises(ValueError, match=r"table 'a' has no slots \['accumulatr'\]: its optimizer Adagrad has "
                                         r"\['accumulator'\]"):  # (else fresh: a typo reset the optimizer's state)
        se.stack_tables(plan, good, {"a": {"accumulatr": np.full((37, 8), 7.0, np.float32)}})
    with pytest.raises(ValueError, match="slots name table 'A', which the plan does not have"):
        se.stack_tables(plan, good, {"A": {"accumulator": np.full((37, 8), 7.0, np.float32)}})
    with pytest.raises(ValueError, match="stacks missing"):
        se.unstack_tables(plan, {})


def test_raw_id_tables_have_no_natural_form(mesh8):
    """A raw-id table's rows are id map slots (the mesh decides which id has which): `unstack_tables` gave them as
    if they were rows 0.., and `stack_tables` put rows where no id reads them; both refuse it, naming the table,
    while the static tables of the same plan go on through a plan of them alone."""
    raw = se.TableSpec("users", 16, 4, dynamic=se.Dynamic())
    items = se.TableSpec("items", 16, 4)
    plan = se.plan([se.FeatureSpec("u", raw, 8), se.FeatureSpec("i", items, 8)], mesh8)
    tables = se.init_tables(plan, jax.random.key(0))
    with pytest.raises(ValueError, match=r"unstack_tables: tables \['users'\] are keyed by raw ids: .*"
                                         r"id_table_contents"):
        se.unstack_tables(plan, tables)
    with pytest.raises(ValueError, match=r"stack_tables: tables \['users'\] are keyed by raw ids: .*load_id_tables"):
        se.stack_tables(plan, {"users": np.zeros((16, 4), np.float32), "items": np.zeros((16, 4), np.float32)})
    static = se.plan([se.FeatureSpec("i", items, 8)], mesh8)
    want = se.unstack_tables(static, se.init_tables(static, jax.random.key(0)))["items"]
    np.testing.assert_array_equal(se.unstack_state(plan, tables)["items"]["table"], want)
