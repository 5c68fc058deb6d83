"""preprocess: the COO layout, Stats, capacities and overflow policies, checked against numpy.

Every test runs on both paths: the C kernels (sparse_embed/_native.c) and numpy.
"""

from __future__ import annotations

import collections
import re

import chex
import jax
import numpy as np
import pytest

import sparse_embed as se
from sparse_embed.host import distributed, native, plan_state
import reference as ref
from conftest import make_mesh, require_native


@pytest.fixture(autouse=True, params=["native", "numpy"])
def path(request, monkeypatch) -> str:
    """Runs the test with the C kernels, then with SPARSE_EMBED_NATIVE=0 (numpy, as without the extension)."""
    if request.param == "native":
        require_native("preprocess")
    if request.param == "numpy":
        monkeypatch.setenv(native.ENV, "0")
    return request.param


def _plan(mesh, **kw):
    a = se.TableSpec("a", 50, 4, combiner="sum")
    b = se.TableSpec("b", 13, 4, combiner="sum")
    feats = {
        "fa": se.FeatureSpec("fa", a, 16),
        "fb": se.FeatureSpec("fb", b, 8),
        "fseq": se.FeatureSpec("fseq", b, 8, max_sequence_length=2),
    }
    return se.plan(feats, mesh, **kw)


def _random_ids(rng, plan, max_len=5):
    samples = {n: ref.random_samples(rng, f.batch_size, f.table.vocabulary_size, max_len, weighted=True)
               for n, f in plan.features.items()}
    return samples, {n: ref.render(s, "list")[0] for n, s in samples.items()}, {
        n: ref.render(s, "list")[1] for n, s in samples.items()}


def _expected_entries(plan, samples):
    """{(device, shard): sorted list of (row_id, col_id, value)} computed directly from the samples."""
    out = collections.defaultdict(list)
    for stack in plan.stacks:
        S = stack.num_shards
        for lay in stack.features:
            f = lay.feature
            spd, L = f.batch_size // S, f.max_sequence_length
            for b, s in enumerate(samples[f.name]):
                ids = [i for i, _ in s][: L or None]
                w = np.array([x for _, x in s])[: L or None]
                for j, i in enumerate(ids):
                    r = lay.table_row_offset + i
                    row = lay.row_offset + (b % spd) * max(L, 1) + (j if L else 0)
                    out[(stack.name, b // spd, r % S)].append((row, r // S, float(w[j])))
    return out


@pytest.mark.parametrize("n", [1, 2, 8])
def test_coo_layout_matches_numpy(n):
    plan = _plan(make_mesh(n))
    samples, ids, w = _random_ids(np.random.default_rng(n), plan)
    batch, stats = se.preprocess(plan, ids, w, device_put=False)
    want = _expected_entries(plan, samples)
    for stack in plan.stacks:
        coo, S = batch[stack.name], n
        C = coo.capacity
        assert coo.col_ids.shape == coo.row_ids.shape == coo.values.shape == (n, S * C)
        counts = []
        for d in range(n):
            for s in range(S):
                lo, hi = coo.shard_starts[d, s], coo.shard_ends[d, s]
                assert lo == s * C and hi - lo <= C
                got = list(zip(coo.row_ids[d, lo:hi], coo.col_ids[d, lo:hi], coo.values[d, lo:hi]))
                assert [g[0] for g in got] == sorted(g[0] for g in got)  # row order inside a segment
                exp = want.get((stack.name, d, s), [])
                assert sorted((int(r), int(c)) for r, c, _ in got) == sorted((r, c) for r, c, _ in exp)
                np.testing.assert_allclose(sorted(v for *_, v in got), sorted(v for *_, v in exp), rtol=1e-6)
                # padding entries point out of range and carry no gain
                assert (coo.col_ids[d, hi : (s + 1) * C] == stack.rows_per_shard).all()
                assert (coo.row_ids[d, hi : (s + 1) * C] == stack.rows_per_device).all()
                assert (coo.values[d, hi : (s + 1) * C] == 0).all()
                counts.append(hi - lo)
        assert stats.max_ids_per_partition[stack.name] == max(counts)
        assert stats.num_ids[stack.name] == sum(counts)
        assert stats.dropped_ids[stack.name] == 0
        uniq = [len({c for _, c, _ in want.get((stack.name, d, s), [])}) for d in range(n) for s in range(S)]
        assert stats.max_unique_ids_per_partition[stack.name] == max(uniq)


def test_device_put_places_batch_on_the_mesh(mesh8):
    plan = _plan(mesh8)
    _, ids, _ = _random_ids(np.random.default_rng(0), plan)
    batch, _ = se.preprocess(plan, ids)
    for coo in batch.values():
        for x in coo[:5]:  # keys: None (no raw ids)
            assert isinstance(x, jax.Array) and x.sharding.is_equivalent_to(plan.batch_sharding(), x.ndim)


@pytest.mark.parametrize("dynamic", [False, True], ids=["rows", "raw-ids"])
def test_a_batch_keeps_its_plan_mark_through_copies_and_transformations(mesh8, dynamic):
    """The mark (`layout`) is no tuple field: a batch unpacks into its arrays as before; pickling (a worker
    process), `_replace`, tree maps and `device_put` keep it; it is the stack's, the same for an equal plan."""
    import pickle

    t = se.TableSpec("t", 64, 4, dynamic=se.Dynamic() if dynamic else None)
    make = lambda: se.plan([se.FeatureSpec("f", t, 16)], mesh8)  # noqa: E731
    plan = make()
    entry = se.preprocess(plan, {"f": np.arange(16)}, device_put=False)[0]["t"]
    want = plan.stack("t").batch_layout
    assert entry.layout == want == make().stack("t").batch_layout and want.stack == "t"
    assert len(entry) == len(type(entry)._fields) == (6 if dynamic else 5)
    assert all(isinstance(x, np.ndarray) for x in entry) and "layout" not in type(entry)._fields
    copies = [pickle.loads(pickle.dumps(entry)), entry._replace(values=entry.values * 2),
              jax.tree.map(lambda x: x, entry), jax.device_put(entry), type(entry)(*entry, layout=want)]
    for c in copies:
        assert type(c) is type(entry) and c.layout == want
        chex.assert_trees_all_equal(tuple(c[:2]), tuple(entry[:2]))
    assert entry._replace(layout=None).layout is None and type(entry)(*entry).layout is None
    assert jax.tree.structure(entry) != jax.tree.structure(entry._replace(layout=None))  # jit retraces on it


def _hot_ids(plan, n_hot):
    """fa: every sample holds ids 0, 8, 16, ... (all on shard 0 of an 8-device mesh)."""
    ids = {n: np.full((f.batch_size, 1), -1) for n, f in plan.features.items()}
    ids["fa"] = np.tile(np.arange(n_hot) % 7 * 8, (16, 1))
    return ids


def test_overflow_error_names_stack_partition_and_counts(mesh8):
    plan = _plan(mesh8, stacking=None, capacity=8)
    with pytest.raises(ValueError, match=r"Stack 'a' \(features \['fa'\]\): partition \(device 0, shard 0\) has 12 ids but the capacity is 8"):
        se.preprocess(plan, _hot_ids(plan, 6))  # 2 samples per device x 6 ids


def test_an_overflow_error_leaves_every_capacity_as_it_was(mesh8):
    """A batch that overflows an explicit capacity raises before an auto stack beside it grows its capacity."""
    a, b = se.TableSpec("a", 1000, 4), se.TableSpec("b", 1000, 8)
    plan = se.plan([se.FeatureSpec("fa", a, 8), se.FeatureSpec("fb", b, 8)], mesh8, stacking=None, capacity={"b": 8})
    small = {"fa": np.zeros((8, 1), np.int64), "fb": np.zeros((8, 1), np.int64)}
    before = se.preprocess(plan, small)[1].capacity
    with pytest.raises(ValueError, match=r"Stack 'b' .* but the capacity is 8"):
        se.preprocess(plan, {"fa": np.arange(8 * 400).reshape(8, 400) % 1000, "fb": np.zeros((8, 200), np.int64)})
    assert plan_state.of(plan).marks() == {"a": before["a"]}
    assert se.preprocess(plan, small)[1].capacity == before


def test_overflow_drop_is_counted_and_deterministic(mesh8):
    plan = _plan(mesh8, stacking=None, capacity=8, on_overflow="drop")
    ids = _hot_ids(plan, 6)
    batch, stats = se.preprocess(plan, ids)
    assert stats.dropped_ids["a"] == 8 * (12 - 8)
    assert stats.max_ids_per_partition["a"] == 12
    again, _ = se.preprocess(plan, ids)
    for x, y in zip(batch["a"], again["a"]):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # the last ids in sample order are dropped: sample 0 keeps 6 ids, sample 1 keeps the first 2
    tables = se.init_tables(plan, jax.random.key(0))
    W = se.unstack_tables(plan, tables)["a"]
    act = np.asarray(se.lookup(plan, batch, tables)["fa"])
    np.testing.assert_allclose(act[0], W[[0, 8, 16, 24, 32, 40]].sum(0), rtol=1e-5)
    np.testing.assert_allclose(act[1], W[[0, 8]].sum(0), rtol=1e-5)


def test_grow_capacity_fits_observed_stats(mesh8):
    plan = _plan(mesh8, stacking=None, capacity=8, on_overflow="drop")
    _, stats = se.preprocess(plan, _hot_ids(plan, 6))
    grown = se.grow_capacity(plan, stats)
    assert grown.capacity("a") == 16 and grown.capacity("b") == 8
    batch, stats2 = se.preprocess(grown, _hot_ids(plan, 6))
    assert stats2.dropped_ids["a"] == 0 and batch["a"].capacity == 16
    assert se.grow_capacity(plan, stats, headroom=2.0).capacity("a") == 24
    with pytest.raises(ValueError, match="headroom"):
        se.grow_capacity(plan, stats, headroom=0.5)
    with pytest.raises(TypeError, match="grow_capacity: stats must be the Stats that preprocess returns, got dict"):
        se.grow_capacity(plan, stats.max_ids_per_partition)


def test_grow_capacity_refuses_stats_of_another_placement_of_the_same_stacks(mesh8):
    """Stats of a "row" plan sized a "table" plan of the same stack names: capacities too small for the batch
    the stats came from (its next preprocess overflowed). Stats carry each stack's layout now."""
    row, table = (_plan(mesh8, stacking=[["a", "b"]], placement=p) for p in ("row", "table"))
    assert row.stack_names == table.stack_names
    ids = _hot_ids(row, 6)
    _, stats = se.preprocess(row, ids)
    assert stats.layouts == {s.name: s.batch_layout.digest for s in row.stacks}
    with pytest.raises(ValueError, match=r"grow_capacity: the stats of stacks \['a_b'\] were measured under "):
        se.grow_capacity(table, stats)
    _, table_stats = se.preprocess(table, ids)
    grown = se.grow_capacity(table, table_stats)
    se.preprocess(grown, ids)  # fits the batch it was grown from
    assert se.grow_capacity(row, stats.merge(stats)).capacity("a_b") >= stats.max_ids_per_partition["a_b"]
    with pytest.raises(ValueError, match=r"Stats.merge: stacks \['a_b'\] were measured under different plans"):
        stats.merge(table_stats)


@pytest.mark.parametrize("headroom", [0.5, float("nan"), float("inf"), "2", True])
def test_grow_capacity_refuses_a_headroom_that_is_no_finite_number_from_one(mesh8, headroom):
    """nan / inf / "2" raised Python's own conversion and comparison errors."""
    plan = _plan(mesh8, stacking=None, capacity=8, on_overflow="drop")
    _, stats = se.preprocess(plan, _hot_ids(plan, 6))
    with pytest.raises(ValueError, match=r"headroom must be a finite number >= 1, got "):
        se.grow_capacity(plan, stats, headroom=headroom)


@pytest.mark.parametrize("caps, match", [
    ({"a": -100}, r"capacities\['a'\] must be a positive int, got -100"),
    ({"a": 7.5}, r"capacities\['a'\] must be a positive int, got 7.5"),
    ({"a": True}, r"capacities\['a'\] must be a positive int, got True"),
    ({"nope": 8}, r"capacities name stacks \['nope'\] that this plan does not have"),
], ids=["negative", "float", "bool", "unknown"])
def test_cost_reports_refuse_capacities_that_are_no_positive_int_of_a_stack(mesh8, caps, match):
    """A negative capacity gave negative bytes, a float float bytes, an unknown stack was ignored."""
    plan = _plan(mesh8, stacking=None)
    for report in (plan.collective_bytes, plan.describe):
        with pytest.raises(ValueError, match=match):
            report(caps)
    _, stats = se.preprocess(plan, _hot_ids(plan, 6))
    assert plan.collective_bytes(stats.capacity) > 0 and "a" in plan.describe(stats.capacity)


def test_auto_capacity_sizes_from_first_batch_and_only_grows(mesh8):
    plan = _plan(mesh8, stacking=None)
    assert plan.capacity("a") is None
    small = {n: np.full((f.batch_size, 1), 1) for n, f in plan.features.items()}
    b1, s1 = se.preprocess(plan, small)
    c1 = b1["a"].capacity
    assert c1 >= s1.max_ids_per_partition["a"] and plan_state.of(plan).marks()["a"] == c1 == s1.capacity["a"]
    b2, s2 = se.preprocess(plan, _hot_ids(plan, 40))  # needs 80 per partition: grows, nothing dropped
    assert b2["a"].capacity >= 80 and s2.dropped_ids["a"] == 0
    b3, _ = se.preprocess(plan, small)  # never shrinks: no recompile
    assert b3["a"].capacity == b2["a"].capacity
    # the high-water mark is host state, not part of the plan; another plan object keeps its own
    assert plan.capacity("a") is None
    assert hash(plan) == hash(_plan(mesh8, stacking=None)) and plan == _plan(mesh8, stacking=None)
    assert plan_state.of(_plan(mesh8, stacking=None)).marks() == {}


def _dense_ids(plan, widths, rng, pad=0.0):
    """Dense `[B, width]` ids per feature; a `pad` share of them -1."""
    ids = {n: rng.integers(0, f.table.vocabulary_size, (f.batch_size, widths[n])) for n, f in plan.features.items()}
    return {n: np.where(rng.random(x.shape) < pad, -1, x) for n, x in ids.items()}


@pytest.mark.parametrize("n_dev", [1, 8])
def test_auto_capacity_stops_at_what_fixed_length_ids_can_fill(n_dev):
    """Dense ids bound a partition's entries (a device's samples x width; a sequence feature's width at most its
    length): the capacity adds no headroom past that bound; a batch that outgrows it brings the headroom back."""
    plan = _plan(make_mesh(n_dev), stacking=None)
    rng = np.random.default_rng(0)
    widths = {"fa": 3, "fb": 5, "fseq": 4}
    bound = {"a": 16 // n_dev * 3, "b": 8 // n_dev * (5 + 2)}  # fseq: 4 ids per sample, at most 2 kept
    batch, stats = se.preprocess(plan, _dense_ids(plan, widths, rng))
    for stack in ("a", "b"):
        want = min(plan_state.auto_capacity_for(stats.max_ids_per_partition[stack]), -(-bound[stack] // 8) * 8)
        assert batch[stack].capacity == stats.capacity[stack] == want, stack
    if n_dev == 1:  # every id of a device in one partition: no padding left but the alignment's
        assert stats.capacity == {"a": 48, "b": 56} and stats.max_ids_per_partition == {"a": 48, "b": 56}
    padded, _ = se.preprocess(plan, _dense_ids(plan, widths, rng, pad=0.5))  # fewer ids: the same capacity
    assert padded["a"].capacity == batch["a"].capacity
    _, stats = se.preprocess(plan, _dense_ids(plan, {**widths, "fa": 5}, rng))  # wider
    if n_dev == 1:  # it outgrew a capacity its bound set: the shapes vary, so the full headroom from now on
        assert stats.max_ids_per_partition["a"] == 80 and stats.capacity["a"] == plan_state.auto_capacity_for(80)
        _, stats = se.preprocess(plan, _dense_ids(plan, {**widths, "fa": 6}, rng))  # 96 ids: fits, no recompile
        assert stats.capacity["a"] == plan_state.auto_capacity_for(80)
    else:  # as it was, or grown with the full headroom
        needed = stats.max_ids_per_partition["a"]
        assert needed <= stats.capacity["a"] in (batch["a"].capacity, plan_state.auto_capacity_for(needed))
    roomy = _plan(make_mesh(n_dev), stacking=None, capacity=256)  # the same lookup with padding to spare
    roomy_batch, _ = se.preprocess(roomy, _dense_ids(plan, widths, np.random.default_rng(0)))
    tables = se.init_tables(plan, jax.random.key(0))
    got, want = se.lookup(plan, batch, tables), se.lookup(roomy, roomy_batch, tables)
    for name in plan.features:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)


def test_ragged_ids_keep_the_headroom():
    """Ragged ids have no fixed bound (the next batch may hold more): one device keeps the usual headroom."""
    plan = _plan(make_mesh(1), stacking=None)
    rng = np.random.default_rng(1)
    ids = {n: [rng.integers(0, f.table.vocabulary_size, rng.integers(1, 5)) for _ in range(f.batch_size)]
           for n, f in plan.features.items()}
    ids["fb"] = np.zeros((8, 2), np.int64)  # one dense feature does not bound a stack with a ragged one
    _, stats = se.preprocess(plan, ids)
    for stack in ("a", "b"):
        needed = stats.max_ids_per_partition[stack]
        assert stats.capacity[stack] == plan_state.auto_capacity_for(needed) > needed


def test_processes_agree_on_the_bound(monkeypatch, mesh8):
    """Under several processes the bound is the largest process's, and none if any process's ids are ragged."""
    from sparse_embed.host import preprocessing
    from sparse_embed.host.partition import partition

    plan = _plan(mesh8, stacking=None)
    ids = _dense_ids(plan, {"fa": 3, "fb": 1, "fseq": 2}, np.random.default_rng(2))
    parts = {s.name: partition(s, preprocessing._checked_features(plan, ids, None, 8), 8)
             for s in plan.stacks}
    others = {}
    monkeypatch.setattr(distributed, "mesh_processes", lambda mesh: [0, 1])
    monkeypatch.setattr(distributed, "allgather_ints", lambda procs, mine, **kw: np.asarray([mine, others["row"]]))
    monkeypatch.setattr(distributed, "allgather_bytes", lambda procs, data, **kw: [data, data])  # the same plan
    for other_a, want_a in ((20, 20), (2, 6), (-1, None)):  # a: this process's bound is 2 samples x 3 = 6
        row = [0] + [v for s in plan.stacks for v in (1, 1, 1, 0, other_a if s.name == "a" else 2, 5)]
        others["row"] = row
        agreed = preprocessing._agree(plan, ids, parts, {"a": 0, "b": 3}, False)
        assert agreed["a"].bound == want_a and agreed["b"].bound == 3  # b: 1 x 1 + 1 x 2 against 2
        assert agreed["a"].truncated == 5 and agreed["b"].truncated == 8  # ids past a sequence's end: summed


def test_processes_with_different_plans_are_told_at_their_first_exchange(mesh8, monkeypatch):
    """Another layout named the exchanges apart (each process waited 10 minutes, then blamed timing); another
    optimizer trained the processes apart silently. The plans are compared once, at the first exchange."""
    def plan(lr, capacity=None, dim=4, placement="row", **table):
        t = se.TableSpec("a", 50, dim, optimizer=se.optimizers.SGD(lr), **table)
        return se.plan([se.FeatureSpec("f", t, 8)], mesh8, capacity=capacity, placement=placement)

    # (max_norm, width, dtype, placement: were not compared; each process ran the step on its own rows with its
    # own, training them apart silently, or the collectives hung or aborted)
    for other, here, there in ((plan(5.0), "table 'a': optimizer SGD(", "learning_rate=5.0"),
                               (plan(0.5, capacity=16), "layout", "layout"),
                               (plan(0.5, max_norm=0.1), "table 'a': embedding_dim=4, max_norm=None", "max_norm=0.1"),
                               (plan(0.5, dim=8), "table 'a': embedding_dim=4,", "embedding_dim=8"),
                               (plan(0.5, dtype=jax.numpy.bfloat16),
                                "table 'a': embedding_dim=4, max_norm=None, dtype=float32", "dtype=bfloat16"),
                               (plan(0.5, placement={"a": "table"}), "stack 'a': placement 'row'",
                                "placement 'table'")):
        theirs = "\n".join(plan_state.fingerprint(other)).encode()
        monkeypatch.setattr(distributed, "allgather_bytes", lambda procs, data, **kw: [data, theirs])
        with pytest.raises(RuntimeError, match=r"plan differs from process 1's: every process must build the same "
                                               rf"plan. Here: {re.escape(here)}.*; there: .*{re.escape(there)}"):
            plan_state.check_same_plan(plan(0.5), (0, 1))
    mine, calls = plan(0.5), []
    monkeypatch.setattr(distributed, "allgather_bytes", lambda procs, data, **kw: calls.append(kw) or [data, data])
    plan_state.check_same_plan(mine, (0, 1))
    plan_state.check_same_plan(mine, (0, 1))
    assert len(calls) == 1  # once per plan
    schedule = lambda lr: (lambda step: lr)  # noqa: E731 (functions: by type, not address)
    assert plan_state.fingerprint(plan(schedule(0.1))) == plan_state.fingerprint(plan(schedule(0.2)))


@pytest.mark.parametrize("dynamic", [False, True], ids=["rows", "raw_ids"])
@pytest.mark.parametrize("fmt", ["dense", "list", "pair"])
@pytest.mark.parametrize("n", [1, 8])
def test_ids_past_a_sequence_length_are_left_out_and_counted(n, fmt, dynamic):
    """A sequence feature keeps a sample's first max_sequence_length ids: the rest are left out of the batch and
    counted per stack in `Stats.truncated_ids` (and not in `num_ids`); pooled features truncate nothing."""
    dyn = se.Dynamic() if dynamic else None
    a, b = se.TableSpec("a", 50, 4, dynamic=dyn), se.TableSpec("b", 13, 4)
    feats = [se.FeatureSpec("seq3", a, 8, max_sequence_length=3), se.FeatureSpec("pooled", a, 8),
             se.FeatureSpec("seq1", b, 16, max_sequence_length=1)]
    plan = se.plan(feats, make_mesh(n), stacking=None)
    rng = np.random.default_rng(n)
    samples = {f.name: ref.random_samples(rng, f.batch_size, f.table.vocabulary_size, 6, weighted=False)
               for f in feats}
    _, stats = se.preprocess(plan, {k: ref.render(v, fmt)[0] for k, v in samples.items()}, device_put=False)
    past = {f.name: sum(max(len(s) - f.max_sequence_length, 0) for s in samples[f.name]) if f.max_sequence_length
            else 0 for f in feats}
    everything = {f.name: sum(len(s) for s in samples[f.name]) for f in feats}
    assert past["seq3"] and past["seq1"]  # the draw truncates both
    assert stats.truncated_ids == {"a": past["seq3"], "b": past["seq1"]}
    assert stats.num_ids == {"a": everything["seq3"] + everything["pooled"] - past["seq3"],
                             "b": everything["seq1"] - past["seq1"]}
    assert stats.merge(stats).truncated_ids == {"a": 2 * past["seq3"], "b": 2 * past["seq1"]}


def test_a_dense_sequence_counts_positions_by_column():
    """Dense ids: a column is a position (-1 pads it), so [5, -1, 7] under max_sequence_length 2 leaves 7 out."""
    t = se.TableSpec("t", 10, 4)
    plan = se.plan([se.FeatureSpec("s", t, 2, max_sequence_length=2)], make_mesh(1))
    _, stats = se.preprocess(plan, {"s": np.array([[5, -1, 7], [1, 2, -1]])}, device_put=False)
    assert stats.truncated_ids == {"t": 1} and stats.num_ids == {"t": 3}
    _, stats = se.preprocess(plan, {"s": [np.array([5, 7]), np.array([1, 2])]}, device_put=False)
    assert stats.truncated_ids == {"t": 0} and stats.num_ids == {"t": 4}


def test_stats_merge():
    a = se.Stats({"s": 3}, {"s": 2}, {"s": 1}, {"s": 10}, {"s": 8})
    b = se.Stats({"s": 5, "t": 1}, {"s": 1, "t": 1}, {"s": 2, "t": 0}, {"s": 4, "t": 1}, {"s": 8, "t": 8})
    m = a.merge(b)
    assert m.max_ids_per_partition == {"s": 5, "t": 1}
    assert m.dropped_ids == {"s": 3, "t": 0} and m.num_ids == {"s": 14, "t": 1}
