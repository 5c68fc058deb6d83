"""`se.data.Loader` / `Preprocess` over grain: the batches equal `preprocess` of the same elements, and a loader
made from `get_state()` continues exactly (same batches, same capacities) where the first one stopped."""

from __future__ import annotations

import time

import grain
import jax
import numpy as np
import pytest

import sparse_embed as se
from conftest import make_mesh
from sparse_embed import data as sed
from sparse_embed.host import plan_state

B = 128


def make_plan(mesh=None):
    t = se.TableSpec("t", 50, 4)
    return se.plan([se.FeatureSpec("f", t, B), se.FeatureSpec("g", t, B)], mesh or make_mesh(8))


class Source:
    """Random ragged ids: a batch's width (ids per sample) grows then shrinks, so the auto capacity grows early."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict:
        rng = np.random.default_rng(i)
        width = 24 if i in (1, 2) else 2
        return {"f": rng.integers(0, 50, (B, width)), "g": rng.integers(-1, 50, (B, 3)), "i": np.int64(i)}


def ids_of(element):
    return {"f": element["f"], "g": element["g"]}


def dataset():
    return grain.MapDataset.source(Source()).shuffle(seed=5).to_iter_dataset()


def host(batch):
    return jax.tree.map(np.asarray, batch)


def assert_same_batches(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(g, w)


def test_loader_batches_equal_preprocess_of_the_same_elements():
    plan, reference = make_plan(), make_plan()
    order = [int(e["i"]) for e in dataset()]
    with sed.Loader(plan, dataset(), inputs=ids_of) as batches:
        got = list(batches)
    assert [int(p.item["i"]) for p in got] == order and sorted(order) == list(range(12))
    for p in got:
        batch, stats = se.preprocess(reference, ids_of(Source()[int(p.item["i"])]))
        assert_same_batches(host(p.batch), host(batch))
        assert p.stats == stats


@pytest.mark.parametrize("taken", [0, 1, 4, 11])
def test_a_loader_from_get_state_continues_exactly(taken):
    plan = make_plan()
    with sed.Loader(plan, dataset(), inputs=ids_of, buffer_size=3) as batches:
        first = [next(batches) for _ in range(taken)]
        state = batches.get_state()
        rest = list(batches)
    fresh = make_plan()  # a new run: a new plan object, its capacities not learned yet
    with sed.Loader(fresh, dataset(), inputs=ids_of, state=state) as resumed:
        again = list(resumed)
    assert len(first) + len(again) == 12
    assert [int(p.item["i"]) for p in again] == [int(p.item["i"]) for p in rest]
    for g, w in zip(again, rest):
        assert_same_batches(host(g.batch), host(w.batch))  # same shapes: the capacity marks came back
        assert g.stats == w.stats


def test_without_the_plan_state_the_capacity_would_differ():
    """What the test above guards against: a resumed run that re-learns capacities builds other shapes."""
    plan = make_plan()
    with sed.Loader(plan, dataset(), inputs=ids_of) as batches:
        list(batches)
    marks = batches.get_state()["plan"]["marks"]
    narrow = ids_of(Source()[0])  # 2 ids per sample: below the high-water mark of the 24-wide batches
    assert se.preprocess(make_plan(), narrow)[1].capacity != marks
    fresh = make_plan()
    assert plan_state.of(fresh).restore(batches.get_state()["plan"])
    assert se.preprocess(fresh, narrow)[1].capacity == marks


def test_plan_state_of_another_layout_is_ignored():
    plan = make_plan()
    se.preprocess(plan, ids_of(Source()[1]))
    other = make_plan(make_mesh(4))
    assert not plan_state.of(other).restore(plan_state.of(plan).snapshot())
    assert plan_state.of(other).marks() == {}


def test_preprocess_as_a_grain_map_transform():
    plan, reference = make_plan(), make_plan()
    ds = grain.MapDataset.source(Source()).map(lambda e: ids_of(e)).map(sed.Preprocess(plan, device_put=False))
    p = ds[3]
    batch, stats = se.preprocess(reference, ids_of(Source()[3]), device_put=False)
    assert_same_batches(p.batch, batch)
    assert p.stats == stats
    with pytest.raises(TypeError, match="plan must be an EmbeddingPlan"):
        sed.Preprocess("plan")


def test_preprocess_on_an_iter_dataset_grows_capacities_as_a_serial_loop():
    """The documented use (docs/data.md): on an IterDataset, in order on the iterating thread, so each batch's
    capacity is a serial loop's (on a MapDataset, grain's read threads ran it several elements at once)."""
    plan, reference = make_plan(), make_plan()
    ds = grain.MapDataset.source(Source()).to_iter_dataset(grain.ReadOptions(num_threads=8))
    got = [p.stats.capacity for p in ds.map(sed.Preprocess(plan, ids_of, device_put=False))]
    assert got == [se.preprocess(reference, ids_of(Source()[i]), device_put=False)[1].capacity for i in range(12)]


def test_a_loader_reads_a_map_dataset_a_few_batches_ahead():
    """An element is a whole batch and the Loader prepares batches ahead itself: a `MapDataset` given to it is read
    a few records ahead of the loop (grain's default read hundreds, 500 records on 16 threads, at every start)."""
    read = []

    class Counting(Source):
        def __len__(self) -> int:
            return 200

        def __getitem__(self, i: int) -> dict:
            read.append(i)
            return super().__getitem__(i % 12)

    with sed.Loader(make_plan(), grain.MapDataset.source(Counting()), inputs=ids_of, buffer_size=2) as batches:
        assert int(next(batches).item["i"]) == 0
        time.sleep(0.5)  # time to read ahead
        assert 1 <= len(read) <= 16, len(read)


def test_loader_bad_arguments():
    plan = make_plan()
    with pytest.raises(TypeError, match="dataset must be a grain MapDataset or IterDataset"):
        sed.Loader(plan, [1, 2])
    with pytest.raises(ValueError, match="state must be what Loader.get_state"):
        sed.Loader(plan, dataset(), state={"position": 3})
    for state, part in (({"input": None, "plan": None}, "input"), ({"input": {}, "plan": {}}, "input")):
        with pytest.raises(ValueError, match=f"state must be what Loader.get_state.* its '{part}' could not be"):
            sed.Loader(plan, dataset(), state=state)
    with sed.Loader(plan, dataset()) as loader:
        good = loader.get_state()
    with pytest.raises(ValueError, match="its 'plan' could not be restored"):
        sed.Loader(plan, dataset(), state={**good, "plan": None})
    with pytest.raises(ValueError, match="buffer_size must be >= 1"):
        sed.Loader(plan, dataset(), buffer_size=0)
    for inputs in ("f", {"f": 1}):  # once "'str' object is not callable", from the worker at the first batch
        with pytest.raises(TypeError, match=f"inputs must be a function element -> ids or \\(ids, weights\\), got "
                                            f"{type(inputs).__name__}"):
            sed.Loader(plan, dataset(), inputs=inputs)
        with pytest.raises(TypeError, match="inputs must be a function"):
            sed.Preprocess(plan, inputs)
    with sed.Loader(plan, dataset()) as batches:  # the element is not an ids mapping: the error comes at it
        with pytest.raises(ValueError, match="unknown features"):
            next(batches)


def test_loader_with_grain_worker_processes_resumes_exactly(tmp_path):
    """Reading and parsing in grain's worker processes (`mp_prefetch`): the state holds every worker's position."""
    from sparse_embed.examples.criteo_data import write_criteo

    path = write_criteo(str(tmp_path / "day.txt"), 32 * 12, vocabulary=60)
    table = se.TableSpec("c", 97, 4)
    plans = [se.plan([se.FeatureSpec("C1", table, 32)], make_mesh(8)) for _ in range(2)]

    def batches(plan, state=None, workers=2):
        source = sed.CriteoSource(path, 32, vocabulary=97, process_index=0, process_count=1)
        ds = grain.MapDataset.source(source).shuffle(seed=2).to_iter_dataset()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
        return sed.Loader(plan, ds, inputs=lambda b: {"C1": b.categorical[:, 0]}, state=state)

    with batches(plans[0]) as it:
        first = [next(it).item.labels for _ in range(5)]
        state = it.get_state()
        rest = [p.item for p in it]
    with batches(plans[1], state) as it:
        again = [p.item for p in it]
    # another worker count: a named refusal (grain's own IndexError escaped from the state read back)
    with pytest.raises(ValueError, match=r"over the same dataset \(under mp_prefetch: as many workers\): its "
                                         r"'input' could not be restored \(IndexError"):
        batches(plans[1], state, workers=3)
    assert len(first) + len(rest) == 12 and len(again) == len(rest)
    for g, w in zip(again, rest):
        np.testing.assert_array_equal(g.categorical, w.categorical)
        np.testing.assert_array_equal(g.labels, w.labels)


def test_loader_over_grain_batches_of_examples():
    """Per-example records batched by grain (`.batch`): the loader preprocesses grain's batches."""
    rng = np.random.default_rng(3)
    examples = [{"f": rng.integers(0, 50, 3), "g": rng.integers(-1, 50, 2)} for _ in range(3 * B)]
    plan, reference = make_plan(), make_plan()
    ds = grain.MapDataset.source(examples).batch(B)
    with sed.Loader(plan, ds) as batches:
        got = list(batches)
    assert len(got) == 3
    for k, p in enumerate(got):
        ids = {n: np.stack([e[n] for e in examples[k * B:(k + 1) * B]]) for n in ("f", "g")}
        assert_same_batches(host(p.batch), host(se.preprocess(reference, ids)[0]))


def _criteo_loader(path: str, batch: int, state=None, mp: bool = False):
    """A loader over a shuffled CriteoSource of global batch `batch` (one feature, C1)."""
    plan = se.plan([se.FeatureSpec("C1", se.TableSpec("c", 97, 4), batch)], make_mesh(8))
    ds = grain.MapDataset.source(sed.CriteoSource(path, batch, vocabulary=97, process_index=0, process_count=1))
    ds = ds.shuffle(seed=2).repeat(None).to_iter_dataset()
    if mp:
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=1))
    return sed.Loader(plan, ds, inputs=lambda b: {"C1": b.categorical[:, 0]}, state=state)


@pytest.mark.parametrize("mp", [False, True], ids=["in_process", "mp_prefetch"])
def test_a_criteo_loader_resumed_under_another_batch_size_is_refused(tmp_path, mp):
    """A CriteoSource record is a whole batch, so grain's saved position under another batch size is other
    examples: the resumed run read batch 3 of 64 where the first run had stopped after batch 3 of 32, silently."""
    from sparse_embed.examples.criteo_data import write_criteo

    path = write_criteo(str(tmp_path / "day.txt"), 32 * 12, vocabulary=60)
    with _criteo_loader(path, 32, mp=mp) as it:
        [next(it) for _ in range(3)]
        state = it.get_state()
    assert state["batch_sizes"] == {"C1": 32}
    with pytest.raises(ValueError, match=r"saved under batch sizes \{'C1': 32\}, this plan's are \{'C1': 64\} "
                                         r"\(first difference: feature 'C1'\).*CriteoSource element is a whole batch"):
        _criteo_loader(path, 64, state, mp)
    with _criteo_loader(path, 32, state, mp) as it:  # the same batch size: goes on
        next(it)
    old = {k: v for k, v in state.items() if k != "batch_sizes"}  # a state saved before batch_sizes: taken as is
    with _criteo_loader(path, 64, old, mp) as it:
        next(it)


def test_a_loader_resumed_under_another_batch_size_warns_over_other_datasets():
    """Where elements are examples batched after them, grain's position (in examples) is right at any batch size;
    the loader cannot tell that from a dataset of whole batches, so it warns, and goes on."""
    examples = [{"f": np.array([i % 50]), "g": np.array([-1])} for i in range(8 * B)]

    def loader(batch, state=None):
        plan = se.plan([se.FeatureSpec(n, se.TableSpec("t", 50, 4), batch) for n in ("f", "g")], make_mesh(8))
        return sed.Loader(plan, grain.MapDataset.source(examples).to_iter_dataset().batch(batch), state=state)

    with loader(B) as it:
        next(it)
        state = it.get_state()
    with pytest.warns(UserWarning, match=r"saved under batch sizes \{'f': 128, 'g': 128\}, this plan's are "
                                          r"\{'f': 256, 'g': 256\}.*right if an element is one example"):
        resumed = loader(2 * B, state)
    with resumed:
        assert np.asarray(next(resumed).item["f"])[:, 0].tolist() == [i % 50 for i in range(B, 3 * B)]
    with pytest.raises(ValueError, match="state must be what Loader.get_state"):
        loader(B, {**state, "batch_sizes": [B, B]})
