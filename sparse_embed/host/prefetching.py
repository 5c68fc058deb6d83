"""Background preprocessing: `preprocess` batch k+1 on a host thread while the device runs batch k.

    with se.prefetch(plan, data, inputs=lambda item: item[0]) as batches:
        for batch, stats, (ids, labels) in batches:
            tables, loss = train_step(tables, batch, labels)

A serial loop costs `preprocess + step` per batch; with the prefetch it costs
about `max(preprocess, step)` (`benchmarks/pipeline.py` measures both). A
plain iterator has no state to checkpoint: for a run that must resume
exactly, `se.data.Loader` runs this same worker over a grain dataset and
keeps the position and the capacities as of the batch taken (docs/data.md). One
worker thread (daemon) advances the input iterator, calls `preprocess` on
each item in order and hands the results over through a buffer of at most
`buffer_size` items. A thread and not a process: the plan holds a `Mesh` and
the batch must be put on this process's devices. And the overlap hardly
needs the GIL: the consumer spends the step waiting on the device, with the
GIL released, and `preprocess` spends most of its time in C and numpy loops
that release it.

Thread-safety: the worker is the only caller of `preprocess` for its items,
one at a time, in input order, so every batch equals `preprocess` of the
same inputs in a serial loop (`preprocess` is thread-safe; an auto
capacity's high-water mark is shared by every thread that preprocesses for
the plan). The input iterator is advanced in the worker thread, so a
generator's own work (reading, decoding) overlaps the step too; it must not
be advanced by any other thread. JAX settings that are local to a thread
(`jax.default_device`, `jax.transfer_guard`) do not apply in the worker.

Several processes (`jax.distributed`): each process's worker calls
`preprocess` in input order, as the processes must. Consume the same
number of batches on every process. A prefetcher closed early lets its
worker fill its buffer first (`buffer_size` items past the last one taken,
or up to the end of the input), so every process's worker has called
`preprocess` as many times: else a process whose input was slower stopped
an item short, the other's worker waited for it in vain for
`EXCHANGE_TIMEOUT_S`, and the processes' next exchanges for the plan met
another batch's numbers.
"""

from __future__ import annotations

import atexit
import collections
import functools
import itertools
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple

import jax
import numpy as np

from sparse_embed.core.batch import ShardedCooMatrix, Stats
from sparse_embed.core.planning import EmbeddingPlan
from sparse_embed.host import distributed
from sparse_embed.host.preprocessing import preprocess

_EXIT_JOIN_TIMEOUT_S = 10.0  # at interpreter exit, how long to wait for each worker's current item


class Prefetched(NamedTuple):
    """One prefetched item: what `preprocess` returned for it, and the item itself (e.g. with its labels)."""

    batch: dict[str, ShardedCooMatrix]
    stats: Stats
    item: Any


class _End:
    """The worker's last hand-over when the input is exhausted."""


_END = _End()


class _Failure(NamedTuple):
    """The worker's last hand-over when item `index` raised `error` (in the input iterator or preprocess)."""

    error: BaseException
    index: int


class _Slots:
    """A bounded hand-over from one producer to one consumer, which either side may close.

    The producer `reserve`s a slot *before* it starts an item, so at most
    `size` items are started but not yet taken (waiting in the buffer or
    being prepared), and `close` wakes a producer that waits for a slot.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: collections.deque = collections.deque()
        self._reserved = 0
        self._closed = False
        self._cond = threading.Condition()

    def reserve(self) -> bool:
        """Waits for a free slot and takes it; False once closed (the producer stops)."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._reserved < self._size)
            if self._closed:
                return False
            self._reserved += 1
            return True

    def put(self, x: Any) -> None:
        """Fills a reserved slot."""
        with self._cond:
            self._items.append(x)
            self._cond.notify_all()

    def take(self) -> Any:
        """Waits for the oldest item and frees its slot; `_END` once closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._items)
            if not self._items:
                return _END
            self._reserved -= 1
            self._cond.notify_all()
            return self._items.popleft()

    def wait_filled(self) -> None:
        """Waits until every slot holds a prepared item, or the producer has handed over its last one (`_END`, a
        `_Failure`), or `close` ran."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or len(self._items) >= self._size or bool(
                self._items and (self._items[-1] is _END or isinstance(self._items[-1], _Failure))))

    @property
    def closed(self) -> bool:
        """Whether `close` ran: the worker takes no item after its current one."""
        return self._closed

    def close(self) -> None:
        """Drops the buffered items and wakes both sides."""
        with self._cond:
            self._closed = True
            self._items.clear()
            self._cond.notify_all()


def _produce(slots: _Slots, source: Iterator[Any], prepare: Callable[[Any], Any]) -> None:
    """The worker thread: `prepare(item)` for each item in order, until the input ends, an item fails or `slots` closes.

    Holds no reference to its `Prefetcher`, so an abandoned prefetcher is
    garbage-collected, which closes `slots` and so stops this thread.
    """
    try:
        for index in itertools.count():
            if not slots.reserve():
                return
            try:
                item = next(source, _END)
                result = item if item is _END else prepare(item)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
                result = _Failure(e, index)
            slots.put(result)
            if result is _END or isinstance(result, _Failure):
                return
    finally:
        close = getattr(source, "close", None)
        if close is not None:  # a generator's `finally` blocks run now, in this thread
            close()


def _stop(slots: _Slots, thread: threading.Thread) -> None:
    """At interpreter exit: stops a worker and waits (a while) for its current item."""
    slots.close()
    thread.join(_EXIT_JOIN_TIMEOUT_S)


class Prefetcher(Iterator[Prefetched]):
    """Iterator of `Prefetched` items prepared by a background thread; a context manager. Build with `prefetch`.

    `close()` (also on leaving the `with` block, on garbage collection, and
    at interpreter exit) stops the worker: the items it prepared ahead are
    dropped and the input iterator is closed.
    """

    _unregister = staticmethod(atexit.unregister)  # bound here: module globals may be gone when __del__ runs at exit

    def __init__(self, prepare: Callable[[Any], Prefetched], source: Iterator[Any], buffer_size: int, *,
                 fill_on_close: bool = False) -> None:
        self._slots = _Slots(buffer_size)
        self._done = False
        self._fill_on_close = fill_on_close  # several processes: close() lets the worker fill the buffer first
        self._thread = threading.Thread(target=_produce, args=(self._slots, source, prepare),
                                        name="sparse_embed.prefetch", daemon=True)
        self._thread.start()
        # Stop the worker at interpreter exit, before JAX's exit handlers (registered earlier, so run later)
        # tear down the backend. The hook holds the worker, not this Prefetcher, so an abandoned one is
        # still garbage-collected (which stops the worker too).
        self._exit_hook = functools.partial(_stop, self._slots, self._thread)
        atexit.register(self._exit_hook)

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> Prefetched:
        """The next item, in input order. An error of the worker is raised here, at the failing item's position.

        The error keeps its traceback from the worker thread (plus a note of
        the item's index); the iterator is then exhausted.
        """
        if self._done:
            raise StopIteration
        result = self._take()
        if result is _END or isinstance(result, _Failure):
            self._fill_on_close = False  # the worker has ended: nothing more to fill
        if result is _END:
            self.close()
            raise StopIteration
        if isinstance(result, _Failure):
            self.close()
            if hasattr(result.error, "add_note"):  # Python >= 3.11
                result.error.add_note(f"(raised in {self._where}, on item {result.index} of the input)")
            raise result.error
        return result

    _where = "sparse_embed.prefetch's worker thread"

    def _take(self) -> Any:
        """The next prepared item, `_END` or a `_Failure`."""
        return self._slots.take()

    @property
    def running(self) -> bool:
        """Whether the worker thread is alive (it ends with the input, on an error, or on `close`)."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stops the worker and waits until it has finished its current item (idempotent).

        After `close` returns, no `preprocess` call of this prefetcher runs or
        will run. The wait is at most one `preprocess` call, plus one step of
        the input iterator; with `fill_on_close` (a plan over several
        processes), until the buffer is full or the input ended.
        """
        if self._fill_on_close and not self._done and self._thread is not threading.current_thread():
            self._slots.wait_filled()  # as many `preprocess` calls on every process (the module docstring)
        self._done = True
        self._slots.close()
        atexit.unregister(self._exit_hook)
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # Garbage collection can run in any thread, so this only signals (no join).
        slots, hook = getattr(self, "_slots", None), getattr(self, "_exit_hook", None)
        if slots is not None:
            slots.close()
        if hook is not None:
            self._unregister(hook)



class InLoop(Prefetcher):
    """A `Prefetcher` without a worker: each item is prepared in the loop's thread when asked for (no look-ahead).

    For work that must run in the same order on every process (a program over every process's devices, such as a
    raw-id map under `jax.distributed`): a worker thread beside the step would interleave the two differently on
    each process. Same interface: an error is raised at its item (then exhausted), `close()` closes the input.
    """

    _where = "the loop's thread, preparing"

    def __init__(self, prepare: Callable[[Any], Any], source: Iterator[Any]) -> None:
        self._prepare, self._source, self._index, self._done = prepare, source, 0, False

    def _take(self) -> Any:
        try:
            item = next(self._source, _END)
            result = item if item is _END else self._prepare(item)
        except BaseException as e:  # noqa: BLE001 - raised by __next__ with the item's index
            result = _Failure(e, self._index)
        self._index += 1
        return result

    @property
    def running(self) -> bool:
        """Whether items may still come (False once the input ended, an item failed, or after `close`)."""
        return not self._done

    def close(self) -> None:
        """Closes the input iterator (idempotent); no `prepare` runs after it."""
        if not self._done:
            self._done = True
            close = getattr(self._source, "close", None)
            if close is not None:
                close()


def _split(item: Any, inputs: Callable[[Any], Any] | None) -> tuple[Mapping[str, Any], Mapping[str, Any] | None]:
    """`(ids, weights)` of one input item: the item itself if it is the ids mapping, else what `inputs` picks."""
    if inputs is None:
        if isinstance(item, Mapping):
            return item, None
        raise TypeError(
            f"prefetch: an item of the input is a {type(item).__name__}, not a mapping feature name -> ids; "
            "pass inputs= to say which part of each item to preprocess, e.g. inputs=lambda item: item[0] for "
            "(ids, labels) items, or a function returning (ids, weights).")
    try:
        picked = inputs(item)
    except StopIteration as e:  # else it would end the input silently where the worker iterates
        raise RuntimeError("prefetch: inputs(item) raised StopIteration; return the item's ids, or end the "
                           "input itself.") from e
    if isinstance(picked, Mapping):
        return picked, None
    if isinstance(picked, tuple) and len(picked) == 2 and isinstance(picked[0], Mapping):
        return picked
    raise TypeError(f"prefetch: inputs(item) returned a {type(picked).__name__}; it must return the ids "
                    "(a mapping feature name -> ids) or an (ids, weights) pair.")


def _prepare(plan: EmbeddingPlan, inputs: Callable[[Any], Any] | None, device_put: bool, item: Any) -> Prefetched:
    """What the worker does for one item: preprocess it and, with `device_put`, wait until it is on the devices."""
    ids, weights = _split(item, inputs)
    batch, stats = preprocess(plan, ids, weights, device_put=device_put)
    if device_put:  # the host-to-device copy is done here, not in the consumer's step
        jax.block_until_ready(batch)
    return Prefetched(batch, stats, item)


def _check_buffer_size(buffer_size: Any) -> int:
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, (int, np.integer)):
        raise TypeError(f"buffer_size must be an int >= 1, got {buffer_size!r}.")
    if buffer_size < 1:
        raise ValueError(f"buffer_size must be >= 1 (the most items prepared ahead of the consumer), "
                         f"got {buffer_size}.")
    return int(buffer_size)


def prefetch(
    plan: EmbeddingPlan,
    batches: Iterable[Any],
    *,
    inputs: Callable[[Any], Any] | None = None,
    buffer_size: int = 2,
    device_put: bool = True,
) -> Prefetcher:
    """Preprocesses the items of `batches` in a background thread, `buffer_size` items ahead of the loop.

    Args:
      plan: the `EmbeddingPlan`.
      batches: an iterable (finite or infinite) of input items. By default an
        item is the ids mapping `{feature: ids}` that `preprocess` takes.
        Items are not copied: an input must not refill one item's arrays for
        the next (the worker reads `buffer_size` items ahead of the loop).
      inputs: for other items, picks what to preprocess: `item -> ids` or
        `item -> (ids, weights)`. E.g. `lambda item: item[0]` for
        `(ids, labels)` items.
      buffer_size: the most items taken from `batches` and not yet handed to
        the loop (prepared, or being prepared). 1 = double buffering; more
        absorbs uneven preprocess times. Each buffered batch holds its
        memory (on the devices, with `device_put`).
      device_put: as in `preprocess`; the worker also waits for the copy to
        the devices, so that it overlaps the step as well.

    Returns:
      A `Prefetcher`: an iterator of `Prefetched(batch, stats, item)` in input
      order, with `(batch, stats) == preprocess(plan, ids, weights)`. Use it
      as a context manager (or call `close()`) to stop the worker when you
      leave the loop early. The worker starts at once, so the first batches
      are prepared while, e.g., the step compiles.

    Raises:
      TypeError / ValueError here for a bad `buffer_size`, `inputs` or
      non-iterable `batches`. An exception in the worker (a bad id:
      `ValueError` naming the feature; an error of the input iterator or of
      `inputs`) is raised by the iterator at that item's position, after
      the items before it.

    See the module docstring for the thread-safety assumptions.
    """
    buffer_size = _check_buffer_size(buffer_size)
    if not isinstance(plan, EmbeddingPlan):
        raise TypeError(f"plan must be an EmbeddingPlan, got {type(plan).__name__}.")
    if inputs is not None and not callable(inputs):
        raise TypeError(f"inputs must be a function item -> ids or (ids, weights), got {type(inputs).__name__}.")
    try:
        source = iter(batches)
    except TypeError:
        raise TypeError(f"batches must be an iterable of input items, got {type(batches).__name__}.") from None
    return Prefetcher(functools.partial(_prepare, plan, inputs, device_put), source, buffer_size,
                      fill_on_close=distributed.spans_processes(plan))
