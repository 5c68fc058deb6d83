"""An offloaded table's store killed mid-write (SIGKILL in a write-back, in a merge of its write log, in a flush,
around the commit) opens as exactly its last commit: every stored row equals the in-memory table's at that step,
never a later step's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparse_embed as se
from sparse_embed.tiers.store import RowStore
from tests.conftest import make_mesh

V, D, B, L, CACHE = 3000, 8, 32, 4, 120
STEPS, COMMIT_AT = 16, 6  # the child flushes (commits) after COMMIT_AT steps, then trains on


def _spec(path: str | None) -> se.TableSpec:
    storage = None if path is None else se.offload.Offload(path, cache_rows=CACHE)
    return se.TableSpec("items", V, D, optimizer=se.optimizers.Adagrad(0.1), combiner="sum", storage=storage)


def _batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [{"f": (rng.zipf(1.3, (B, L)) * 7919 % V).astype(np.int64)} for _ in range(STEPS)]


def _loss(plan):
    cot = jnp.cos(jnp.arange(B * D, dtype=jnp.float32).reshape(B, D))
    return lambda tables, batch, step: jnp.sum(se.lookup(plan, batch, tables, step)["f"] * cot)


# The child: trains with the offloaded table, commits after COMMIT_AT steps, and is killed by SIGKILL at the
# chosen point: the n-th append of write-backs to the write log or the n-th write into the records file (a merge of
# the log), in the writer thread or the flush's, half of its rows written; or around the second commit's rename.
# Its stores merge their write logs once they hold `log_bytes` (argv), also between commits.
CHILD = textwrap.dedent("""
    import os, signal, sys, threading
    import jax
    from tests.tiers import test_offload_crash as t
    from sparse_embed.tiers import rows_file, store
    where, n, log_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[4])
    calls = {"write": 0, "commit": 0}  # commit: the last one written
    io, append, write_json, init = store.RowStore._io, rows_file.WriteLog.append, store._write_json, store.RowStore.__init__

    def killing(kind, call, args):
        flushing = threading.current_thread() is threading.main_thread()  # write-backs run in the writer thread
        if calls["commit"] == 1 and where == (kind + ("_flush" if flushing else "")):
            calls["write"] += 1
            if calls["write"] == n:
                rows, data = args[1], args[2]
                call(args[0], rows[:len(rows) // 2], data[:len(rows) // 2], *args[3:])
                os.kill(os.getpid(), signal.SIGKILL)
        call(*args)

    def killing_io(self, rows, data, write):
        if write:
            return killing("merge", io, (self, rows, data, write))
        io(self, rows, data, write)

    def killing_append(self, rows, records):
        killing("append", append, (self, rows, records))

    def killing_json(path, value):
        last = path.endswith("tier.json") and value.get("commit") == 2
        if last and where == "before_rename":
            os.kill(os.getpid(), signal.SIGKILL)
        write_json(path, value)
        if last and where == "after_rename":
            os.kill(os.getpid(), signal.SIGKILL)
        if path.endswith("tier.json"):
            calls["commit"] = value["commit"]

    def small_log(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.log_bytes = log_bytes

    store.RowStore._io, store._write_json, store.RowStore.__init__ = killing_io, killing_json, small_log
    rows_file.WriteLog.append = killing_append
    t.train_offloaded(sys.argv[3])
    sys.exit(3)  # not killed: the test's kill point was never reached
""")


def train_offloaded(path: str) -> None:
    """What the child runs: COMMIT_AT steps, a flush (commit 1), the rest, a flush (commit 2)."""
    plan = se.plan([se.FeatureSpec("f", _spec(path), B)], make_mesh(1))
    rng = jax.random.key(0)
    tables, tiers = se.init_tables(plan, rng), se.offload.Tiers(plan, rng)
    step_fn = jax.jit(jax.grad(_loss(plan)), donate_argnums=0)
    for i, ids in enumerate(_batches()):
        batch, _, swap = tiers.preprocess(ids)
        tables = step_fn(tiers.swap(tables, swap), batch, i)
        if i + 1 == COMMIT_AT:
            tables = tiers.flush(tables, step=COMMIT_AT)
    tiers.flush(tables, step=STEPS)


def _in_memory(steps: int) -> np.ndarray:
    """`[V, D + D]` the in-memory table and accumulator after `steps` steps."""
    plan = se.plan([se.FeatureSpec("f", _spec(None), B)], make_mesh(1))
    tables = se.init_tables(plan, jax.random.key(0))
    step_fn = jax.jit(jax.grad(_loss(plan)), donate_argnums=0)
    for i, ids in enumerate(_batches()[:steps]):
        tables = step_fn(tables, se.preprocess(plan, ids)[0], i)
    state = se.unstack_state(plan, tables)["items"]
    return np.concatenate([state["table"], state["accumulator"]], axis=1)


@pytest.fixture(scope="module")
def references() -> dict[int, np.ndarray]:
    return {COMMIT_AT: _in_memory(COMMIT_AT), STEPS: _in_memory(STEPS)}


_NEVER = 1 << 40  # log_bytes: the write log is merged at commits only


@pytest.mark.parametrize("where,n,log_bytes,committed", [
    ("append", 3, _NEVER, COMMIT_AT),  # a write-back after the first commit, half its rows appended to the log
    ("append", 6, _NEVER, COMMIT_AT),
    ("merge", 2, 4000, COMMIT_AT),  # a merge of the log between commits (by the writer), half its rows written
    ("append_flush", 1, _NEVER, COMMIT_AT),  # the second flush's first write of cached rows
    ("merge_flush", 1, _NEVER, COMMIT_AT),  # the second commit's merge of the log, half its first rows written
    ("before_rename", 0, _NEVER, COMMIT_AT),  # the second commit's rows and bitmap durable, tier.json not renamed
    ("after_rename", 0, _NEVER, STEPS),  # committed, the old undo log not yet removed
])
def test_a_store_killed_mid_write_opens_as_its_last_commit(tmp_path, references, where, n, log_bytes, committed):
    path = str(tmp_path / "store")
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "JAX_PLATFORMS": "cpu"}
    child = subprocess.run([sys.executable, "-c", CHILD, where, str(n), path, str(log_bytes)], env=env,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    store = RowStore(_spec(path))
    assert store.step == committed
    rows = np.flatnonzero(store.written)
    assert rows.size > CACHE  # evictions happened: the store holds more than one cache's worth
    np.testing.assert_array_equal(store.read(rows), references[committed][rows])
    assert os.path.getsize(tmp_path / "store" / f"undo.{store.commit + 1}.log") == 0  # the rollback consumed the log
    assert os.path.getsize(tmp_path / "store" / "log.bin") == 0  # and dropped the write log
    # the rows it does not hold are the ones no step up to the commit changed: still their initial values
    untouched = np.setdiff1d(np.arange(V), rows)
    initial = _in_memory(0)
    np.testing.assert_array_equal(references[committed][untouched], initial[untouched])
    store.close()
