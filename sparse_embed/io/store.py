"""The table store: every table and slot of a checkpoint as one zarr3 array in id order, streamed in chunks.

Layout: `<dir>/<table>/<key>/` (names percent-encoded), a zarr3 array
`[vocabulary_size, width]` of the table's dtype (slots float32), row `i`
being id `i`, in chunks of whole rows, each chunk followed by a CRC32C
(tensorstore's `crc32c` codec: a damaged chunk fails to read). It is
readable by any zarr3 reader, and means the same on any mesh.

Streaming: saving converts one chunk of one table's rows at a time from the
stacked MOD layout (`relayout.natural_chunk_fn`, one all_to_all) and each
process writes the rows of its own devices, while the next chunk is being
converted; restoring reads one chunk at a time and writes it into the
stacked state in place (`relayout.write_chunk_fn`, donated). Memory above
the state is a few chunks (`relayout.chunk_rows`, ~4 MiB per device:
small chunks keep that memory low, and larger ones saved no faster and
restored slower in benchmarks/checkpoint.py).

Each array's checksum (`io.integrity`) is summed from the pieces as they
are written or read, so the whole state is never held twice.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from sparse_embed.core.planning import EmbeddingPlan, StackPlan
from sparse_embed.core.relayout import TABLE_KEY, chunk_rows, natural_chunk_fn, natural_width, table_range, write_chunk_fn
from sparse_embed.core.state import EmbeddingVariables
from sparse_embed.io import direct
from sparse_embed.io.integrity import bind, combine, partial_sums, words_per_value

_IN_FLIGHT = 3  # chunks written or read ahead of the one being converted
CHUNK_BYTES = 1 << 22  # bytes of a device's piece of a chunk (and of a stored chunk); 4 MiB: see the docstring


class StoreReadError(Exception):
    """An array of the store cannot be read (missing, damaged chunk, wrong shape); `.array` = (table, key)."""

    def __init__(self, array: tuple[str, str], cause: Exception):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.array = array


def array_path(directory: str, table: str, key: str) -> str:
    quote = lambda s: urllib.parse.quote(s, safe="")  # noqa: E731
    return os.path.join(directory, quote(table), quote(key))


class Layout(NamedTuple):
    """What a stored array must be: its dtype, its width and (None: any) its rows."""

    dtype: Any
    width: int
    rows: int | None = None


_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
_BYTE_CODECS = [{"name": "bytes"}, {"name": "crc32c"}]  # 1-byte values (quantized tables) have no endianness


def _metadata(shape: tuple[int, int], dtype: Any, chunk: int) -> dict:
    """The zarr3 metadata of a stored array: the one format this module writes and reads."""
    return {
        "zarr_format": 3, "node_type": "array", "shape": list(shape), "data_type": np.dtype(dtype).name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(1, min(chunk, shape[0])), shape[1]]}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": _CODECS if np.dtype(dtype).itemsize > 1 else _BYTE_CODECS, "fill_value": np.zeros((), dtype).item(),
    }


def metadata_problem(meta: Any, want: Layout) -> str | None:
    """What in a stored array's zarr3 metadata differs from the format and `want`, or None.

    Every field is checked, since each changes what the stored bytes mean
    (dtype, shape, chunking, codecs, fill value) and the CRC32C of a chunk
    covers its bytes only: a dtype edited from float32 to int32 reads the
    same bits as other numbers.
    """
    if not isinstance(meta, dict):
        return "its metadata is not a JSON object"
    rows = want.rows if want.rows is not None else (meta.get("shape") or [0])[0]
    expected = _metadata((rows, want.width), want.dtype, 1)
    for field in sorted(set(meta) | set(expected)):
        got, exp = meta.get(field), expected.get(field)
        if field == "chunk_grid":  # any number of rows per chunk (chosen when written), whole rows
            shape = (got or {}).get("configuration", {}).get("chunk_shape") if isinstance(got, dict) else None
            ok = (isinstance(shape, list) and len(shape) == 2 and shape[1] == want.width and isinstance(shape[0], int)
                  and shape[0] >= 1 and got.get("name") == "regular" and set(got) == {"name", "configuration"})
        else:
            ok = got == exp and type(got) is type(exp)
        if not ok:
            return f"its stored {field} is {json.dumps(got)}, expected {json.dumps(exp)}"
    return None


def _context() -> ts.Context:
    return ts.Context({"data_copy_concurrency": {"limit": os.cpu_count() or 1}, "file_io_concurrency": {"limit": 8}})


def _create(path: str, shape: tuple[int, int], dtype: np.dtype, chunk: int, context: ts.Context) -> ts.Future:
    """Starts creating a new zarr3 array in chunks of `chunk` rows (at most the array's): a device's piece of a
    streamed chunk is one stored chunk, so no two processes ever write the same file. A future: a checkpoint
    creates every array at once, so that the file system's round trips (a few ms each) overlap instead of adding
    up over hundreds of arrays (tables x slots, id maps)."""
    metadata = _metadata(shape, dtype, chunk)
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}, "metadata": metadata}
    return ts.open(spec, create=True, delete_existing=True, context=context)


def open_array(directory: str, table: str, key: str, context: ts.Context | None = None, *,
               expect: Layout | None = None, write: bool = False) -> ts.TensorStore:
    """Opens a stored array; with `expect`, checks every field of its metadata first (StoreReadError)."""
    return _open_checked(directory, table, key, context, expect=expect, write=write)[0]


def _open_checked(directory: str, table: str, key: str, context: ts.Context | None = None, *,
                  expect: Layout | None = None, write: bool = False) -> tuple[ts.TensorStore, dict | None]:
    """`open_array`, and (with `expect`) the metadata it checked."""
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": array_path(directory, table, key)}}
    try:
        store = ts.open(spec, open=True, read=True, write=write, context=context or _context()).result()
        meta = None if expect is None else json.loads(store.kvstore.read("zarr.json").result().value)
        problem = None if expect is None else metadata_problem(meta, expect)
    except Exception as e:  # noqa: BLE001 - missing or damaged metadata
        raise StoreReadError((table, key), e) from None
    if problem:
        raise StoreReadError((table, key), ValueError(problem))
    return store, meta


class _Padded:
    """A started read of rows `[lo, lo + count)`; `.result()`: them as `[m, w]`, zero past `count`."""

    def __init__(self, store: ts.TensorStore, lo: int, m: int, count: int):
        self.future = store[lo: lo + count].read() if count > 0 else None
        self.shape, self.dtype = (m, store.shape[1]), store.dtype.numpy_dtype

    def result(self) -> np.ndarray:
        got = np.zeros((0, self.shape[1]), self.dtype) if self.future is None else self.future.result()
        if got.shape[0] == self.shape[0]:
            return got
        out = np.zeros(self.shape, self.dtype)
        out[: got.shape[0]] = got
        return out


def _keys(variables: EmbeddingVariables) -> dict[str, jax.Array]:
    return {TABLE_KEY: variables.table, **variables.slots}


# ----------------------------------------------------------------- writing
def write_state(directory: str, plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables]) -> dict[str, str]:
    """Streams the stacked state into the store at `directory`; returns `{"table/key": checksum}`.

    Under `jax.distributed` every process calls it with the same (shared) directory; each writes the rows of
    its own devices. Returns once every row is on disk.
    """
    context, sums, multi = _context(), {}, jax.process_count() > 1
    arrays = [(s, i, p.table.name, key, a, chunk_rows(s, natural_width(s, key) * a.dtype.itemsize, CHUNK_BYTES))
              for s in plan.stacks for key, a in _keys(tables[s.name]).items() for i, p in enumerate(s.tables)]
    if jax.process_index() == 0:
        os.makedirs(directory, exist_ok=True)  # also with no array to write: the caller adds files of its own
        creating = {(name, key): _create(array_path(directory, name, key), (s.tables[i].table.vocabulary_size,
                                         natural_width(s, key)), a.dtype, m, context) for s, i, name, key, a, m in arrays}
        stores = {k: f.result() for k, f in creating.items()}
    if multi:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("sparse_embed store created")
        stores = {(name, key): open_array(directory, name, key, context, write=True) for _, _, name, key, _, _ in arrays}
    for s, i, name, key, a, m in arrays:
        store = stores[name, key]
        sums[f"{name}/{key}"] = _write_table(plan, s, i, a, store, m), a.dtype, store.shape
    return {k: bind(combine([v], multi), dtype, shape) for k, (v, dtype, shape) in sums.items()}


def _write_table(plan: EmbeddingPlan, s: StackPlan, i: int, a: jax.Array, store: ts.TensorStore,
                 m: int) -> tuple[int, int]:
    """Writes table i's rows of the stacked array `a` chunk by chunk; returns this process's checksum sums."""
    fn, vocab, S = natural_chunk_fn(plan, s, m, store.shape[1]), store.shape[0], s.num_shards
    start, count, rotation = table_range(s, i)
    row_words = store.shape[1] * words_per_value(a.dtype)
    starts = range(0, -(-vocab // S), m)  # c0: a chunk's first local row
    sa = sb = 0
    pending, chunks = [], iter(starts)
    dispatch = lambda c0: None if c0 is None else (  # noqa: E731
        c0, fn(a, np.array([c0, start, count, rotation], np.int32)))
    nxt = dispatch(next(chunks, None))
    while nxt is not None:
        c0, chunk = nxt
        nxt = dispatch(next(chunks, None))  # convert the next chunk while this one is written
        for shard in chunk.addressable_shards:
            if shard.replica_id != 0:  # a copy on another mesh axis (tables replicated over it): written once
                continue
            lo = c0 * S + (shard.index[0].start or 0)
            rows = np.asarray(shard.data)[: max(0, min(m, vocab - lo))]
            if rows.shape[0] == 0:
                continue
            x, y = partial_sums(rows, lo * row_words)
            sa, sb = sa + x, sb + y
            pending.append((store[lo: lo + rows.shape[0]].write(rows), rows))  # rows live until written
        while len(pending) > _IN_FLIGHT * max(1, len(chunk.addressable_shards)):
            pending.pop(0)[0].result()
    for f, _ in pending:
        f.result()
    return sa, sb


def write_host(directory: str, arrays: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, str]:
    """Writes host arrays `{table: {key: [vocab, w]}}` into the store (one process); returns their checksums
    (`host_checksum`)."""
    context = _context()
    items = [(name, key, np.ascontiguousarray(a)) for name, keys in arrays.items() for key, a in keys.items()]
    creating = [_create(array_path(directory, name, key), a.shape, a.dtype,
                        max(1, CHUNK_BYTES // max(1, a.shape[1] * a.dtype.itemsize)), context) for name, key, a in items]
    writes = [f.result().write(a) for f, (_, _, a) in zip(creating, items)]  # every array in flight at once
    for w in writes:
        w.result()
    return {f"{name}/{key}": host_checksum(a) for name, key, a in items}


def host_checksum(a: np.ndarray) -> str:
    """The bound checksum (`integrity.bind`) of a whole host array, as `write_host` saves it."""
    return bind(combine([partial_sums(a, 0)], False), a.dtype, a.shape)


# ----------------------------------------------------------------- reading
def read_array(directory: str, table: str, key: str, target: jax.ShapeDtypeStruct) -> jax.Array:
    """One stored array, exactly `target`'s shape and dtype (StoreReadError otherwise), into its sharding."""
    rows, width = target.shape
    store = open_array(directory, table, key, expect=Layout(target.dtype, width, rows))

    def shard(index):
        lo, hi, _ = index[0].indices(rows)
        try:
            x = _Padded(store, lo, hi - lo, min(hi, store.shape[0]) - lo).result()
        except Exception as e:  # noqa: BLE001 - a damaged chunk
            raise StoreReadError((table, key), e) from None
        return x[:, index[1]]

    return jax.make_array_from_callback(target.shape, target.sharding, shard)


def read_host(directory: str, table: str, key: str, expect: Layout) -> tuple[np.ndarray, str]:
    """A stored array, whole, on the host (its metadata checked against `expect`), and its bound checksum."""
    store = open_array(directory, table, key, expect=expect)
    try:
        a = np.asarray(store.read().result())
    except Exception as e:  # noqa: BLE001 - a damaged chunk
        raise StoreReadError((table, key), e) from None
    return a, host_checksum(a)


def read_into_state(directory: str, plan: EmbeddingPlan, state: dict[str, EmbeddingVariables],
                    valid_rows: Mapping[str, int], *, owned: bool = False,
                    initialized: bool = True) -> tuple[dict[str, EmbeddingVariables], dict[str, str]]:
    """Streams the stored arrays into `state` (donated), ids `< valid_rows[table]` only.

    Every stored array must have exactly `valid_rows` rows and the state's dtype (StoreReadError). Returns
    the new state and `{"table/key": bound checksum}` of the values read (to compare with the saved ones).
    `owned=True`: the caller made `state` for this read and nothing else refers to its arrays or their
    memory (no other array, no numpy view of it); on CPU the rows are then read straight into its
    buffers (`io.direct`), else chunk by chunk through a compiled, donated relayout.
    `initialized=False` (with `owned`): `state`'s buffers hold any values (`direct.new_state`), and every
    row the store does not give gets its initial value here (0, or a slot's initial value).
    """
    context, sums, out, tasks = _context(), {}, {}, []
    multi = jax.process_count() > 1
    fast = owned and direct.available([a for v in state.values() for a in _keys(v).values()])
    if not (initialized or fast):
        raise ValueError("read_into_state: initialized=False needs owned=True and a state the direct path takes")
    if fast:
        state = jax.block_until_ready(state)  # written in place below (`io.direct`)
    for s in plan.stacks:
        arrays = _keys(state[s.name])
        for key in list(arrays):
            width = natural_width(s, key)  # (a placement that splits the columns over devices: the general path)
            whole = fast and not s.splits(width) and arrays[key].shape[1] == width
            views = direct.device_views(arrays[key]) if whole else None
            runs = None if views is None else direct.table_runs(s, views, valid_rows)
            if not initialized:
                if runs is not None:
                    direct.fill_rest(views, runs, direct.fill_value(s, key))
                else:  # the general path writes into initial values
                    arrays[key] = _filled(arrays[key], direct.fill_value(s, key))
            for i, p in enumerate(s.tables):
                expect = Layout(arrays[key].dtype, natural_width(s, key), valid_rows[p.table.name])
                store, meta = _open_checked(directory, p.table.name, key, context, expect=expect)
                name = f"{p.table.name}/{key}"
                if runs is not None:  # straight into the state's buffers, on every core
                    sums[name] = None, store.dtype.numpy_dtype, store.shape
                    chunk = meta["chunk_grid"]["configuration"]["chunk_shape"][0]
                    tasks += [((p.table.name, key), t) for t in direct.read_table(
                        array_path(directory, p.table.name, key), runs[i], store.shape[0], chunk, store.shape[1],
                        store.dtype.numpy_dtype)]
                    continue
                arrays[key], part = _read_table(plan, s, i, arrays[key], store, (p.table.name, key))
                sums[name] = part, store.dtype.numpy_dtype, store.shape
        if fast:  # new arrays of the same buffers, sharded as the general path returns them
            arrays = {k: direct.rewrapped(a, plan.table_sharding()) for k, a in arrays.items()}
        out[s.name] = EmbeddingVariables(arrays.pop(TABLE_KEY), arrays)
    try:
        for (table, key), part in direct.run(tasks).items():
            sums[f"{table}/{key}"] = (part, *sums[f"{table}/{key}"][1:])
    except direct.TaskError as e:
        raise StoreReadError(e.key, e.cause) from None
    return out, {k: bind(combine([v or (0, 0)], multi), dtype, shape) for k, (v, dtype, shape) in sums.items()}


def _filled(a: jax.Array, value) -> jax.Array:
    """A new array like `a` (its sharding), every element `value`."""
    return jax.jit(lambda: jnp.full(a.shape, value, a.dtype), out_shardings=a.sharding)()


def _read_table(plan: EmbeddingPlan, s: StackPlan, i: int, a: jax.Array, store: ts.TensorStore,
                name: tuple[str, str]) -> tuple[jax.Array, tuple[int, int]]:
    """Writes table i's rows (`[valid, width]` in id order, checked by `open_array`) from `store` into the
    stacked array `a` (donated), chunk by chunk."""
    S, (valid, width) = s.num_shards, store.shape
    m = chunk_rows(s, width * a.dtype.itemsize, CHUNK_BYTES)
    fn, (start, count, rotation) = write_chunk_fn(plan, s), table_range(s, i)
    sharding = plan.table_sharding()
    mine = [(d, idx[0].start or 0) for d, idx in sharding.addressable_devices_indices_map((S * m, width)).items()]
    row_words = width * words_per_value(a.dtype)
    sa = sb = 0

    def reads(c0: int) -> list:
        return [(c0 * S + k, _Padded(store, c0 * S + k, m, min(m, valid - c0 * S - k))) for _, k in mine]

    starts = list(range(0, -(-valid // S), m))
    ahead = [reads(c0) for c0 in starts[:_IN_FLIGHT]]
    for n, c0 in enumerate(starts):
        pieces = ahead.pop(0)
        if n + _IN_FLIGHT < len(starts):
            ahead.append(reads(starts[n + _IN_FLIGHT]))  # read ahead while this chunk is placed
        host, counted = [], set()
        for lo, future in pieces:
            try:
                x = future.result()
            except Exception as e:  # noqa: BLE001 - a damaged chunk
                raise StoreReadError(name, e) from None
            if valid > lo and lo not in counted:  # rows a device of another mesh axis also holds: counted once
                counted.add(lo)
                xa, xb = partial_sums(x[: valid - lo], lo * row_words)
                sa, sb = sa + xa, sb + xb
            host.append(x)
        chunk = jax.make_array_from_single_device_arrays(
            (S * m, width), sharding, [jax.device_put(x, d) for x, (d, _) in zip(host, mine)])
        a = fn(a, chunk, np.array([c0, start, count, rotation, valid], np.int32))
    return a, (sa, sb)
