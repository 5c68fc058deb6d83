"""The id maps of a plan's offloaded raw-id tables: raw ids to table rows exactly as in memory, ahead of the step.

A raw-id table (`TableSpec(dynamic=...)`) maps its ids to rows with the
in-memory table's own map (`core.id_maps`: the same key sets on the same
shards, capacity, admission, eviction, expiry and counts), run by `Tiers`
when it plans a batch instead of in the train step: the map's decisions
depend on the ids and the steps only, never on a row's values. The rows it
gives are what the cache holds and the store keeps: table row `t` is row
`t // S` of shard `t % S`, as the in-memory table's unstacked rows are
numbered. A row given to a new id starts from that id's initial values
(`id_maps.initial_rows`), never from the store.

The map is kept per batch planned (the version after it) until that
batch's swap runs: a `flush` saves the map as of the swaps run, into the
store's directory before the store commits (`idmap.<commit>.npz`, each
process its own shards' part), so the store's commit holds both the rows
and the ids they belong to, and a store reopened, or restored to a kept
commit (`io.offload_checkpoint`), comes back with its map.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
import zlib
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from sparse_embed.core import id_maps as id_lib
from sparse_embed.core import planning
from sparse_embed.core.planning import EmbeddingPlan
from sparse_embed.core.relayout import TABLE_KEY
from sparse_embed.core.specs import TableSpec
from sparse_embed.core.state import SLOT_DTYPE
from sparse_embed.host.preprocessing import preprocess
from sparse_embed.tiers.store import CorruptStoreError, RowStore


class Mapped(NamedTuple):
    """One raw-id table's share of one batch: the in-memory batch mapped to table rows, and what the tier needs."""

    batch: Any  # the mapped batch (`ShardedCooMatrix`/`MappedIdBatch`): col_ids are rows of the table's shards
    rows: np.ndarray  # int64: this process's entries' table rows, flat (-1: padding, or an id without a row)
    new_rows: np.ndarray  # int64 [k]: the table rows given to new ids this batch
    new_keys: np.ndarray  # int32 [k, 2]: those ids (hi, lo words)
    id_stats: Any  # the map's `IdMapStats` of the batch (host ints)


def _local(x: jax.Array) -> np.ndarray:
    """This process's rows of an array sharded by its first axis (its devices' blocks, in order)."""
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])


def memory_plan(plan: EmbeddingPlan, specs: Mapping[str, TableSpec]) -> EmbeddingPlan:
    """The plan of the offloaded raw-id tables `specs` kept in memory: the stacks whose maps `IdMaps` runs (the
    same shards, features, capacities as the plan's caches of them)."""
    feats = [dataclasses.replace(f, table=dataclasses.replace(specs[f.table.name], storage=None))
             for f in plan.features.values() if f.table.name in specs]
    caps = {n: plan.stack_of_table(n)[0].capacity for n in specs}
    out = planning.plan(feats, plan.mesh, axis_name=plan.axis_name, stacking=None,
                        capacity={n: c for n, c in caps.items() if c is not None} or None,
                        on_overflow=plan.on_overflow, nonfinite_gradients=plan.nonfinite_gradients, kernel=plan.kernel)
    for name in specs:
        a, b = plan.stack_of_table(name)[0], out.stack_of_table(name)[0]
        layout = lambda s: [(f.feature.name, f.row_offset, f.rows_per_device) for f in s.features]  # noqa: E731
        if layout(a) != layout(b) or a.num_shards != b.num_shards or a.name != b.name:
            raise AssertionError(f"Table {name!r}: its in-memory stack lays its features out otherwise than its cache.")
    return out


class IdMaps:
    """The maps of a plan's offloaded raw-id tables (`Tiers` runs them; see the module doc)."""

    def __init__(self, plan: EmbeddingPlan, specs: Mapping[str, TableSpec], rng: jax.Array,
                 stores: Mapping[str, RowStore], process: tuple[int, int]) -> None:
        self.plan = memory_plan(plan, specs)
        self.process = process
        self._sharding = self.plan.table_sharding()
        self._shapes = jax.eval_shape(functools.partial(id_lib.init_id_maps, self.plan), rng)
        me = jax.process_index()
        local = sum(d.process_index == me for d in self.plan.mesh.devices.flat)
        saved = {n: _load(n, st, self._shapes[n], self.plan.num_shards, process, local) for n, st in stores.items()}
        fresh = id_lib.init_id_maps(self.plan, rng) if any(m is None for m in saved.values()) else {}
        self.swapped = {n: fresh[n] if m is None else self._placed(m, self._shapes[n]) for n, m in saved.items()}
        self.seeds = {n: np.asarray(m.seed.addressable_shards[0].data)[0] for n, m in self.swapped.items()}
        self._latest = self.swapped  # after the last batch planned
        # a training batch's step is not before the stores' commit nor the last training batch's: the map's
        # last-use steps would lie in its future (never evicted, never expired), as after a resume at step 0
        self._floor = max((st.step for st in stores.values() if st.step is not None), default=0)
        self._after: dict[int, dict] = {}  # batch planned, its swap not yet run -> the maps after it
        self.stacks = {n: self.plan.stack_of_table(n)[0] for n in specs}
        self._cache_stacks = {n: plan.stack_of_table(n)[0] for n in specs}

    def features(self) -> set[str]:
        return set(self.plan.features)

    def _placed(self, local: list[np.ndarray], shapes: Any) -> Any:
        leaves, tree = jax.tree.flatten(shapes)
        return jax.tree.unflatten(tree, [jax.make_array_from_process_local_data(self._sharding, x, s.shape)
                                         for x, s in zip(local, leaves)])

    def map(self, ids: Mapping[str, Any], weights: Mapping[str, Any], step: int, train: bool, index: int
            ) -> tuple[dict[str, Mapped], Any]:
        """Preprocesses and maps the raw-id features of batch `index` (planned in order): `({table: Mapped},
        Stats)`. The maps advance only when `keep(index)` is called (a batch refused later changes nothing)."""
        if train and step < self._floor:
            raise ValueError(f"Tables {sorted(self.stacks)}: a training batch at step {step} comes after step "
                             f"{self._floor} (the stores' last commit, or an earlier batch): steps count up, and after "
                             "a resume they go on from the restored step (Tiers.prefetch(..., step=restored_step)).")
        batch, stats = preprocess(self.plan, ids, weights or None)
        mapped, maps, id_stats, new = id_lib.map_rows(self.plan, batch, self._latest, step, train=train)
        out = {}
        for name, s in self.stacks.items():
            b, S, R = mapped[s.name], s.num_shards, s.rows_per_shard
            cols = _local(b.col_ids).astype(np.int64)
            cap = cols.shape[1] // S
            shard = np.arange(cols.shape[1]) // cap
            rows = np.where(cols < R, cols * S + shard, -1).reshape(-1)
            new_rows, keys = (np.asarray(x) for x in new[s.name])
            given = new_rows >= 0
            table_rows = (new_rows * S + np.arange(new_rows.size) // (new_rows.size // S))[given]
            out[name] = Mapped(b, rows, table_rows.astype(np.int64), keys[given],
                               jax.tree.map(lambda x: int(np.asarray(x)), id_stats[s.name]))
        self._pending = (index, maps, step if train else None)
        return out, stats

    def _raise_floor(self, step: int | None) -> None:
        """The earliest step a training batch may have from now on: at least `step` (None: unchanged)."""
        if step is not None:
            self._floor = max(self._floor, int(step))

    def keep(self, index: int) -> None:
        """The batch `map` last mapped was planned: its maps are the latest."""
        at, maps, step = self._pending
        assert at == index, (at, index)
        self._latest = self._after[index] = maps
        self._raise_floor(step)

    def ran(self, index: int) -> None:
        """Batch `index`'s swap ran: the maps as of the swaps run are the ones after it."""
        self.swapped = self._after.pop(index)

    def cached_batch(self, name: str, m: Mapped, cache_rows: np.ndarray, device_put: bool) -> Any:
        """`m.batch` reading the cache: each entry's row on its shard replaced by the cache row `cache_rows`
        (flat, -1: none) holds it there (also on its shard: `ShardedCacheMap`); `rows_per_shard` for none."""
        s, cache = self.stacks[name], self._cache_stacks[name]
        local = np.where(cache_rows >= 0, cache_rows // s.num_shards, cache.rows_per_shard).astype(np.int32)
        host = _local(m.batch.col_ids)
        cols = local.reshape(host.shape)
        if not device_put:  # marked as a batch of the cache's stack, which the lookup reads
            return jax.tree.map(_local, m.batch)._replace(col_ids=cols, layout=cache.batch_layout)
        col_ids = jax.make_array_from_process_local_data(m.batch.col_ids.sharding, cols, m.batch.col_ids.shape)
        return m.batch._replace(col_ids=col_ids, layout=cache.batch_layout)

    def generate(self, name: str, keys: np.ndarray, sharding: NamedSharding) -> dict[str, jax.Array]:
        """`{"table": [n, dim], slot: [n, width]}`: the initial values of the rows of ids `keys [n, 2]`
        (replicated), as the in-memory table gives a new id's row."""
        keys = jax.make_array_from_process_local_data(sharding, np.ascontiguousarray(keys, np.int32))
        seed = jax.make_array_from_process_local_data(sharding, self.seeds[name])
        return _initial(self.stacks[name], seed, keys)

    def save(self, name: str, store: RowStore, step: int | None) -> None:
        """Writes the map of table `name` as of the swaps run (this process's shards) as the store's next commit's
        (call right before `store.commit_step`), and removes those of commits the store no longer keeps."""
        self._raise_floor(step)
        leaves = [_local(x) for x in jax.tree.leaves(self.swapped[name])]
        meta = {"table": name, "shards": self.plan.num_shards, "process": self.process, "step": step,
                "crc32": [zlib.crc32(np.ascontiguousarray(x).tobytes()) for x in leaves]}
        buf = io.BytesIO()
        np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **{f"a{i}": x for i, x in
                                                                                 enumerate(leaves)})
        path = _path(store, store.commit + 1)
        with open(path + ".tmp", "wb") as f:
            f.write(buf.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)

    def prune(self, store: RowStore) -> None:
        """Removes the maps of commits the store no longer keeps (after its commit)."""
        keep = {os.path.basename(_path(store, h["commit"])) for h in store.history}
        for f in os.listdir(store.path):
            if f.startswith("idmap.") and f not in keep:
                os.remove(os.path.join(store.path, f))


@functools.partial(jax.jit, static_argnums=0)
def _initial(stack, seed: jax.Array, keys: jax.Array) -> dict[str, jax.Array]:
    """The initial row and slots of each id `keys [n, 2]` (`seed [2]`): what `map_ids` writes into a new id's row."""
    out = {TABLE_KEY: id_lib.initial_rows(stack, seed, keys)}
    for name, spec in stack.optimizer.slots(stack.embedding_dim).items():
        out[name] = jnp.full((keys.shape[0], spec.width), spec.init, SLOT_DTYPE)
    return out


def _path(store: RowStore, commit: int) -> str:
    return os.path.join(store.path, f"idmap.{commit}.npz")


def _load(name: str, store: RowStore, shapes: Any, shards: int, process: tuple[int, int],
          local_devices: int) -> list | None:
    """This process's part of the map the store's last commit holds (checked), or None: a store never committed."""
    commit = store.history[-1]["commit"]
    if commit == 0:
        return None
    path = _path(store, commit)
    if not os.path.exists(path):
        raise CorruptStoreError(f"Table {name!r}: the store at {store.path!r} (commit {commit}) has no id map "
                                f"({os.path.basename(path)}): it was not written by this raw-id table.")
    try:
        with open(path, "rb") as raw:
            data = raw.read()
        with np.load(io.BytesIO(data)) as f:
            meta = json.loads(f["meta"].tobytes())
            leaves = [f[f"a{i}"] for i in range(len(meta["crc32"]))]
    except Exception as e:  # noqa: BLE001 - a damaged file: a zip, json or npy error
        raise CorruptStoreError(f"Table {name!r}: the id map {path} cannot be read "
                                f"({type(e).__name__}: {e}).") from None
    if [zlib.crc32(np.ascontiguousarray(x).tobytes()) for x in leaves] != meta["crc32"]:
        raise CorruptStoreError(f"Table {name!r}: the id map {path} fails its checksum.")
    if meta["shards"] != shards or tuple(meta["process"]) != tuple(process):
        raise ValueError(f"Table {name!r}: its store's id map was saved on {meta['shards']} shards by process "
                         f"{meta['process'][0]} of {meta['process'][1]}, but this plan has {shards} shards and "
                         f"this is process {process[0]} of {process[1]}: the table's rows are numbered by its "
                         "shards, so train it on the same mesh.")
    want = [(s.shape[0] // shards * local_devices,) + s.shape[1:] for s in jax.tree.leaves(shapes)]
    if [x.shape for x in leaves] != want:
        raise ValueError(f"Table {name!r}: its store's id map does not fit the table's map (another capacity, "
                         f"id_bits or admit_after): arrays {[x.shape for x in leaves]}, expected {want}.")
    return leaves
