"""prefetch: background preprocessing equals serial `preprocess`, in order; errors, early exit, buffer bound."""

from __future__ import annotations

import gc
import itertools
import os
import subprocess
import sys
import textwrap
import threading
import time
import traceback

import chex
import jax
import numpy as np
import pytest

import sparse_embed as se
import reference as ref
from sparse_embed.host import plan_state

WORKER = "sparse_embed.prefetch"


def _plan(mesh):
    """Two auto-capacity stacks (pooled and sequence features), as test_preprocess's, with mean gains."""
    a = se.TableSpec("a", 50, 4, combiner="mean")
    b = se.TableSpec("b", 13, 4, combiner="sum")
    feats = {
        "fa": se.FeatureSpec("fa", a, 16),
        "fb": se.FeatureSpec("fb", b, 8),
        "fseq": se.FeatureSpec("fseq", b, 8, max_sequence_length=2),
    }
    return se.plan(feats, mesh, stacking=None)


def _ids_and_weights(plan, seed: int, hot: bool = False):
    """Random ragged `({feature: ids}, {feature: weights})`; `hot`: "fa" needs a larger capacity (80 ids on shard 0)."""
    rng = np.random.default_rng(seed)
    ids, weights = {}, {}
    for name, f in plan.features.items():
        samples = ref.random_samples(rng, f.batch_size, f.table.vocabulary_size, 4, weighted=True)
        ids[name], weights[name] = ref.render(samples, "list")
    if hot:
        ids["fa"] = [np.arange(40) % 7 * 8 for _ in range(plan.features["fa"].batch_size)]
        weights["fa"] = [np.ones(40, np.float32) for _ in ids["fa"]]
    return ids, weights


def _items(plan, n: int = 5):
    """n items `(ids, weights, labels)`; item 2 grows the auto capacity of stack "a"."""
    return [(*_ids_and_weights(plan, seed, hot=seed == 2), np.full(4, seed)) for seed in range(n)]


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WORKER]


@pytest.fixture(autouse=True)
def _no_worker_left_behind():
    yield
    if _workers():  # a full collection costs seconds on the suite's heap: only when a worker is still there
        gc.collect()  # abandoned prefetchers signal their worker when collected
        for t in _workers():
            t.join(timeout=60)
    assert not _workers()


# The ways an item can hold the ids: (ids, weights, labels) -> item, and the matching inputs=.
FORMS = {
    "ids": (lambda ids, w, labels: ids, None),
    "ids_labels": (lambda ids, w, labels: (ids, labels), lambda item: item[0]),
    "weighted": (lambda ids, w, labels: {"ids": ids, "w": w, "labels": labels}, lambda item: (item["ids"], item["w"])),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("buffer_size", [1, 3])
@pytest.mark.parametrize("device_put", [True, False], ids=["device_put", "numpy"])
def test_equals_serial_preprocess_in_order(mesh8, form, buffer_size, device_put):
    make_item, inputs = FORMS[form]
    plan, serial_plan = _plan(mesh8), _plan(mesh8)  # separate auto-capacity marks
    raw = _items(plan)
    items = [make_item(*x) for x in raw]

    with se.prefetch(plan, items, inputs=inputs, buffer_size=buffer_size, device_put=device_put) as batches:
        got = list(batches)

    assert len(got) == len(items)
    for out, item, (ids, weights, _) in zip(got, items, raw):
        assert out.item is item
        want_batch, want_stats = se.preprocess(serial_plan, ids, weights if form == "weighted" else None,
                                               device_put=False)
        chex.assert_trees_all_equal(_host(out.batch), want_batch)
        assert out.stats == want_stats
        for x in jax.tree.leaves(out.batch):
            assert isinstance(x, jax.Array) == device_put
            if device_put:
                assert x.sharding.is_equivalent_to(plan.batch_sharding(), x.ndim)
    caps = [out.batch["a"].capacity for out in got]
    assert caps[1] < caps[2] == caps[-1]  # the capacity grew on item 2, as in the serial loop
    assert plan_state.of(plan).marks() == plan_state.of(serial_plan).marks()


def test_jitted_steps_in_the_main_thread_while_the_worker_grows_capacity(mesh8):
    """The loop jits with the plan as a static argument while the worker updates its auto-capacity mark."""
    plan, serial_plan = _plan(mesh8), _plan(mesh8)
    tables = se.init_tables(plan, jax.random.key(0))
    step = jax.jit(se.lookup, static_argnums=0)
    items = _items(plan, 6)
    with se.prefetch(plan, items, inputs=lambda item: item[:2], buffer_size=2) as batches:
        acts = [_host(step(plan, batch, tables)) for batch, _, _ in batches]
    want = [_host(se.lookup(serial_plan, se.preprocess(serial_plan, ids, w)[0], tables)) for ids, w, _ in items]
    chex.assert_trees_all_close(acts, want, rtol=1e-6)


def _bad_id(plan, i):
    ids, _ = _ids_and_weights(plan, i)
    if i == 3:
        ids["fb"][5] = np.array([2, 13])  # id 13: past table b's 13 rows
    return ids


def _failing_source(plan, i):
    if i == 3:
        raise RuntimeError("the reader failed at record 3")
    return _ids_and_weights(plan, i)[0]


@pytest.mark.parametrize("make, error, message, raised_in", [
    (_bad_id, ValueError, r"Feature 'fb' \(table 'b'\).*out of range", "preprocess"),
    (_failing_source, RuntimeError, "the reader failed at record 3", "_failing_source"),
], ids=["bad_id", "source_raises"])
def test_worker_error_is_raised_at_its_item_with_the_original_traceback(mesh8, make, error, message, raised_in):
    plan = _plan(mesh8)
    source = (make(plan, i) for i in itertools.count())  # infinite: nothing after the error is read
    batches = se.prefetch(plan, source)
    got = []
    with pytest.raises(error, match=message) as info:
        for batch, _, _ in batches:
            got.append(batch)
    assert len(got) == 3
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert raised_in in frames  # the worker's frames, not only the re-raise
    assert any("item 3 of the input" in n for n in info.value.__notes__)
    assert not batches.running and next(batches, None) is None  # exhausted, the worker has ended


def test_a_stop_iteration_raised_by_inputs_is_an_error_at_its_item_not_the_end_of_the_input(mesh8):
    plan = _plan(mesh8)

    def pick(i):
        if i == 3:
            raise StopIteration
        return _ids_and_weights(plan, i)[0]

    got = []
    with pytest.raises(RuntimeError, match=r"inputs\(item\) raised StopIteration") as info:
        for batch, _, _ in se.prefetch(plan, range(6), inputs=pick):
            got.append(batch)
    assert len(got) == 3 and any("item 3 of the input" in n for n in info.value.__notes__)


class _Source:
    """An infinite generator of the same ids that counts the items read and records its close."""

    def __init__(self, plan, signal_at: int = 0):
        self.pulled, self.closed = 0, False
        self.signal_at, self.reached = signal_at, threading.Event()  # set when `signal_at` items are read
        self.items = self._run(_ids_and_weights(plan, 0)[0])

    def _run(self, ids):
        try:
            while True:
                self.pulled += 1
                if self.pulled == self.signal_at:
                    self.reached.set()
                yield ids
        finally:
            self.closed = True


@pytest.mark.parametrize("how", ["with_break", "close", "abandoned"])
def test_leaving_early_stops_the_worker_and_closes_the_source(mesh8, how):
    plan = _plan(mesh8)
    source = _Source(plan)
    batches = se.prefetch(plan, source.items, buffer_size=2)
    worker = [t for t in _workers() if t.is_alive()]
    assert len(worker) == 1
    if how == "with_break":
        with batches:
            for i, _ in enumerate(batches):
                if i == 3:
                    break
    elif how == "close":
        next(batches)
        batches.close()
        batches.close()  # idempotent
    else:
        for i, _ in enumerate(batches):
            if i == 3:
                break
        del batches
        gc.collect()
        worker[0].join(timeout=60)  # collection only signals the worker
    assert not worker[0].is_alive() and source.closed
    if how != "abandoned":
        assert not batches.running and next(batches, None) is None


@pytest.mark.parametrize("buffer_size", [1, 3])
def test_worker_runs_ahead_by_buffer_size(mesh8, buffer_size):
    plan = _plan(mesh8)
    source = _Source(plan, signal_at=1 + buffer_size)
    with se.prefetch(plan, source.items, buffer_size=buffer_size) as batches:
        next(batches)  # item 0 taken: the worker reads items 1 .. buffer_size before they are asked for
        assert source.reached.wait(timeout=120)  # a safety net against a hang, not a timing
        time.sleep(0.2)  # a chance for a wrong worker to read further (only a bug can fail this)
        assert source.pulled == 1 + buffer_size


@pytest.mark.parametrize("buffer_size, error", [
    (0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError), ("2", TypeError), (None, TypeError),
])
def test_bad_buffer_size(mesh8, buffer_size, error):
    with pytest.raises(error, match="buffer_size must be"):
        se.prefetch(_plan(mesh8), [], buffer_size=buffer_size)


def test_bad_arguments_and_items(mesh8):
    plan = _plan(mesh8)
    with pytest.raises(TypeError, match="batches must be an iterable"):
        se.prefetch(plan, 3)
    with pytest.raises(TypeError, match="plan must be an EmbeddingPlan"):
        se.prefetch("plan", [])
    with pytest.raises(TypeError, match="inputs must be a function"):
        se.prefetch(plan, [], inputs=0)
    ids = _ids_and_weights(plan, 0)[0]
    with pytest.raises(TypeError, match=r"pass inputs= to say which part"):
        next(se.prefetch(plan, [(ids, np.zeros(4))]))
    with pytest.raises(TypeError, match=r"inputs\(item\) returned a list"):
        next(se.prefetch(plan, [ids], inputs=lambda item: [item]))


def test_empty_input(mesh8):
    batches = se.prefetch(_plan(mesh8), iter([]))
    assert list(batches) == [] and not batches.running


def test_interpreter_exits_with_a_running_worker():
    """A prefetcher over an infinite input that is never closed does not hold up (or crash) the exit."""
    script = textwrap.dedent("""
        import itertools, numpy as np, sparse_embed as se
        t = se.TableSpec("t", 100, 4)
        plan = se.plan({"f": se.FeatureSpec("f", t, 8)})
        batches = se.prefetch(plan, itertools.repeat({"f": np.arange(8)}), buffer_size=2)
        next(batches)
        print("consumed")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "consumed" and "Traceback" not in done.stderr


def test_in_loop_prepares_each_item_when_asked_with_the_prefetcher_interface(mesh8):
    """`InLoop` (Tiers.prefetch under several processes with a raw-id table): no worker; each item prepared in the
    loop's thread as it is taken, equal to serial `preprocess`; an error at its item, then exhausted; close()
    closes the input."""
    from sparse_embed.host.prefetching import InLoop

    plan = _plan(mesh8)
    source, threads = _Source(plan), []

    def prepare(ids):
        threads.append(threading.current_thread())
        return se.preprocess(plan, ids)

    with InLoop(prepare, source.items) as batches:
        assert isinstance(batches, se.Prefetcher) and batches.running and source.pulled == 0 and not _workers()
        for i in range(3):
            got = next(batches)
            assert source.pulled == i + 1  # nothing read ahead
            chex.assert_trees_all_equal(_host(got), _host(se.preprocess(plan, _ids_and_weights(plan, 0)[0])))
    assert threads == [threading.current_thread()] * 3
    assert source.closed and not batches.running and next(batches, None) is None

    failing = InLoop(lambda ids: se.preprocess(plan, ids), (_bad_id(plan, i) for i in itertools.count()))
    got = [next(failing) for _ in range(3)]
    with pytest.raises(ValueError, match=r"Feature 'fb' \(table 'b'\).*out of range") as info:
        next(failing)
    assert len(got) == 3 and any("the loop's thread, preparing, on item 3 of the input" in n
                                 for n in info.value.__notes__)
    assert not failing.running and next(failing, None) is None
    assert list(InLoop(prepare, iter([]))) == []


def test_under_several_processes_close_fills_the_buffer_first():
    """Under jax.distributed a prefetcher closed early stopped its worker at its current item: a process whose
    input was slower had called preprocess fewer times, the other's worker waited for it in vain (10 minutes),
    and the plan's next exchanges met another batch's numbers. With `fill_on_close` (what `prefetch` and
    `Loader` set for a plan over several processes) the worker first prepares `buffer_size` items past the last
    one taken, on every process alike, whatever the input's speed."""
    from sparse_embed.host.prefetching import Prefetcher

    for slow in (0.0, 0.05):
        calls = []

        def items():
            for i in itertools.count():
                time.sleep(slow)
                yield i

        p = Prefetcher(lambda i: calls.append(i) or i, items(), 3, fill_on_close=True)
        assert [next(p) for _ in range(2)] == [0, 1]
        p.close()
        assert calls == [0, 1, 2, 3, 4], (slow, calls)  # 2 taken + buffer_size
    p = Prefetcher(lambda i: i, iter(range(2)), 3, fill_on_close=True)  # the input ends first: no wait
    assert list(p) == [0, 1]
    p.close()
    p = Prefetcher(lambda i: i, iter(range(2)), 3, fill_on_close=True)
    next(p)
    p.close()  # the end is in the buffer: no wait either
