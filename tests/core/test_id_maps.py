"""Raw-id tables: `map_ids` against a plain-dict reference of the mapping and its policies.

The reference keeps, per owner shard, a dict id -> last step (and id ->
(count, last) for ids waiting for admission) and applies the documented
policies one id at a time; it shares no code with sparse_embed except the
documented initial value of a new row (`initial_rows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparse_embed as se
from tests.conftest import make_mesh

M64 = (1 << 64) - 1


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
        return self.vec.get(i, np.zeros(dim, np.float32))


def _init_fn(plan, rng):
    from sparse_embed.core.id_maps import initial_rows
    from sparse_embed.core.initializers import seeds
    from sparse_embed.core.tables import table_key
    from sparse_embed.host.raw_ids import split_words

    s = plan.stacks[0]
    seed = seeds(table_key(rng, s.first.name))
    return lambda i: np.asarray(initial_rows(s, seed, jnp.asarray(split_words(np.array([i], np.int64)))))[0]


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
}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("n_dev", [1, 2, 8])
def test_map_ids_and_training_match_the_dict_reference(policy, n_dev):
    mesh = make_mesh(n_dev)
    vocab, dim, batch, lr = 24, 4, 16, 0.5
    dyn = se.Dynamic(**POLICIES[policy])
    table = se.TableSpec("users", vocab, dim, combiner="sum", dynamic=dyn, optimizer=se.optimizers.SGD(lr))
    plan = se.plan([se.FeatureSpec("u", table, batch)], mesh)
    rng = jax.random.key(3)
    tables, maps = se.init_tables(plan, rng), se.init_id_maps(plan, rng)
    gen = np.random.default_rng(n_dev)
    space = [int(x) for x in gen.integers(0, 2**63 - 1, 40, dtype=np.int64)] + [0, 2**63 - 1]
    ref = Reference(vocab, n_dev, dyn.admit_after, dyn.expire_after, dyn.pending_capacity, _init_fn(plan, rng))

    @jax.jit
    def train(tables, maps, batch, g, step):
        b, tables, maps, stats = se.map_ids(plan, batch, tables, maps, step)
        loss = lambda t: jnp.sum(se.lookup(plan, b, t, step)["u"] * g)
        acts = se.lookup(plan, b, tables, step)["u"]
        return acts, jax.grad(loss)(tables), maps, stats

    for step, ids in enumerate(_stream(gen, 12, batch, 3, space)):
        occ: dict[int, int] = {}
        for i in ids[ids >= 0].tolist():
            occ[i] = occ.get(i, 0) + 1
        want = ref.step(occ, step)
        g = gen.normal(size=(batch, dim)).astype(np.float32)
        b, _ = se.preprocess(plan, {"u": ids})
        acts, tables, maps, stats = train(tables, maps, b, g, step)
        got = {k: int(v) for k, v in stats["users"]._asdict().items()}
        assert got == want, f"step {step}"
        expect = np.stack([sum((ref.read(i, dim) for i in row if i >= 0), np.zeros(dim, np.float32)) for row in ids])
        np.testing.assert_allclose(np.asarray(acts), expect, rtol=1e-5, atol=1e-6)
        for bi, row in enumerate(ids):  # SGD on the rows that exist
            for i in row:
                if i >= 0 and int(i) in ref.vec:
                    ref.vec[int(i)] = ref.vec[int(i)] - lr * g[bi]
    got = se.id_table_contents(plan, tables, maps)["users"]
    assert sorted(got.ids.tolist()) == sorted(ref.vec)
    for i, v in zip(got.ids.tolist(), got.vectors):
        np.testing.assert_allclose(v, ref.vec[i], rtol=1e-5, atol=1e-6)
