"""Input pipelines with grain: `preprocess` as a grain transform, and a loader whose state resumes exactly.

    source = se.data.CriteoSource(paths, batch_size=B, vocabulary=V)  # this process's rows of each batch
    read = grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)  # records are batches: a few ahead
    ds = grain.MapDataset.source(source).shuffle(seed=0).repeat(None).to_iter_dataset(read)
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2))  # reading and parsing in worker processes
    with se.data.Loader(plan, ds, inputs=se.data.criteo_ids, state=saved) as batches:
        for batch, stats, item in batches:
            ...
            ckpt.save(step, plan, tables, data=batches.get_state(), ...)

What runs where: grain's worker processes read and parse (the part of an
input pipeline that wants processes: Python-heavy, independent per
element); `preprocess` runs in this process, on one thread, in input
order, `buffer_size` batches ahead of the loop (`se.prefetch`'s worker
thread): it puts the batch on this process's devices, it keeps the plan's
auto-capacity high-water marks (`host.plan_state`), and under
`jax.distributed` it exchanges counts with the other processes in step, so
it cannot run in a worker process.

`Loader.get_state()` is the state *after the last batch the loop took*
(not after the batches prepared ahead): grain's iterator state after that
element, the plan's capacity marks right after its `preprocess`, and the
plan's batch sizes. A loader made with that `state` yields the next batch
exactly as the first run would have, with the same capacities (so the same
shapes and the same numbers).

grain's position counts the dataset's elements. Where an element is a
whole batch (`CriteoSource`: record `i` is batch `i`), the same position
under another batch size is other examples: a loader resumed so over a
`CriteoSource` is refused, and over any other dataset warned about (right
only where an element is one example, batched after it).
"""

from __future__ import annotations

import copy
import functools
import json
import warnings
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import grain
from absl import flags

from sparse_embed.core.planning import EmbeddingPlan
from sparse_embed.host import distributed, plan_state
from sparse_embed.host.criteo_source import CriteoSource
from sparse_embed.host.prefetching import Prefetched, Prefetcher, _check_buffer_size, _prepare


class Preprocess(grain.transforms.Map):
    """`preprocess` as a grain map transform: an element -> `Prefetched(batch, stats, element)`.

    `inputs` picks the ids (or `(ids, weights)`) of an element, as in
    `se.prefetch`; by default the element is the ids mapping. Run it in the
    main process (after `mp_prefetch`, never inside grain's worker
    processes: see the module docstring), on an `IterDataset`, which maps
    in order on the iterating thread: a `MapDataset` maps on grain's read
    threads, several elements at once, so auto capacities would grow in
    an order that varies by run (docs/data.md).
    """

    def __init__(self, plan: EmbeddingPlan, inputs: Callable[[Any], Any] | None = None, *,
                 device_put: bool = True) -> None:
        if not isinstance(plan, EmbeddingPlan):
            raise TypeError(f"plan must be an EmbeddingPlan, got {type(plan).__name__}.")
        if inputs is not None and not callable(inputs):  # (else "'str' object is not callable" at the first batch)
            raise TypeError(f"inputs must be a function element -> ids or (ids, weights), got "
                            f"{type(inputs).__name__}.")
        self.plan, self.inputs, self.device_put = plan, inputs, device_put

    def map(self, element: Any) -> Prefetched:
        return _prepare(self.plan, self.inputs, self.device_put, element)


class _Ready(NamedTuple):
    """One prepared batch and the loader's state once the loop has taken it."""

    prefetched: Prefetched
    state: dict


def _prepare_with_state(transform: Preprocess, pair: tuple[Any, Any]) -> _Ready:
    """The worker thread's work for one element: preprocess it, then note the state after it."""
    element, input_state = pair
    prefetched = transform.map(element)
    return _Ready(prefetched, {"input": input_state, "plan": plan_state.of(transform.plan).snapshot()})


# An element the Loader takes is a whole batch, and the Loader prepares `buffer_size` of them ahead itself: a
# `MapDataset` it is given is read a few records ahead (grain's default, 500 records on 16 threads, read hundreds of
# batches at every start). Read options of your own: pass `dataset.to_iter_dataset(read_options)`.
_READ_AHEAD = grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)


def _iterator(dataset: Any):
    """A grain dataset iterator of `dataset` (a `MapDataset` is read in order, a few records ahead).

    grain reads absl flags (`mp_prefetch`'s workers do): outside an absl app nothing has parsed them, so
    they are marked parsed here, with their defaults, as `absl.app.run` would leave them without arguments.
    """
    if isinstance(dataset, grain.MapDataset):
        dataset = dataset.to_iter_dataset(_READ_AHEAD)
    if not isinstance(dataset, grain.IterDataset):
        raise TypeError(f"dataset must be a grain MapDataset or IterDataset, got {type(dataset).__name__}.")
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return iter(dataset)


def _with_states(iterator) -> Iterator[tuple[Any, Any]]:
    """(element, grain's state after it) for each element; advanced in the worker thread, which closes it (and
    so grain's worker processes and their shared memory) when the loader closes."""
    try:
        for element in iterator:
            yield element, iterator.get_state()
    finally:
        iterator.close()


_STATE_PARTS = {"input", "plan", "batch_sizes"}  # a state saved before "batch_sizes" was kept has the first two


def _checked_state(state: Any) -> dict:
    if (not isinstance(state, Mapping) or not {"input", "plan"} <= set(state) <= _STATE_PARTS
            or not isinstance(state.get("batch_sizes", {}), Mapping)):
        raise ValueError("state must be what Loader.get_state() returned (a dict with 'input', 'plan' and "
                         "'batch_sizes'), got "
                         f"{type(state).__name__}{sorted(state) if isinstance(state, Mapping) else ''}.")
    return dict(state)


def _batch_sizes(plan: EmbeddingPlan) -> dict[str, int]:
    return {name: f.batch_size for name, f in sorted(plan.features.items())}


def _counts_batches(dataset: Any) -> bool:
    """Whether a `CriteoSource` is among the dataset's sources: grain's `parents` up to each source dataset
    (its `_source`), and `mp_prefetch`'s per-worker datasets (an interleave's `_datasets`, which has no parents)."""
    todo, seen = [dataset], set()
    while todo:
        d = todo.pop()
        if id(d) not in seen:
            seen.add(id(d))
            if isinstance(getattr(d, "_source", None), CriteoSource):
                return True
            todo.extend((*getattr(d, "parents", ()), *getattr(d, "_datasets", ())))
    return False


def _check_batch_sizes(now: dict[str, int], dataset: Any, state: Mapping) -> None:
    """A state saved under other batch sizes than `now`: ValueError over a `CriteoSource`, else a warning (module
    doc)."""
    saved = state.get("batch_sizes")
    if saved is None or saved == now:
        return
    diff = sorted(set(saved) ^ set(now)) or [n for n in now if saved[n] != now[n]]
    what = (f"the state was saved under batch sizes {saved}, this plan's are {now} (first difference: feature "
            f"{diff[0]!r}); grain's position is restored as saved, in the dataset's elements")
    if _counts_batches(dataset):
        raise ValueError(f"{what}, and a CriteoSource element is a whole batch: the resumed run would read other "
                         "examples than those after the saved step. Resume with the batch size it was saved with, "
                         "or start the input over (state=None).")
    warnings.warn(f"{what}: right if an element is one example (batched after it), other examples than those "
                  "after the saved step if an element is a batch.", stacklevel=3)


class Loader(Iterator[Prefetched]):
    """Iterator of `Prefetched(batch, stats, element)` over a grain dataset, with a checkpointable state.

    Args:
      plan: the `EmbeddingPlan`.
      dataset: a grain `IterDataset` (or `MapDataset`) of input elements.
      inputs: picks what to preprocess from an element (as `se.prefetch`).
      state: a `get_state()` of an earlier loader over the same dataset
        (e.g. from `CheckpointManager.restore(...).data`): continue after it.
      buffer_size, device_put: as `se.prefetch`.

    A context manager; `close()` stops the worker thread.
    """

    def __init__(self, plan: EmbeddingPlan, dataset: Any, *, inputs: Callable[[Any], Any] | None = None,
                 state: Mapping | None = None, buffer_size: int = 2, device_put: bool = True) -> None:
        transform = Preprocess(plan, inputs, device_put=device_put)
        buffer_size = _check_buffer_size(buffer_size)
        state = None if state is None else _checked_state(state)
        self._batch_sizes = _batch_sizes(plan)
        if state is not None:  # before the iterator (mp_prefetch's starts worker processes)
            _check_batch_sizes(self._batch_sizes, dataset, state)
        iterator = _iterator(dataset)
        if state is not None:
            for part, restore in (("input", lambda s: (iterator.set_state(s), iterator.get_state())),
                                  ("plan", plan_state.of(plan).restore)):
                try:  # (grain's state of another mp_prefetch worker count fails only when read back)
                    restore(copy.deepcopy(state[part]))
                except (TypeError, KeyError, AttributeError, ValueError, IndexError) as e:
                    raise ValueError(f"state must be what Loader.get_state() returned over the same dataset (under "
                                     f"mp_prefetch: as many workers): its {part!r} could not be restored "
                                     f"({type(e).__name__}: {e}).") from e
        self._state = {"input": iterator.get_state(), "plan": plan_state.of(plan).snapshot()}
        self._prefetcher = Prefetcher(functools.partial(_prepare_with_state, transform), _with_states(iterator),
                                      buffer_size, fill_on_close=distributed.spans_processes(plan))

    def __iter__(self) -> "Loader":
        return self

    def __next__(self) -> Prefetched:
        ready = next(self._prefetcher)
        self._state = ready.state
        return ready.prefetched

    def get_state(self) -> dict:
        """The state after the last batch taken: `{"input": grain's iterator state, "plan": capacity marks,
        "batch_sizes": {feature: global batch size}}`.

        JSON-serialisable (a `CheckpointManager` step holds it as `data=`).
        """
        return json.loads(json.dumps({**self._state, "batch_sizes": self._batch_sizes}))

    def close(self) -> None:
        self._prefetcher.close()

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

