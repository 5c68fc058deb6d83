"""Raw-id tables: `map_ids` against a plain-dict reference of the mapping and its policies.

The reference keeps, per owner shard, a dict id -> last step (and id ->
(count, last) for ids waiting for admission) and applies the documented
policies one id at a time; it shares no code with sparse_embed except the
documented initial value of a new row (`initial_rows`).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import sparse_embed as se
from sparse_embed.raw_ids import IdTable, id_table_contents, load_id_tables
from sparse_embed.io.restoring import restore_state
from tests.cases import Failures
from tests.conftest import make_mesh, require_native
from tests.lower_isa import on_each_isa

M64 = (1 << 64) - 1


def _native_here() -> bool:
    """The native kernel is built and this run's backend is XLA:CPU (its FFI targets are CPU's)."""
    from sparse_embed.core.kernels import native_cpu

    return native_cpu.available() and jax.default_backend() == "cpu"


def owner(i: int, S: int) -> int:
    """splitmix64's finalizer mod S, on Python ints."""
    z = i & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return (z ^ (z >> 31)) % S


class Reference:
    """One raw-id table: rows and waiting ids per owner shard, vectors per id."""

    def __init__(self, vocab: int, S: int, admit: int, expire: int | None, pending: int | None, init):
        self.S, self.admit, self.expire, self.init = S, admit, expire, init
        self.cap = [max(-(-(vocab - s) // S), 0) for s in range(S)]
        self.pcap = pending if pending is not None else -(-vocab // S)
        self.default = None
        self.rows = [dict() for _ in range(S)]  # id -> last step
        self.waiting = [dict() for _ in range(S)]  # id -> [count, last]
        self.vec: dict[int, np.ndarray] = {}

    def _stale(self, last: int, step: int) -> bool:
        return self.expire is not None and last < step - self.expire

    @staticmethod
    def _lru(d: dict, step: int, n: int, last=lambda v: v) -> list[int]:
        """The n least recently used ids not used at `step`, by (last, id)."""
        cands = sorted((last(v), i) for i, v in d.items() if last(v) < step)
        return [i for _, i in cands[:n]]

    def step(self, occurrences: dict[int, int], step: int) -> dict[str, int]:
        st = dict.fromkeys(["admitted", "evicted", "expired", "waiting", "no_room", "forgotten"], 0)
        for s in range(self.S):
            mine = sorted(i for i in occurrences if owner(i, self.S) == s)
            rows, wait = self.rows[s], self.waiting[s]
            admit, new = [], []
            for i in mine:
                if i in rows and self._stale(rows[i], step):
                    del rows[i], self.vec[i]
                    st["expired"] += 1
                if i in rows:
                    rows[i] = step
                    continue
                if self.admit == 1:
                    admit.append(i)
                    continue
                known = i in wait and not self._stale(wait[i][1], step)
                cnt = occurrences[i] + (wait[i][0] if known else 0)
                if cnt >= self.admit:
                    admit.append(i)
                    wait.pop(i, None)
                elif known:
                    wait[i] = [cnt, step]
                else:
                    wait.pop(i, None)
                    new.append((i, cnt))
            # New waiting ids need room: free, then the least recently seen waiting ids.
            room = self.pcap - len(wait)
            gone = self._lru(wait, step, max(len(new) - room, 0), last=lambda v: v[1])
            for i in gone:
                del wait[i]
            for i, cnt in new[: room + len(gone)]:
                wait[i] = [cnt, step]
            st["forgotten"] += len(gone) + max(len(new) - room - len(gone), 0)
            st["waiting"] += sum(1 for i in mine if i not in rows and i not in admit)
            room = self.cap[s] - len(rows)
            evict = self._lru(rows, step, max(len(admit) - room, 0))
            for i in evict:
                del rows[i], self.vec[i]
            placed = admit[: room + len(evict)]
            for i in placed:
                rows[i] = step
                self.vec[i] = self.init(i)
            st.update(admitted=st["admitted"] + len(placed), evicted=st["evicted"] + len(evict),
                      no_room=st["no_room"] + len(admit) - len(placed))
        st["occupancy"] = sum(map(len, self.rows))
        st["pending"] = sum(map(len, self.waiting))
        return st

    def read(self, i: int, dim: int) -> np.ndarray:
        """A row's vector, or what an id without a row reads (zeros, or the default)."""
        none = np.broadcast_to(np.asarray(0.0 if self.default is None else self.default, np.float32), (dim,))
        return self.vec.get(i, none)


def _init_fn(plan, rng, name: str, space: list[int]):
    """The documented initial row of a new id of `space` in raw-id table `name` (all computed in one call)."""
    from sparse_embed.core.id_maps import initial_rows
    from sparse_embed.core.initializers import seeds
    from sparse_embed.core.tables import table_key
    from sparse_embed.core.raw_keys import split_words

    s = plan.stack(name)
    seed = seeds(table_key(rng, s.first.name))
    rows = np.asarray(initial_rows(s, seed, jnp.asarray(split_words(np.array(space, np.int64)))))
    return dict(zip(space, rows)).__getitem__


def _stream(rng, steps: int, batch: int, width: int, space: list[int]):
    """Random dense [batch, width] id batches drawn from `space` (-1 padding)."""
    out = []
    for _ in range(steps):
        ids = np.asarray(space, np.int64)[rng.integers(0, len(space), (batch, width))]
        ids[rng.random((batch, width)) < 0.2] = -1
        out.append(ids)
    return out


POLICIES = {
    "admit1": dict(admit_after=1),
    "admit2_expire3": dict(admit_after=2, expire_after=3),
    "admit3_small_pending": dict(admit_after=3, pending_capacity=2),
    "expire1": dict(expire_after=1),
    "admit2_default_vector": dict(admit_after=2, default=(0.5, -1.0, 0.0, 2.0)),
}


def _check_against_reference(n_dev: int, cases: dict[str, tuple[se.Dynamic, int, list[int], int]], steps: int,
                             kernel: str = "auto"):
    """Trains raw-id tables (SGD, sum), one per case (`cases`: name -> (policy, vocabulary, id space, seed)), in
    one plan, each on its own random batches; every step's stats, activations and final rows of each must equal
    its dict reference's. All failing cases are reported, by name."""
    mesh = make_mesh(n_dev)
    dim, batch, lr = 4, 16, 0.5
    feats = [se.FeatureSpec(f"u_{name}", se.TableSpec(name, vocab, dim, combiner="sum", dynamic=dyn,
                                                      optimizer=se.optimizers.SGD(lr)), batch)
             for name, (dyn, vocab, _, _) in cases.items()]
    plan = se.plan(feats, mesh, kernel=kernel)
    rng = jax.random.key(0)  # each table's initial rows come from its own key (by its name)
    tables, maps = se.init_tables(plan, rng), se.init_id_maps(plan, rng)
    gens, streams, refs = {}, {}, {}
    for name, (dyn, vocab, space, seed) in cases.items():
        gens[name] = np.random.default_rng(seed)
        streams[name] = _stream(gens[name], steps, batch, 3, space)
        refs[name] = Reference(vocab, n_dev, dyn.admit_after, dyn.expire_after, dyn.pending_capacity,
                               _init_fn(plan, rng, name, space))
        refs[name].default = dyn.default
    train = _reference_train_step(plan)
    failures = Failures()
    for step in range(steps):
        g = {f"u_{name}": gens[name].normal(size=(batch, dim)).astype(np.float32) for name in cases}
        b, _ = se.preprocess(plan, {f"u_{name}": streams[name][step] for name in cases})
        acts, tables, maps, stats = train(tables, maps, b, g, step)
        for name, ref in refs.items():
            with failures.case(name):
                if not failures.failed(name):
                    _check_step(ref, streams[name][step], stats[name], acts[f"u_{name}"], step, dim)
            ids = streams[name][step]
            for bi, row in enumerate(ids):  # SGD on the rows that exist
                for i in row:
                    if i >= 0 and int(i) in ref.vec:
                        ref.vec[int(i)] = ref.vec[int(i)] - lr * g[f"u_{name}"][bi]
    contents = id_table_contents(plan, tables, maps)
    for name, ref in refs.items():
        with failures.case(name):
            assert sorted(contents[name].ids.tolist()) == sorted(ref.vec)
            for i, v in zip(contents[name].ids.tolist(), contents[name].vectors):
                np.testing.assert_allclose(v, ref.vec[i], rtol=1e-5, atol=1e-5)
    failures.check()


def _reference_train_step(plan):
    """map_ids, then each feature's activations and the gradient of sum(activations * g) (SGD: the new tables)."""
    @jax.jit
    def train(tables, maps, batch, g, step):
        b, tables, maps, stats = se.map_ids(plan, batch, tables, maps, step)
        loss = lambda t: sum(jnp.sum(a * g[n]) for n, a in se.lookup(plan, b, t, step).items())
        return se.lookup(plan, b, tables, step), jax.grad(loss)(tables), maps, stats

    return train


def _check_step(ref: Reference, ids: np.ndarray, stats, acts, step: int, dim: int) -> None:
    """One step of the reference: the stats of the map and the activations it gives (before the step's SGD)."""
    occ: dict[int, int] = {}
    for i in ids[ids >= 0].tolist():
        occ[i] = occ.get(i, 0) + 1
    want = ref.step(occ, step)
    got = {k: int(v) for k, v in stats._asdict().items()}
    assert got == want, f"step {step}"
    expect = np.stack([sum((ref.read(i, dim) for i in row if i >= 0), np.zeros(dim, np.float32)) for row in ids])
    # atol 1e-5: rows are sums of SGD steps of size ~1 (a duplicate id's gradients are summed before the
    # step here, applied one by one in the reference: float32 rounding of ~1e-6); a wrong row is off by ~1
    np.testing.assert_allclose(np.asarray(acts), expect, rtol=1e-5, atol=1e-5, err_msg=f"step {step}")


@pytest.mark.parametrize("n_dev", [1, 2, 8])
def test_map_ids_and_training_match_the_dict_reference(n_dev):
    """Every policy (a table each, in one plan)."""
    gen = np.random.default_rng(n_dev)
    space = [int(x) for x in gen.integers(0, 2**63 - 1, 40, dtype=np.int64)] + [0, 2**63 - 1]
    _check_against_reference(n_dev, {p: (se.Dynamic(**kw), 24, space, n_dev) for p, kw in POLICIES.items()}, 12)


@pytest.mark.parametrize("kernel", ["auto", "generic"])
@pytest.mark.parametrize("n_dev", [1, 2, 8])
def test_compact_maps_match_the_dict_reference(n_dev, kernel):
    """`Dynamic(id_bits=32)`: the map keeps 4-byte keys (a tiny table: 32 bits is its most); ids over the whole
    range, the ends included; four policies (a table each, in one plan)."""
    gen = np.random.default_rng(n_dev + 10)
    space = [int(x) for x in gen.integers(0, 2**32, 40, dtype=np.int64)] + [0, 2**32 - 1, 2**31, 2**31 - 1]
    cases = {p: (se.Dynamic(**POLICIES[p], id_bits=32), 24, space, n_dev)
             for p in ["admit1", "admit2_expire3", "admit3_small_pending", "expire1"]}
    plan = se.plan([se.FeatureSpec(p, se.TableSpec(p, 24, 4, dynamic=c[0]), 16) for p, c in cases.items()],
                   make_mesh(n_dev))
    for p, m in se.init_id_maps(plan, jax.random.key(0)).items():
        assert m.rows.sorted_keys.ndim == 1, p  # compact
    _check_against_reference(n_dev, cases, 12, kernel=kernel)


def test_the_generic_kernel_maps_as_the_dict_reference():
    """The same reference through the generic kernel (its key search and its lookup; the tests above run the
    native ones where they are built), three policies (a table each, in one plan)."""
    gen = np.random.default_rng(5)
    space = [int(x) for x in gen.integers(0, 2**63 - 1, 40, dtype=np.int64)]
    _check_against_reference(2, {p: (se.Dynamic(**POLICIES[p]), 24, space, 5)
                                 for p in ["admit1", "admit2_expire3", "admit3_small_pending"]}, 12, kernel="generic")


@settings(max_examples=6, deadline=None)
@given(admit=st.integers(1, 3), expire=st.one_of(st.none(), st.integers(1, 4)),
       pending=st.one_of(st.none(), st.integers(1, 6)), vocab=st.integers(1, 40),
       space=st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=60, unique=True), seed=st.integers(0, 99))
def test_random_id_streams_and_policies_match_the_dict_reference(admit, expire, pending, vocab, space, seed):
    _check_against_reference(2, {"users": (se.Dynamic(admit, expire, pending), vocab, space, seed)}, 6)


def _train_plan(mesh, vocab=1000, dyn=None, optimizer=None, batch=16):
    table = se.TableSpec("users", vocab, 4, combiner="sum", dynamic=dyn or se.Dynamic(admit_after=2),
                         optimizer=optimizer or se.optimizers.Adagrad(0.3))
    return se.plan([se.FeatureSpec("u", table, batch)], mesh)


@functools.lru_cache(maxsize=None)
def _train_step(plan):
    """map_ids, then the gradient of sum(sin(activations)) (the tables' optimizer applies it): one jit a plan."""
    @jax.jit
    def train(tables, maps, batch, step):
        b, tables, maps, stats = se.map_ids(plan, batch, tables, maps, step)
        loss = lambda t: jnp.sum(jnp.sin(se.lookup(plan, b, t, step)["u"]))
        return jax.grad(loss)(tables), maps

    return train


def _run(plan, tables, maps, stream, first_step=0):
    train = _train_step(plan)
    for step, ids in enumerate(stream, first_step):
        tables, maps = train(tables, maps, se.preprocess(plan, {"u": ids})[0], step)
    return tables, maps


def _assert_same_contents(a: IdTable, b: IdTable):
    np.testing.assert_array_equal(a.ids, b.ids)
    np.testing.assert_allclose(a.vectors, b.vectors, rtol=1e-6, atol=1e-6)
    for k in a.slots:
        np.testing.assert_allclose(a.slots[k], b.slots[k], rtol=1e-6, atol=1e-6)
    for x, y in zip(a[3:], b[3:]):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def mesh_runs():
    """The stream of the mesh tests, and per mesh size (trained once for all their cases): the plan, its tables
    and maps after the stream's first 4 steps and after all 6."""
    gen = np.random.default_rng(7)
    space = [int(x) for x in gen.integers(0, 2**62, 60, dtype=np.int64)]
    stream, runs = _stream(gen, 6, 16, 3, space), {}

    def run(n: int):
        if n not in runs:
            plan, rng = _train_plan(make_mesh(n)), jax.random.key(1)
            four = _run(plan, se.init_tables(plan, rng), se.init_id_maps(plan, rng), stream[:4])
            runs[n] = plan, four, _run(plan, *four, stream[4:], 4)
        return runs[n]

    return stream, run


@pytest.mark.parametrize("src,dst", [(8, 1), (1, 2), (2, 8)])
def test_the_mapping_is_mesh_independent_and_restores_onto_another_mesh(mesh_runs, src, dst):
    stream, run = mesh_runs
    (a, (ta, ma), six_a), (b, (tb, mb), _) = run(src), run(dst)
    got_a, got_b = id_table_contents(a, ta, ma)["users"], id_table_contents(b, tb, mb)["users"]
    assert got_a.ids.size > 10 and got_a.pending_ids.size > 0
    _assert_same_contents(got_a, got_b)  # trained on either mesh: the same ids, vectors, slots and counts
    moved_t, moved_m = load_id_tables(b, id_table_contents(a, ta, ma))
    _assert_same_contents(id_table_contents(b, moved_t, moved_m)["users"], got_a)
    moved_t, moved_m = _run(b, moved_t, moved_m, stream[4:], 4)  # and training goes on alike
    _assert_same_contents(id_table_contents(b, moved_t, moved_m)["users"], id_table_contents(a, *six_a)["users"])


def test_restoring_onto_fewer_rows_keeps_the_most_recent_ids_and_warns():
    rng, mesh = jax.random.key(0), make_mesh(2)
    big = _train_plan(mesh, dyn=se.Dynamic())
    space = list(range(100, 160))
    stream = [np.array(space[i * 12:(i + 1) * 12], np.int64).reshape(12, 1).repeat(1, 1) for i in range(5)]
    stream = [np.concatenate([s, np.full((4, 1), -1)]) for s in stream]
    t, m = _run(big, se.init_tables(big, rng), se.init_id_maps(big, rng), stream)
    small = _train_plan(mesh, vocab=20, dyn=se.Dynamic())
    with pytest.warns(UserWarning, match="did not fit"):
        t2, m2 = load_id_tables(small, id_table_contents(big, t, m))
    got = id_table_contents(small, t2, m2)["users"]
    assert got.ids.size <= 20 and got.ids.size >= 16
    assert got.last.min() >= 3  # the ids of the last steps are kept first (steps 3 and 4 hold 24 ids)


def test_eval_mapping_changes_nothing_and_unknown_ids_read_zero():
    mesh = make_mesh(2)
    plan = _train_plan(mesh, dyn=se.Dynamic())
    rng = jax.random.key(0)
    tables, maps = se.init_tables(plan, rng), se.init_id_maps(plan, rng)
    known = np.array([[11, 12, -1]] * 16, np.int64)
    tables, maps = _run(plan, tables, maps, [known])
    ids = np.array([[11, 999, -1]] * 16, np.int64)
    b, t2, m2, stats = se.map_ids(plan, se.preprocess(plan, {"u": ids})[0], tables, maps, 5, train=False)
    assert int(stats["users"].waiting) == 1 and int(stats["users"].admitted) == 0
    chex_equal = lambda x, y: jax.tree.map(lambda p, q: np.testing.assert_array_equal(np.asarray(p), np.asarray(q)), x, y)
    chex_equal(m2, maps)
    acts = np.asarray(se.lookup(plan, b, t2, 5)["u"])
    row11 = id_table_contents(plan, tables, maps)["users"]
    np.testing.assert_allclose(acts[0], row11.vectors[list(row11.ids).index(11)], rtol=1e-6)


def test_features_of_every_format_share_a_raw_id_table():
    """A weighted ragged mean feature and a sequence feature on one raw-id table, against the dict of vectors."""
    mesh = make_mesh(8)
    table = se.TableSpec("t", 500, 4, combiner="mean", dynamic=se.Dynamic(), optimizer=se.optimizers.SGD(0.0))
    plan = se.plan([se.FeatureSpec("bag", table, 16), se.FeatureSpec("seq", table, 8, max_sequence_length=3)], mesh)
    rng = jax.random.key(2)
    tables, maps = se.init_tables(plan, rng), se.init_id_maps(plan, rng)
    gen = np.random.default_rng(0)
    big = [int(x) for x in gen.integers(2**40, 2**63 - 1, 30, dtype=np.uint64)]
    rows = [np.array(gen.choice(big, gen.integers(1, 4)), np.uint64) for _ in range(16)]
    w = [gen.uniform(0.5, 2, r.size).astype(np.float32) for r in rows]
    seq = [np.array(gen.choice(big, gen.integers(0, 5)), np.int64) for _ in range(8)]
    batch, _ = se.preprocess(plan, {"bag": rows, "seq": seq}, {"bag": w})
    b, tables, maps, stats = se.map_ids(plan, batch, tables, maps, 0)
    assert int(stats["t"].admitted) == len({int(i) for r in rows for i in r} | {int(i) for r in seq for i in r[:3]})
    acts = se.lookup(plan, b, tables, 0)
    got = id_table_contents(plan, tables, maps)["t"]
    vec = dict(zip(got.ids.tolist(), got.vectors))
    want_bag = np.stack([sum(x * vec[int(i)] for i, x in zip(r, wr)) / wr.sum() for r, wr in zip(rows, w)])
    np.testing.assert_allclose(np.asarray(acts["bag"]), want_bag, rtol=1e-5, atol=1e-6)
    want_seq = np.zeros((8, 3, 4), np.float32)
    for bi, r in enumerate(seq):
        for j, i in enumerate(r[:3]):
            want_seq[bi, j] = vec[int(i)]
    np.testing.assert_allclose(np.asarray(acts["seq"]), want_seq, rtol=1e-6)


@pytest.mark.parametrize("ids, match", [
    (np.array([[1.0, 2.0]] * 8), "must be integers"),
    (np.array([[2**63, 1]] * 8, np.uint64), "must be < 2\\*\\*63"),
    (np.array([[-5, 1]] * 8, np.int64), "out of range"),
])
def test_bad_raw_ids_get_a_clear_error(ids, match):
    plan = _train_plan(make_mesh(2), batch=8)
    with pytest.raises(ValueError, match=f"Feature 'u' \\(table 'users'\\).*{match}"):
        se.preprocess(plan, {"u": ids})


def test_map_ids_inside_the_differentiated_loss_is_named():
    """map_ids in jax.grad's loss: jax said only 'Reverse-mode differentiation does not work for lax.while_loop'."""
    plan = _train_plan(make_mesh(2), batch=8)
    tables, maps = se.init_tables(plan, jax.random.key(0)), se.init_id_maps(plan, jax.random.key(0))
    batch, _ = se.preprocess(plan, {"u": np.array([[5, 7]] * 8)})

    def loss(tables):
        b, tables, _, _ = se.map_ids(plan, batch, tables, maps, 0)
        return jnp.sum(se.lookup(plan, b, tables, 0)["u"])

    with pytest.raises(ValueError, match=r"map_ids: the tables of raw-id stacks \['users'\] are being "
                                         r"differentiated: map_ids was called inside jax.grad's"):
        jax.grad(loss)(tables)
    b, new, _, _ = se.map_ids(plan, batch, tables, maps, 0)  # before the grad: as documented
    assert jax.grad(lambda t: jnp.sum(se.lookup(plan, b, t, 0)["u"]))(new)["users"].table.shape == \
        tables["users"].table.shape


@pytest.mark.parametrize("bits", [0, 64, 2.5, True, "40"])
def test_bad_id_bits_get_a_clear_error(bits):
    with pytest.raises(ValueError, match="Dynamic: id_bits"):
        se.Dynamic(id_bits=bits)


@pytest.mark.parametrize("ids", [np.array([[2**40, 1]] * 8), np.array([[2**40, 1]] * 8, np.uint64),
                                 [np.array([3, 2**41])] * 8, (np.array([2**45] * 8), np.ones(8, np.int64))])
def test_ids_beyond_id_bits_get_a_clear_error(ids):
    plan = _train_plan(make_mesh(2), batch=8, dyn=se.Dynamic(id_bits=40))
    with pytest.raises(ValueError, match=r"Feature 'u' \(table 'users'\): raw id \d+ is out of range: .*< 2\*\*40"):
        se.preprocess(plan, {"u": ids})
    se.preprocess(plan, {"u": np.array([[2**40 - 1, -1]] * 8)})  # the largest id, and padding: fine


def test_compact_maps_take_12_bytes_a_row_and_wide_ones_16():
    """The map's bytes per row (keys, order, last-use steps, directory, size, span): 4-byte keys when id_bits
    fits the rows per shard (32 + log2(rows / 16) bits), else 8-byte ones."""
    rows = 2**16  # one shard: 4096 buckets, so up to 44 bits compact
    for bits, per_row in ((44, 12.25), (45, 16.25), (None, 16.25), (20, 12.25)):
        table = se.TableSpec("t", rows, 4, dynamic=se.Dynamic(id_bits=bits))
        plan = se.plan([se.FeatureSpec("f", table, 8)], make_mesh(1))
        m = se.init_id_maps(plan, jax.random.key(0))["t"].rows
        got = sum(x.nbytes for x in m) / rows
        assert per_row <= got < per_row + 0.01, (bits, got)


def test_compact_and_wide_maps_train_alike_and_restore_into_each_other():
    """The same stream through a wide map and a compact one (id_bits=36): every step's stats and the final
    contents bit for bit equal; the contents of each load into a plan of the other layout (another mesh too)
    and train on alike; contents beyond the plan's id_bits get a clear error."""
    gen = np.random.default_rng(3)
    pool = np.concatenate([gen.integers(0, 2**36, 150), [2**36 - 1, 0]])
    stream = [pool[gen.integers(0, pool.size, (16, 3))] for _ in range(10)]
    stream[3][:2, 0] = 2**36 - 1
    plans = {bits: _train_plan(make_mesh(2), vocab=4096, dyn=se.Dynamic(admit_after=2, expire_after=5, id_bits=bits))
             for bits in (None, 36)}
    contents = {}
    for bits, plan in plans.items():
        maps = se.init_id_maps(plan, jax.random.key(1))
        assert maps["users"].rows.sorted_keys.ndim == (2 if bits is None else 1)
        tables, maps = _run(plan, se.init_tables(plan, jax.random.key(1)), maps, stream[:6])
        contents[bits] = id_table_contents(plan, tables, maps)["users"]
    _assert_same_contents(contents[36], contents[None])
    assert contents[36].ids.size > 40 and contents[36].ids.max() == 2**36 - 1
    after = {}
    for src, dst in ((None, 36), (36, None)):  # restore into the other layout, on 8 devices, and go on
        plan = _train_plan(make_mesh(8), vocab=4096, dyn=se.Dynamic(admit_after=2, expire_after=5, id_bits=dst))
        tables, maps = load_id_tables(plan, {"users": contents[src]})
        assert maps["users"].rows.sorted_keys.ndim == (2 if dst is None else 1)
        _assert_same_contents(id_table_contents(plan, tables, maps)["users"], contents[src])
        tables, maps = _run(plan, tables, maps, stream[6:], first_step=6)
        after[dst] = id_table_contents(plan, tables, maps)["users"]
    _assert_same_contents(after[36], after[None])
    narrow = _train_plan(make_mesh(2), vocab=4096, dyn=se.Dynamic(admit_after=2, expire_after=5, id_bits=30))
    with pytest.raises(ValueError, match=r"Table 'users': the contents hold id \d+, .* below 2\*\*30"):
        load_id_tables(narrow, {"users": contents[36]})


def test_several_raw_id_tables_map_as_each_alone(n_dev=2):
    """A train step touches every raw-id table's map in one call (`touch_keys_many`): three tables (policies,
    sizes and key layouts apart) and a static one map, train and count exactly as each table's own plan does,
    on the native kernel with one thread or all, and on the generic one."""
    dyns = {"a": se.Dynamic(), "b": se.Dynamic(admit_after=2, expire_after=2), "c": se.Dynamic(id_bits=32)}
    specs = {n: se.TableSpec(n, v, 4, combiner="sum", dynamic=d) for (n, d), v in zip(dyns.items(), (40, 64, 24))}
    feats = [se.FeatureSpec(f"f{n}", t, 16) for n, t in specs.items()]
    static = se.FeatureSpec("s", se.TableSpec("s", 50, 4), 16)
    gen = np.random.default_rng(n_dev)
    pool = gen.integers(0, 2**32, 60)
    stream = [{f"f{n}": pool[gen.integers(0, 60, (16, 3))] for n in dyns} | {"s": gen.integers(0, 50, (16, 3))}
              for _ in range(6)]

    def train(plan, names):
        tables, maps = se.init_tables(plan, jax.random.key(0)), se.init_id_maps(plan, jax.random.key(0))

        @jax.jit
        def step(tables, maps, batch, i):
            b, tables, maps, stats = se.map_ids(plan, batch, tables, maps, i)
            loss = lambda t: sum(jnp.sum(jnp.sin(a)) for a in se.lookup(plan, b, t, i).values())
            return jax.grad(loss)(tables), maps, stats

        counts = []
        for i, ids in enumerate(stream):
            batch, _ = se.preprocess(plan, {k: v for k, v in ids.items() if k in names})
            tables, maps, stats = step(tables, maps, batch, i)
            counts.append(jax.tree.map(int, stats))
        return id_table_contents(plan, tables, maps), counts

    mesh = make_mesh(n_dev)
    from sparse_embed.core.kernels import native_cpu

    kernels = ["generic"] + (["native", native_cpu.NativeCpuKernel(threads=1)] if _native_here() else [])
    runs = {str(k): train(se.plan(feats + [static], mesh, kernel=k), {f.name for f in feats} | {"s"})
            for k in kernels}
    for n, f in zip(dyns, feats):
        alone, counts = train(se.plan([f], mesh), {f.name})
        for got, got_counts in runs.values():
            _assert_same_contents(got[n], alone[n])
            assert [c[n] for c in got_counts] == [c[n] for c in counts]
        assert alone[n].ids.size > 5


def test_a_raw_id_table_is_never_stacked_and_its_batches_must_be_mapped():
    mesh = make_mesh(2)
    raw = se.TableSpec("users", 100, 4, dynamic=se.Dynamic())
    static = se.TableSpec("items", 100, 4)
    feats = [se.FeatureSpec("u", raw, 8), se.FeatureSpec("i", static, 8)]
    with pytest.raises(ValueError, match="'users' is keyed by raw ids"):
        se.plan(feats, mesh, stacking=[["users", "items"]])
    plan = se.plan(feats, mesh)  # auto: two stacks
    assert sorted(plan.stack_names) == ["items", "users"]
    rng = jax.random.key(0)
    tables, maps = se.init_tables(plan, rng), se.init_id_maps(plan, rng)
    batch, _ = se.preprocess(plan, {"u": np.arange(8) * 2**40, "i": np.arange(8)})
    with pytest.raises(ValueError, match="Stack 'users'.*raw ids.*map_ids"):
        se.lookup(plan, batch, tables, 0)
    with pytest.raises(ValueError, match="init_id_maps"):
        se.map_ids(plan, batch, tables, {}, 0)
    mapped, tables, maps, _ = se.map_ids(plan, batch, tables, maps, 0)
    with pytest.raises(ValueError, match="Stack 'users'.*already mapped"):
        se.map_ids(plan, mapped, tables, maps, 1)
    static_plan = se.plan([se.FeatureSpec("u", dataclasses.replace(raw, dynamic=None), 8), feats[1]], mesh)
    with pytest.raises(ValueError, match="out of range"):
        se.preprocess(static_plan, {"u": np.arange(8) * 2**40, "i": np.arange(8)})


@pytest.mark.parametrize("src,dst", [(8, 2), (1, 8)])
def test_checkpoints_save_the_map_and_restore_it_onto_another_mesh(tmp_path, src, dst):
    gen = np.random.default_rng(3)
    space = [int(x) for x in gen.integers(0, 2**62, 60, dtype=np.int64)]
    stream = _stream(gen, 4, 16, 3, space)
    rng = jax.random.key(4)
    static = se.TableSpec("items", 50, 4, optimizer=se.optimizers.Adagrad(0.3))

    def make(n):
        return se.plan([se.FeatureSpec("u", _train_plan(make_mesh(n)).tables["users"], 16),
                        se.FeatureSpec("i", static, 16)], make_mesh(n))

    a, b = make(src), make(dst)
    ta, ma = se.init_tables(a, rng), se.init_id_maps(a, rng)
    ta, ma = _run_two(a, ta, ma, stream)
    with se.CheckpointManager(tmp_path / "ck", async_save=False) as ck:
        with pytest.raises(ValueError, match="raw-id tables.*id_maps"):
            ck.save(4, a, ta)
        ck.save(4, a, ta, id_maps=ma)
        r = ck.restore(b)
    _assert_same_contents(id_table_contents(b, r.tables, r.id_maps)["users"],
                          id_table_contents(a, ta, ma)["users"])
    static_part = lambda p: dataclasses.replace(p, stacks=tuple(s for s in p.stacks if s.name == "items"))
    np.testing.assert_array_equal(se.unstack_tables(static_part(a), {"items": ta["items"]})["items"],
                                  se.unstack_tables(static_part(b), {"items": r.tables["items"]})["items"])
    assert se.restore_embeddings(b, tmp_path / "ck")["users"].table.shape == r.tables["users"].table.shape
    static_plan = se.plan([se.FeatureSpec("u", dataclasses.replace(a.tables["users"], dynamic=None), 16),
                           se.FeatureSpec("i", static, 16)], make_mesh(dst))
    with pytest.raises(ValueError, match="'users' is keyed by raw ids in the checkpoint"):
        se.restore_embeddings(static_plan, tmp_path / "ck")


def _run_two(plan, tables, maps, stream):
    @jax.jit
    def train(tables, maps, batch, step):
        b, tables, maps, _ = se.map_ids(plan, batch, tables, maps, step)
        loss = lambda t: sum(jnp.sum(jnp.sin(x)) for x in se.lookup(plan, b, t, step).values())
        return jax.grad(loss)(tables), maps

    for step, ids in enumerate(stream):
        batch, _ = se.preprocess(plan, {"u": ids, "i": np.abs(ids[:, 0]) % 50})
        tables, maps = train(tables, maps, batch, step)
    return tables, maps


def test_serving_export_carries_the_map_and_serving_lookup_takes_raw_ids(tmp_path):
    mesh = make_mesh(2)
    plan = _train_plan(mesh, dyn=se.Dynamic())
    rng = jax.random.key(0)
    gen = np.random.default_rng(5)
    space = [int(x) for x in gen.integers(0, 2**63 - 1, 30, dtype=np.int64)]
    tables, maps = _run(plan, se.init_tables(plan, rng), se.init_id_maps(plan, rng), _stream(gen, 3, 16, 3, space))
    with pytest.raises(ValueError, match="id_maps"):
        se.export_serving(tmp_path / "bad", plan, tables)
    se.export_serving(tmp_path / "srv", plan, tables, id_maps=maps)
    served, specs = se.load_serving(tmp_path / "srv")
    assert specs["users"].dynamic is not None
    feature = se.FeatureSpec("u", specs["users"], 16)
    ids = _stream(gen, 1, 16, 3, space)[0]
    ids[0, 0] = 12345  # never seen
    want = se.lookup(plan, se.map_ids(plan, se.preprocess(plan, {"u": ids})[0], tables, maps, 9, train=False)[0],
                     tables, 9)["u"]
    got = se.serving_lookup([feature], served, {"u": ids}, oov="zero")["u"]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="raw id 12345 is not in the table"):
        se.serving_lookup([feature], served, {"u": ids})
    with pytest.raises(ValueError, match="give it as \\(ids, array\\)"):
        se.serving_lookup([feature], {"users": served["users"][1]}, {"u": ids}, oov="zero")
    assert se.verify_checkpoint(tmp_path / "srv").ok
    # the serving checkpoint read back as a plan's state (ids and rows only), on another mesh: the same eval
    other = _train_plan(make_mesh(4), dyn=se.Dynamic())
    assert sorted(se.restore_embeddings(other, tmp_path / "srv", with_slots=False)) == sorted(tables)
    t4, m4 = restore_state(other, str(tmp_path / "srv"), with_slots=False)
    again = se.lookup(other, se.map_ids(other, se.preprocess(other, {"u": ids})[0], t4, m4, 9, train=False)[0],
                      t4, 9)["u"]
    np.testing.assert_allclose(np.asarray(again), np.asarray(want), rtol=1e-6, atol=1e-7)
    out = se.convert_checkpoint(tmp_path / "srv", tmp_path / "srv2", serving=True)
    np.testing.assert_array_equal(se.load_serving(out)[0]["users"][0], served["users"][0])


@pytest.mark.parametrize("default", [0.5, (0.25, -1.0, 2.0, 0.0)], ids=["float", "vector"])
def test_a_served_raw_id_table_reads_its_default_vector_for_unknown_ids_as_training_does(tmp_path, default):
    """`Dynamic.default` goes into the serving checkpoint; `serving_lookup` reads it for ids the table has no row
    for (with the loaded spec and with the training one), unless `oov=` says otherwise; COO ids map alike."""
    plan = _train_plan(make_mesh(2), dyn=se.Dynamic(default=default))
    rng = jax.random.key(0)
    seen = np.array([[5, 6, -1]] * 16, np.int64)
    tables, maps = _run(plan, se.init_tables(plan, rng), se.init_id_maps(plan, rng), [seen])
    se.export_serving(tmp_path / "srv", plan, tables, id_maps=maps)
    served, specs = se.load_serving(tmp_path / "srv")
    assert specs["users"].dynamic.default == plan.tables["users"].dynamic.default
    ids = np.array([[5, 77, -1]] + [[6, -1, -1]] * 15, np.int64)  # 77: never seen
    want = np.asarray(se.lookup(plan, se.map_ids(plan, se.preprocess(plan, {"u": ids})[0], tables, maps, 1,
                                                 train=False)[0], tables, 1)["u"])
    rows = dict(zip(*(np.asarray(x) for x in served["users"])))  # raw id -> served row
    np.testing.assert_allclose(want[0], rows[5] + np.broadcast_to(np.float32(default), (4,)), rtol=1e-6)
    for table in (specs["users"], plan.tables["users"]):
        f = se.FeatureSpec("u", table, 16)
        np.testing.assert_allclose(np.asarray(se.serving_lookup([f], served, {"u": ids})["u"]), want, rtol=1e-6)
        zero = np.asarray(se.serving_lookup([f], served, {"u": ids}, oov={"users": "zero"})["u"])
        np.testing.assert_allclose(zero[0], rows[5], rtol=1e-6)
        with pytest.raises(ValueError, match="raw id 77 is not in the table"):
            se.serving_lookup([f], served, {"u": ids}, oov="error")
        nz = np.flatnonzero(ids.ravel() != -1)
        coo = (np.stack([nz // 3, nz % 3], 1), ids.ravel()[nz], (16, 3))
        np.testing.assert_allclose(np.asarray(se.serving_lookup([f], served, {"u": coo})["u"]), want, rtol=1e-6)


def test_inspect_shows_occupancy_and_verify_checks_the_map(tmp_path, capsys):
    from sparse_embed import cli

    mesh = make_mesh(2)
    plan = _train_plan(mesh, dyn=se.Dynamic(admit_after=2))
    rng = jax.random.key(0)
    ids = np.array([[5, 6, -1]] * 8 + [[7, -1, -1]] * 8, np.int64)
    tables, maps = _run(plan, se.init_tables(plan, rng), se.init_id_maps(plan, rng), [ids, ids[:, ::-1].copy()])
    with se.CheckpointManager(tmp_path / "ck", async_save=False) as ck:
        ck.save(2, plan, tables, id_maps=maps)
    assert cli.main(["inspect", str(tmp_path / "ck")]) in (0, None)
    assert "raw ids: 3 of 1000 rows used (0.3%), 0 ids waiting for admission" in capsys.readouterr().out
    v = se.verify_checkpoint(tmp_path / "ck")
    assert v.ok and v.checked == 2 + 6  # table, Adagrad's slot, and the six arrays of the map
    step_dir = os.path.join(tmp_path, "ck", "2", "embeddings")
    victim = [os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs if "users.pending" in r][0]
    with open(victim, "r+b") as fh:  # corrupt a byte of the waiting ids
        fh.seek(max(os.path.getsize(victim) - 3, 0))
        fh.write(b"\xff")
    assert not se.verify_checkpoint(tmp_path / "ck").ok


@functools.cache
def _jitted(owner, name: str, static: tuple[int, ...] = ()):
    """`owner.name` jitted once for the module: the tests that run on each instruction set trace it once."""
    return jax.jit(getattr(owner, name), static_argnums=static)


@pytest.mark.parametrize("compact", [False, True], ids=["wide", "compact"])
@pytest.mark.parametrize("spread", ["uniform", "clustered", "sequential", "extremes"])
@on_each_isa
def test_key_set_finds_exactly_the_keys_it_holds(spread, compact):
    """The per-shard set (directory of buckets + search in one bucket) against a Python dict, over rounds of
    inserts with LRU eviction, for keys spread in different ways; searched by each kernel's `find_keys`
    and `touch_keys` (the native one where its extension is built, on each instruction set; touch against a
    numpy update of `last`).
    Compact sets (4-byte keys) hold ids below 2**compact_bits(n), here 2**39."""
    from sparse_embed.core import key_set
    from sparse_embed.core.kernels import GENERIC, NATIVE, native_cpu
    from sparse_embed.core.raw_keys import join_words, split_words

    gen = np.random.default_rng(0)
    n, q = 2048, 512
    top = 2**key_set.compact_bits(n) - 1 if compact else 2**63 - 1
    assert not compact or top == 2**39 - 1

    def draw():
        if spread == "uniform":
            return gen.integers(0, top, q, dtype=np.int64)
        if spread == "clustered":
            return np.concatenate([gen.integers(0, 3000, q // 2), gen.integers(top // 2, top // 2 + 50, q // 2)])
        if spread == "sequential":
            return np.arange(q, dtype=np.int64) + int(gen.integers(0, 4000))
        return gen.choice(np.array([0, 1, top, top - 1, 2**31, 2**32 - 1, 2**32] +
                                   list(gen.integers(0, top, 50))), q)

    insert = _jitted(key_set, "insert")
    kernels = [k for k in (GENERIC, NATIVE) if k is GENERIC or _native_here()]
    finders = [_jitted(k, "find_keys") for k in kernels]
    touchers = [_jitted(k, "touch_keys") for k in kernels]

    def find(s, q):  # every kernel's answer, checked equal
        got = [np.asarray(f(s, q)) for f in finders]
        for g in got[1:]:
            np.testing.assert_array_equal(g, got[0])
        return got[0]

    def touch(s, q, step, stale_before):  # every kernel's, checked equal, and against numpy
        want_last = np.asarray(s.last).copy()
        slot = find(s, q)
        for sl in slot[slot >= 0]:
            if want_last[sl] >= stale_before:
                want_last[sl] = step
        want_missing = int(((slot < 0) & (np.asarray(q)[:, 0] != -1)).sum())  # free markers are not missing
        for t in touchers:
            got_slot, got_last, got_missing = t(s, q, jnp.int32(step), jnp.int32(stale_before))
            np.testing.assert_array_equal(np.asarray(got_slot), slot)
            np.testing.assert_array_equal(np.asarray(got_last), want_last)
            assert int(got_missing) == want_missing
        return s._replace(last=jnp.asarray(want_last))

    s, held = key_set.empty(n, compact), {}
    assert (find(s, jnp.asarray(split_words(draw()))) == -1).all()  # an empty set
    for step in range(8):
        ids = np.unique(draw())
        words = _padded_words(ids, q)
        slot = find(s, jnp.concatenate([words, jnp.full((3, 2), -1, jnp.int32)]))  # + free markers
        assert (slot[len(ids):] == -1).all()
        slot = slot[:len(ids)]
        for i, sl in zip(ids.tolist(), slot.tolist()):
            assert (sl >= 0) == (i in held) and (sl < 0 or held[i] == sl), (step, i)
        marked = np.asarray(words).copy()
        marked[gen.random(len(marked)) < 0.2] = -1  # free markers among the queries
        s = touch(s, jnp.asarray(marked), step, step - 2)  # keys last used before step - 2 stay as they are
        s = touch(s, jnp.full((5, 2), -1, jnp.int32), step, step - 2)  # nothing but free markers
        s = touch(s, words, step, step - 2)
        want = jnp.asarray(np.arange(q) < len(ids)).at[:len(ids)].set(slot < 0)
        res = insert(s, jnp.int32(n), words, want, jnp.zeros(n, bool), jnp.int32(step))
        s, new = res.set, np.asarray(res.slots)
        assert s.sorted_keys.ndim == (1 if compact else 2)
        size, keys, order = int(s.size), np.asarray(key_set.full_keys(s)), np.asarray(s.order)
        live = join_words(keys[:size])
        assert (np.diff(live) > 0).all() and (keys[size:] == -1).all()  # live keys in key order, then free
        assert sorted(order.tolist()) == list(range(n)) and (np.asarray(s.last)[order[size:]] == -1).all()
        held = dict(zip(live.tolist(), order[:size].tolist()))
        for i, sl in zip(ids.tolist(), new.tolist()):
            if sl >= 0:
                assert held[i] == sl
        assert int(s.size) == len(held) and int(s.directory[-1]) == len(held)
        absent = [x for x in draw().tolist() if x not in held][:50]
        assert (find(s, _padded_words(np.array(absent, np.int64), 50)) < 0).all()
    if _native_here():  # many queries: several chunks over the thread pool, the same answers on one thread
        many = jnp.asarray(split_words(np.concatenate([draw() for _ in range(20)] + [np.array(list(held))])))
        one_thread = native_cpu.NativeCpuKernel(threads=1)
        np.testing.assert_array_equal(np.asarray(jax.jit(one_thread.find_keys)(s, many)), find(s, many))
        distinct = jnp.asarray(split_words(np.unique(join_words(np.asarray(many)))))
        for a, b in zip(jax.jit(one_thread.touch_keys)(s, distinct, 99, 5), touchers[1](s, distinct, 99, 5)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_default_vector_is_read_by_ids_without_a_row_and_never_trained():
    mesh = make_mesh(2)
    table = se.TableSpec("t", 100, 4, combiner="mean", optimizer=se.optimizers.SGD(1.0),
                         dynamic=se.Dynamic(admit_after=100, default=0.25))
    plan = se.plan([se.FeatureSpec("f", table, 8), se.FeatureSpec("s", table, 8, max_sequence_length=2)], mesh)
    rng = jax.random.key(0)
    tables, maps = se.init_tables(plan, rng), se.init_id_maps(plan, rng)
    ids = {"f": np.array([[7, -1]] * 8), "s": np.array([[7, 9]] * 8)}
    b, tables, maps, st = se.map_ids(plan, se.preprocess(plan, ids)[0], tables, maps, 0)
    assert int(st["t"].waiting) == 2
    acts = se.lookup(plan, b, tables, 0)
    np.testing.assert_allclose(np.asarray(acts["f"]), 0.25)
    np.testing.assert_allclose(np.asarray(acts["s"]), 0.25)  # each position: one id, the default
    grads = jax.grad(lambda t: sum(jnp.sum(x) for x in se.lookup(plan, b, t, 0).values()))(tables)
    np.testing.assert_array_equal(np.asarray(grads["t"].table), np.asarray(tables["t"].table))  # nothing trained
    with pytest.raises(ValueError, match="default vector has 3 values, embedding_dim is 4"):
        se.TableSpec("t", 100, 4, dynamic=se.Dynamic(default=(1.0, 2.0, 3.0)))
    with pytest.raises(ValueError, match="finite float or vector"):
        se.Dynamic(default=float("nan"))


def _padded_words(ids: np.ndarray, size: int) -> jax.Array:
    """The ids' words, then free markers (never wanted, as `map_ids` pads its own) up to `size` rows: queries of
    one shape whatever the round's number of distinct ids, so a test compiles its calls once."""
    from sparse_embed.core.key_set import FREE
    from sparse_embed.core.raw_keys import split_words

    return jnp.asarray(np.concatenate([split_words(ids), np.full((size - len(ids), 2), FREE, np.int32)]))


CASES = ["grow", "full_lru_ties", "wide_steps", "negative_steps", "removed", "capacity", "clustered"]


@pytest.mark.parametrize("compact", [False, True], ids=["wide", "compact"])
@pytest.mark.parametrize("case", CASES)
def test_native_insert_equals_the_generic_insert_bit_for_bit(case, compact):
    """`insert_keys` of the native kernel against `key_set.insert` (the generic kernel's), over rounds that
    fill a set, evict by LRU with many ties (and last-use steps far apart, or steps of -1, the free marker),
    remove slots, cap the capacity and move the span: every array of the set, the slots and the eviction
    count equal, round after round (each round starts from the native result: a drift shows where it starts)."""
    from sparse_embed.core import key_set
    from sparse_embed.core.kernels import GENERIC, native_cpu

    require_native("kernel")
    gen = np.random.default_rng(CASES.index(case))
    n, q = 256, 64
    native = jax.jit(native_cpu.NativeCpuKernel().insert_keys)
    generic = jax.jit(GENERIC.insert_keys)
    s = key_set.empty(n, compact)
    top = 2**key_set.compact_bits(n) if compact else 2**63 - 1  # 2**36
    evictions = 0
    for step in range(12):
        if case == "clustered":  # keys below and above everything held: the span changes
            ids = np.unique(np.concatenate([gen.integers(0, 2**20, q // 2), gen.integers(top // 2, top, q // 2)]))
        else:
            ids = np.unique(gen.integers(0, min(2**40, top) if step % 3 else 600, q))
        words = _padded_words(ids, q + 4)
        found = np.asarray(key_set.find(s, words))
        want = jnp.asarray((found < 0) & (gen.random(q + 4) < 0.9) & (np.arange(q + 4) < ids.size))
        if case == "full_lru_ties":  # few distinct last-use steps among the live keys
            s = s._replace(last=jnp.where(s.last >= 0, s.last % 2, s.last))
        now = step - 3 if case == "negative_steps" else step
        if case == "wide_steps":  # steps over a range wider than the native histogram's, with ties
            now = 2**30 + step
            s = s._replace(last=jnp.where(s.last >= 0, jnp.asarray(gen.choice(gen.integers(0, 2**30, 40), n),
                                                                   jnp.int32), s.last))
        removed = None
        if case == "removed" or (case == "full_lru_ties" and step % 2):
            live = np.asarray(s.order)[: int(s.size)]
            mask = np.zeros(n, bool)
            mask[live[gen.random(live.size) < 0.2]] = True
            removed = jnp.asarray(mask)
        capacity = jnp.int32(n if case != "capacity" else 100 + 10 * step)
        a = native(s, capacity, words, want, removed, jnp.int32(now))
        b = generic(s, capacity, words, want, removed, jnp.int32(now))
        for x, y, what in zip(jax.tree.leaves(a), jax.tree.leaves(b), ("sorted_keys", "last", "order", "size",
                                                                          "directory", "span", "slots", "evicted")):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{case}, step {step}: {what}")
        assert a.set.sorted_keys.ndim == (1 if compact else 2)
        evictions += int(a.evicted)
        s = a.set
    if case in ("grow", "full_lru_ties", "wide_steps", "negative_steps"):
        assert evictions > 0  # the rounds did evict
    # nothing wanted, nothing removed: the set as it was
    same = native(s, jnp.int32(n), jnp.zeros((4, 2), jnp.int32), jnp.zeros(4, bool), None, jnp.int32(99))
    for x, y in zip(jax.tree.leaves(same.set), jax.tree.leaves(s)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert (np.asarray(same.slots) == -1).all() and int(same.evicted) == 0


@pytest.mark.parametrize("q", [300, 20000])  # below and above the native kernel's switch to its radix sort
@pytest.mark.parametrize("spread", ["uniform", "clustered", "extremes", "all_free", "one_key"])
def test_native_unique_equals_the_generic_unique_bit_for_bit(spread, q):
    """`unique_keys` of the native kernel (a radix sort) against `key_set.unique` (XLA's sort): the distinct
    keys in key order then free markers, and every query's index among them (Q for a free marker), with
    duplicates, free markers and keys that share or differ in any of their 16-bit digits."""
    from sparse_embed.core.kernels import GENERIC, native_cpu
    from sparse_embed.core.raw_keys import split_words

    require_native("kernel")
    gen = np.random.default_rng(["uniform", "clustered", "extremes", "all_free", "one_key"].index(spread))
    ids = {"uniform": lambda: gen.integers(0, 2**63 - 1, q, dtype=np.int64),
           "clustered": lambda: np.concatenate([gen.integers(0, 300, q // 2), gen.integers(2**62, 2**62 + 70, q // 2)]),
           "extremes": lambda: gen.choice(np.array([0, 1, 2**16, 2**32 - 1, 2**32, 2**48, 2**63 - 1, 2**63 - 2]), q),
           "all_free": lambda: np.zeros(q, np.int64),
           "one_key": lambda: np.full(q, 123456789012, np.int64)}[spread]()
    words = np.asarray(split_words(ids)).copy()
    words[gen.random(q) < (1.0 if spread == "all_free" else 0.2)] = -1  # free markers
    words = jnp.asarray(words)
    got = jax.jit(native_cpu.NativeCpuKernel().unique_keys)(words)
    want = jax.jit(GENERIC.unique_keys)(words)
    for g, w, what in zip(got, want, ("keys", "inverse")):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{spread}: {what}")


@pytest.mark.parametrize("q,e", [(1, 10), (7, 0), (300, 1000), (20000, 70000)])  # the last: several chunks
@on_each_isa
def test_take_rows_equals_numpy_on_each_kernel(q, e):
    """`take_rows` (each entry's row: `values[index]`, `fill` where the index is outside `[0, Q)` or the value is
    negative, i.e. no row) of the generic and the native kernel against numpy, with negative and too-large indices
    and negative values, on 1 and on all threads (on each instruction set)."""
    from sparse_embed.core.kernels import GENERIC, native_cpu

    gen = np.random.default_rng(q + e)
    values = gen.integers(0, 2**31 - 1, q).astype(np.int32)
    values[gen.random(q) < 0.2] = gen.choice([-1, -(2**31)])  # no row
    index = gen.integers(-3, q + 3, e).astype(np.int32)
    index[: min(e, 4)] = [-(2**31), 2**31 - 1, q, -1][: min(e, 4)]
    got = values[np.clip(index, 0, q - 1)]
    want = np.where((index >= 0) & (index < q) & (got >= 0), got, 777)
    kernels = [GENERIC] + ([native_cpu.NativeCpuKernel(), native_cpu.NativeCpuKernel(threads=1)]
                           if _native_here() else [])
    for k in kernels:
        got = _jitted(k, "take_rows", (2,))(jnp.asarray(values), jnp.asarray(index), 777)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=type(k).__name__)


def test_touch_hands_entries_their_rows_on_each_kernel():
    """`touch_keys_many` with entries `(slot_of, values)` per set (what `map_ids` passes with one source): besides
    the touch, each entry's row `slots[slot_of]` (N, the set's size, where the index is outside `[0, Q)` or the
    key is absent) and its value (0 there), against numpy, for 0, 7 and 5000 entries on a wide and a compact set
    (six sets in one call, each checked and named), on the generic kernel and the native one (one thread and
    all); the touch's own results as without entries."""
    from sparse_embed.core import key_set
    from sparse_embed.core.kernels import GENERIC, native_cpu

    n, q = 512, 300
    sets, calls = [], {}
    for e in (0, 7, 5000):
        gen = np.random.default_rng(e)
        for compact in (False, True):
            held = np.unique(gen.integers(0, 2**36, 400))
            s = key_set.insert(key_set.empty(n, compact), jnp.int32(n), _padded_words(held, 400),
                               jnp.ones(400, bool).at[held.size:].set(False), None, jnp.int32(0)).set
            ids = np.unique(np.concatenate([gen.choice(held, 200), gen.integers(0, 2**36, 60)]))
            slot_of = gen.integers(-2, q + 2, e).astype(np.int32)
            values = gen.normal(size=e).astype(np.float32)
            sets.append((s, _padded_words(ids, q), jnp.int32(-5), (jnp.asarray(slot_of), jnp.asarray(values))))
            calls[f"{e} entries, {'compact' if compact else 'wide'}"] = (slot_of, values)
    kernels = [GENERIC] + ([native_cpu.NativeCpuKernel(), native_cpu.NativeCpuKernel(threads=1)]
                           if _native_here() else [])
    failures = Failures()
    for k in kernels:
        got = jax.jit(k.touch_keys_many)(sets, jnp.int32(3))
        plain = jax.jit(k.touch_keys_many)([t[:3] for t in sets], jnp.int32(3))
        for (slots, last, missing, rows, gains), bare, (case, (slot_of, values)) in zip(got, plain, calls.items()):
            with failures.case(f"{'generic' if k is GENERIC else f'native, threads={k.threads}'}: {case}"):
                for a, b in zip((slots, last, missing), bare):
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
                slots = np.asarray(slots)
                inside = (slot_of >= 0) & (slot_of < q)
                want = np.where(inside, slots[np.clip(slot_of, 0, q - 1)], -1)
                want = np.where(want >= 0, want, n)
                np.testing.assert_array_equal(np.asarray(rows), want, err_msg="rows")
                np.testing.assert_array_equal(np.asarray(gains), np.where(want < n, values, 0.0), err_msg="gains")
                assert len(values) == 0 or (want < n).any() and (want == n).any()  # rows and misses among them
    failures.check()
    mixed = [sets[0], sets[1][:3]]
    if _native_here():
        with pytest.raises(ValueError, match="entries for every set or for none"):
            native_cpu.NativeCpuKernel().touch_keys_many(mixed, jnp.int32(3))


def test_waiting_ids_past_the_pending_capacity_warn_as_waiting_ids_not_live_ones():
    """Restoring 64 waiting ids onto 4 shards of 8 waiting places warned that ids "did not fit their owner shards
    (4 shards of N rows)", as if live ids were lost; the live ids were all kept."""
    plan = _train_plan(make_mesh(4), vocab=120, dyn=se.Dynamic(admit_after=2, pending_capacity=8))
    ids, waiting = np.arange(6, dtype=np.int64) * 7, np.arange(1000, 1064, dtype=np.int64)
    t = IdTable(ids, np.ones((6, 4), np.float32), {}, np.zeros(6, np.int32), waiting, np.ones(64, np.int32),
                np.arange(64, dtype=np.int32), np.zeros(2, np.uint32))
    with pytest.warns(UserWarning, match=r"Table 'users': 32 ids waiting for admission did not fit their owner "
                                         r"shards' waiting places under this plan \(4 shards of 8: "
                                         r"Dynamic.pending_capacity\)") as record:
        tables, maps = load_id_tables(plan, {"users": t})
    assert not any("did not fit their owner shards under" in str(w.message) for w in record)
    back = id_table_contents(plan, tables, maps)["users"]
    assert sorted(back.ids.tolist()) == ids.tolist() and back.pending_ids.size == 32


def _contents(ids, pending=()) -> IdTable:
    """An IdTable of `ids` (vector of the k-th: k * 10 + [0, 1, 2, 3]) and waiting ids `pending` (count 1)."""
    n, m = len(ids), len(pending)
    return IdTable(np.array(ids, np.int64), np.arange(n * 4, dtype=np.float32).reshape(n, 4) * 2.5,
                   {"accumulator": np.ones((n, 4), np.float32)}, np.zeros(n, np.int32), np.array(pending, np.int64),
                   np.ones(m, np.int32), np.zeros(m, np.int32), np.zeros(2, np.uint32))


@pytest.mark.parametrize("contents, match", [
    (_contents([80, 70, 60, 50, 40, 30, 20, 10]), "ids must be distinct and in increasing order"),
    (_contents([10, 10, 20, 30]), "ids must be distinct and in increasing order"),
    (_contents([-1, 10, 20]), "ids hold -1: raw ids are in \\[0, 2\\*\\*63\\)"),
    (_contents([1, 2, 3], pending=[9, 5]), "pending_ids must be distinct and in increasing order"),
    (_contents([1, 2, 3])._replace(vectors=np.zeros((4, 4), np.float32)), "vectors: shape \\(4, 4\\), but there are 3 "
                                                                          "ids"),
    (_contents([1, 2, 3])._replace(vectors=np.zeros((3, 5), np.float32)), "vectors: shape \\(3, 5\\), but the plan's "
                                                                          "table has embedding_dim 4"),
    (_contents([1, 2, 3])._replace(last=np.zeros(2, np.int32)), "last: shape \\(2,\\), but there are 3 ids"),
    (_contents([1, 2, 3])._replace(slots={"accumulator": np.ones((3, 1), np.float32)}),
     "slots\\['accumulator'\\]: shape \\(3, 1\\), but the plan's Adagrad keeps 4 values a row in it"),
], ids=["unsorted", "repeated", "negative", "pending_unsorted", "vectors_rows", "vectors_dim", "last", "slot_width"])
def test_contents_that_are_no_id_table_get_a_clear_error(contents, match):
    """`load_id_tables` builds each shard's sorted key set from the contents as they come: contents with ids out
    of order (or repeated) loaded without a word into sets whose searches missed most of their ids (6 of 8
    above: they read zeros and were admitted again, while `id_table_contents` still listed them)."""
    plan = _train_plan(make_mesh(2), vocab=64)
    with pytest.raises(ValueError, match=f"Table 'users': the contents do not fit an IdTable: {match}"):
        load_id_tables(plan, {"users": contents})


def test_loaded_contents_are_found_by_every_lookup():
    """Sorted contents: every id found, reading its own vector (an eval lookup against the contents)."""
    plan = _train_plan(make_mesh(2), vocab=64)
    t = _contents([10, 20, 30, 40, 50, 60, 70, 2**63 - 1])
    tables, maps = load_id_tables(plan, {"users": t})
    ids = t.ids.reshape(-1, 1).repeat(2, 0)
    b, _, _, stats = se.map_ids(plan, se.preprocess(plan, {"u": ids})[0], tables, maps, 1, train=False)
    assert int(stats["users"].waiting) == 0
    np.testing.assert_array_equal(np.asarray(se.lookup(plan, b, tables, 1)["u"]), t.vectors.repeat(2, 0))


@pytest.mark.parametrize("name, match", [("userz", "Table 'userz' of the contents is not in the plan"),
                                         ("items", "Table 'items' of the contents is a static table in the plan")])
def test_contents_of_a_table_the_plan_does_not_key_by_raw_ids_are_refused(name, match):
    """`load_id_tables` placed the plan's raw-id tables and ignored every other entry of the contents without a
    word (a misspelt table name, or one the plan has as a static table: its trained ids and vectors dropped)."""
    mesh = make_mesh(2)
    raw = _train_plan(mesh, vocab=64).tables["users"]
    plan = se.plan([se.FeatureSpec("u", raw, 16), se.FeatureSpec("i", se.TableSpec("items", 64, 4), 16)], mesh)
    with pytest.raises(ValueError, match=f"{match} \\(its raw-id tables are \\['users'\\]\\): its ids and vectors "
                                         "would be dropped"):
        load_id_tables(plan, {"users": _contents([1, 2]), name: _contents([3, 4])})
    tables, maps = load_id_tables(plan, {"users": _contents([1, 2])})
    assert id_table_contents(plan, tables, maps)["users"].ids.tolist() == [1, 2]
