"""Raw 64-bit ids -> rows, on the shard that owns each id: admission, LRU eviction, expiry.

A table declared with `TableSpec(dynamic=Dynamic(...))` is keyed by raw
ids. Preprocessing sends each id to the shard chosen by a hash of the id
(`core.raw_keys.owner_shards`), with the distinct ids of each segment in
`RawIdBatch.keys`. `map_ids`, inside the train step before `lookup`,
runs on every shard (`shard_map`): it exchanges the ids (`all_to_all`), looks
them up in the shard's `KeySet`, admits new ids (after `admit_after`
occurrences), gives them free rows or the rows of the least recently used
ids, re-initialises those rows and their slots, and sends each segment its
rows back. The batch it returns is an ordinary one for `lookup` (a
`ShardedCooMatrix`); ids without a row become padding (they read zeros and
get no update; with a `Dynamic.default` set, a `MappedIdBatch` carries
their gains, and they read the default).

Because an id's row and its map entry live on the same shard and every
decision is a function of the (global) batch and the state, the mapping is
the same on every process and for any process count; a change of mesh goes
through the checkpoint (`io`), which stores ids with their rows.

State per stack (`IdMap`): the rows' `KeySet` (16 bytes per row), for
`admit_after > 1` a second one of waiting ids and their counts, and the
init seed. Training steps change the map; `train=False` (eval, serving)
only reads it.
"""

from __future__ import annotations

import functools
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparse_embed.core import kernels, key_set
from sparse_embed.core.batch import MappedIdBatch, RawIdBatch, ShardedCooMatrix, is_batch, layout_error
from sparse_embed.core.initializers import TruncatedNormal, mix32, seeds, truncated_normal_rows
from sparse_embed.core.key_set import FREE, KeySet
from sparse_embed.core.planning import EmbeddingPlan, StackPlan
from sparse_embed.core.state import AD_TRACERS, SLOT_DTYPE, EmbeddingVariables, check_state, checked_step
from sparse_embed.core.tables import check_rng, table_seeds


class IdMap(NamedTuple):
    """One raw-id stack's map, sharded over the plan's axis like its table.

    `rows`: the rows' `KeySet` (`sorted_keys [S*R, 2]`, `order [S*R]` the
    local row of each, `last [S*R]` by row, `size [S]`); `pending`/`counts`:
    ids waiting for admission and their occurrences (`[S*P]`; None with
    `admit_after == 1`); `seed [S, 2]` uint32: the table's init seed (new
    rows' values depend on it and the id only).
    """

    rows: KeySet
    pending: KeySet | None
    counts: jax.Array | None
    seed: jax.Array


class IdMapStats(NamedTuple):
    """One step of one raw-id stack, summed over shards (int32 scalars; jit outputs).

    admitted: ids given a row. evicted: ids that lost their row to a new id
    (least recently used). expired: ids that lost their row after
    `expire_after` idle steps. waiting: distinct ids looked up that have no
    row yet (below `admit_after`; they read zeros or the default). no_room: ids admitted
    but left without a row (every row of their shard was used this step).
    forgotten: waiting ids dropped from a full pending set. occupancy: rows
    in use after the step. pending: ids waiting after the step.
    """

    admitted: jax.Array
    evicted: jax.Array
    expired: jax.Array
    waiting: jax.Array
    no_room: jax.Array
    forgotten: jax.Array
    occupancy: jax.Array
    pending: jax.Array


def dynamic_stacks(plan: EmbeddingPlan) -> tuple[StackPlan, ...]:
    return tuple(s for s in plan.stacks if s.dynamic is not None)


def pending_per_shard(stack: StackPlan) -> int:
    """Waiting ids one shard tracks (0 with `admit_after == 1`)."""
    d = stack.dynamic
    if d.admit_after == 1:
        return 0
    return d.pending_capacity if d.pending_capacity is not None else stack.rows_per_shard


def shard_capacity(stack: StackPlan, shard: jax.Array) -> jax.Array:
    """Rows shard `shard` may use: `vocabulary_size` rows in all, spread as MOD sharding spreads ids."""
    vocab, S = stack.first.vocabulary_size, stack.num_shards
    return jnp.maximum((vocab - shard + S - 1) // S, 0).astype(jnp.int32)


def compact_keys(stack: StackPlan) -> bool:
    """Whether the stack's map keeps 4-byte keys (`Dynamic.id_bits` small enough for its rows per shard)."""
    bits = stack.dynamic.id_bits
    return bits is not None and bits <= key_set.compact_bits(stack.rows_per_shard)


def _empty_sets(n: int, S: int, compact: bool = False) -> KeySet:
    one = key_set.empty(n, compact)
    return KeySet(jnp.tile(one.sorted_keys, (S,) + (1,) * (one.sorted_keys.ndim - 1)), jnp.tile(one.last, S),
                  jnp.tile(one.order, S), jnp.zeros((S,), jnp.int32), jnp.tile(one.directory, S),
                  jnp.tile(one.span, S))


def init_id_maps(plan: EmbeddingPlan, rng: jax.Array) -> dict[str, IdMap]:
    """Empty maps of every raw-id stack, `{stack: IdMap}`, sharded; `rng` as given to `init_tables`."""
    check_rng(rng)
    return _init_jit(plan, rng)


@functools.partial(jax.jit, static_argnums=0)
def _init_jit(plan: EmbeddingPlan, rng: jax.Array) -> dict[str, IdMap]:
    stacks = dynamic_stacks(plan)
    all_seeds = table_seeds(rng, [s.first.name for s in stacks])
    out = {}
    for s, one in zip(stacks, all_seeds):
        S, pend = s.num_shards, pending_per_shard(s)
        seed = jnp.tile(one[None], (S, 1))
        out[s.name] = IdMap(_empty_sets(s.rows_per_shard, S, compact_keys(s)), _empty_sets(pend, S) if pend else None,
                            jnp.zeros((S * pend,), jnp.int32) if pend else None, seed)
    return jax.lax.with_sharding_constraint(out, plan.table_sharding())


@functools.lru_cache(maxsize=64)
def _map_shapes(plan: EmbeddingPlan) -> dict:
    """`{stack: IdMap of (shape, dtype)}`: what `init_id_maps(plan, ...)` makes (`check_raw_batch`)."""
    shapes = jax.eval_shape(lambda: _init_jit(plan, jax.random.key(0)))
    return {k: jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), m) for k, m in shapes.items()}


def with_directories(plan: EmbeddingPlan, id_maps: Mapping[str, IdMap]) -> dict[str, IdMap]:
    """The maps with every shard's directory rebuilt from its keys and order (after a host-side placement, which
    writes wide sets: those of stacks with `compact_keys` come out compact)."""
    return _directories_jit(plan, dict(id_maps))


@functools.partial(jax.jit, static_argnums=0)
def _directories_jit(plan: EmbeddingPlan, id_maps):
    axis, compact = plan.axis_name, {s.name: compact_keys(s) for s in dynamic_stacks(plan)}

    def body(maps):
        fix = lambda ks: None if ks is None else key_set.with_directory(ks)
        rows = lambda k, ks: key_set.compacted(key_set.widen(ks) if key_set.is_compact(ks) else ks) if compact[k] \
            else fix(ks)
        return {k: _stacked(IdMap(rows(k, m.rows), fix(m.pending), m.counts, m.seed))
                for k, m in ((k, _local(m)) for k, m in maps.items())}

    return jax.shard_map(body, mesh=plan.mesh, in_specs=P(axis), out_specs=P(axis))(id_maps)


def initial_rows(stack: StackPlan, seed: jax.Array, keys: jax.Array) -> jax.Array:
    """`[Q, dim]` the initial values of new rows for ids `keys [Q, 2]`: a function of the seed and the id only."""
    t, dim = stack.first, stack.embedding_dim
    init = t.resolved_initializer
    if isinstance(init, TruncatedNormal):  # positional: (seed, hi) -> row seed, lo -> row
        row_seed = jnp.stack([seed[0] ^ mix32(keys[:, 0].astype(jnp.uint32)), jnp.broadcast_to(seed[1], keys.shape[:1])], -1)
        return truncated_normal_rows(row_seed, keys[:, 1].astype(jnp.uint32), dim, init.stddev, t.dtype)
    base = jax.random.wrap_key_data(seed, impl="threefry2x32")
    key = lambda k: jax.random.fold_in(jax.random.fold_in(base, k[0]), k[1])
    return jax.vmap(lambda k: init(key(k), (1, dim), t.dtype)[0].astype(t.dtype))(keys)


class _Mapped(NamedTuple):
    entries: tuple  # (rows, gains): what `finish` gives (see `_map_shard`)
    ids: IdMap
    tables: EmbeddingVariables | None  # with the new ids' rows (re)initialised (None: no tables given)
    stats: IdMapStats
    new_rows: jax.Array  # [Q] the row each distinct id was given this step (-1: none; it had one, or got none)


def _wait(stack: StackPlan, m: IdMap, u: jax.Array, miss: jax.Array, occ: jax.Array, step: jax.Array,
          search: kernels.KeySearch):
    """Counts the missing ids' occurrences; returns (admit mask, new pending set, counts, forgotten)."""
    d, pend = stack.dynamic, m.pending
    pslot = jnp.where(miss, search.find(pend, u), -1)
    stale = (pslot >= 0) & _expired(d, pend.last, pslot, step)
    known = (pslot >= 0) & ~stale
    cnt = jnp.where(known, m.counts[jnp.maximum(pslot, 0)], 0) + occ
    admit = miss & (cnt >= d.admit_after)
    wait = miss & ~admit
    n = pend.order.shape[0]
    leave = jnp.zeros((n,), bool).at[jnp.where((admit | stale) & (pslot >= 0), pslot, n)].set(True, mode="drop")
    stay = jnp.where(wait & known, pslot, n)
    pend = pend._replace(last=pend.last.at[stay].set(step, mode="drop"))
    ins = search.insert(pend, jnp.asarray(n, jnp.int32), u, wait & ~known, leave, step)
    counts = m.counts.at[stay].set(cnt, mode="drop").at[key_set.drop_missing(ins.slots, n)].set(cnt, mode="drop")
    forgotten = ins.evicted + (wait & ~known & (ins.slots < 0)).sum()
    return admit, ins.set, counts, forgotten


def _expired(d, last: jax.Array, slot: jax.Array, step: jax.Array) -> jax.Array:
    if d.expire_after is None:
        return jnp.zeros(slot.shape, bool)
    return (slot >= 0) & (last[jnp.maximum(slot, 0)] < step - d.expire_after)


def _stale_before(d, step: jax.Array):
    """A train step's touch sets found ids' last = step, except expired ones (they keep theirs, so `_expired`
    still sees them): those last used before this."""
    return jnp.iinfo(jnp.int32).min if d.expire_after is None else step - d.expire_after


def _map_shard(stack: StackPlan, v: EmbeddingVariables, m: IdMap, u: jax.Array, occ: jax.Array, step: jax.Array,
               shard: jax.Array, train: bool, search: kernels.KeySearch, touched, finish) -> _Mapped:
    """One shard: the distinct ids `u [Q, 2]` (any order; FREE = none) mapped, the new map and tables (`v`
    None: no tables, the rows live elsewhere: `_Mapped.new_rows` says which to initialise).

    `search` searches a `KeySet` (`key_set`'s functions, or the native kernel's); `touched`: in a train step,
    `search.touch`'s result for `m.rows` and `u` (every stack's touched together, see `_map_jit`), with
    `finish`'s result for the rows it found if the touch computed that too; `finish`: the distinct ids' rows
    `[Q]` (negative: none) -> what the entries get (`_Mapped.entries`).
    """
    d, rows, R = stack.dynamic, m.rows, stack.rows_per_shard
    if train:
        slot, last, missing, *found_entries = touched
        rows = rows._replace(last=last)
    else:
        slot = search.find(rows, u)
    expired = _expired(d, rows.last, slot, step)
    if d.expire_after is None:  # every id found is a hit, and `slot` (-1: none) its row
        hit, found = slot >= 0, slot
    else:
        hit = (slot >= 0) & ~expired
        found = jnp.where(hit, slot, -1)
    miss = lambda: (u[:, 0] != FREE) & ~hit  # (a function: most train steps need it only in `place` below)
    zero, none = jnp.zeros((), jnp.int32), jnp.minimum(found, -1)  # (no id given a row; varying as `found`)
    if not train:
        stats = IdMapStats(zero, zero, zero, miss().sum(), zero, zero, rows.size,
                           zero if m.pending is None else m.pending.size)
        return _Mapped(finish(found), m, v, stats, none)
    if m.pending is None:  # every miss is admitted
        admit, pend, counts, forgotten = miss, None, None, zero
    else:
        wanted, pend, counts, forgotten = _wait(stack, m, u, miss(), occ, step, search)
        admit = lambda: wanted
    removed = None if d.expire_after is None else jnp.zeros((R,), bool).at[jnp.where(expired, slot, R)].set(
        True, mode="drop")

    def place(v):  # ids to admit, or expired ones: insert (evicting if full) and initialise the new rows
        want = admit()
        ins = search.insert(rows, shard_capacity(stack, shard), u, want, removed, step)
        new = ins.slots >= 0  # admitted ids are misses: none of them has a row in `found`
        tally = jnp.stack([new.sum(), ins.evicted, (want & ~new).sum()]).astype(jnp.int32)
        v = None if v is None else _reinit(stack, v, m.seed, u, ins.slots, new)
        return finish(jnp.where(new, ins.slots, found)), ins.set, v, tally, jnp.where(new, ins.slots, -1)

    def keep(v):  # most steps: no map or table array changes, nothing to build (the touch may have finished)
        return tuple(found_entries) or finish(found), rows, v, jnp.zeros_like(found, shape=(3,)), none

    if removed is not None:
        changes = admit().any() | removed.any()
    else:  # the search counted the misses: no pass over the ids on steps that admit nothing
        changes = missing > 0 if m.pending is None else admit().any()
    out, rows, v, (admitted, evicted, no_room), new_rows = jax.lax.cond(changes, place, keep, v)
    waiting = zero if m.pending is None else (miss() & ~wanted).sum()
    stats = IdMapStats(admitted, evicted, expired.sum(), waiting, no_room, forgotten, rows.size,
                       zero if pend is None else pend.size)
    return _Mapped(out, IdMap(rows, pend, counts, m.seed), v, stats, new_rows)


_REINIT_CHUNK = 1024  # new rows initialised per round: the cost follows the new ids, not the batch's


def _reinit(stack: StackPlan, v: EmbeddingVariables, seed: jax.Array, u: jax.Array, rows: jax.Array,
            new: jax.Array) -> EmbeddingVariables:
    """The new rows (and their slots) set to their initial values, `_REINIT_CHUNK` new ids per round.

    Only the new ids' initial values are computed (a truncated normal per
    value is not cheap: a hash and an inverse error function), in as
    many rounds as there are chunks of new ids; none without a new id.
    """
    R, q = stack.rows_per_shard, u.shape[0]
    k = max(1, min(q, _REINIT_CHUNK))
    which, count = key_set.compact(jnp.arange(q, dtype=jnp.int32), new, -(-q // k) * k, -1)  # new ids first
    specs = stack.optimizer.slots(stack.embedding_dim)

    def write(i, v: EmbeddingVariables) -> EmbeddingVariables:
        at = jax.lax.dynamic_slice(which, (i * k,), (k,))
        dest = jnp.where(at >= 0, rows[jnp.maximum(at, 0)], R)
        table = v.table.at[dest].set(initial_rows(stack, seed, u[jnp.maximum(at, 0)]).astype(v.table.dtype),
                                     mode="drop")
        slots = {n: a.at[dest].set(jnp.full((1, a.shape[1]), specs[n].init, SLOT_DTYPE), mode="drop")
                 for n, a in v.slots.items()}
        return EmbeddingVariables(table, slots)

    return jax.lax.fori_loop(0, (count + k - 1) // k, write, v)


def _local(m: IdMap) -> IdMap:
    """Inside shard_map: sizes `[1]` -> `[]`, seed `[1, 2]` -> `[2]`."""
    fix = lambda ks: None if ks is None else ks._replace(size=ks.size[0])
    return IdMap(fix(m.rows), fix(m.pending), m.counts, m.seed[0])


def _stacked(m: IdMap) -> IdMap:
    fix = lambda ks: None if ks is None else ks._replace(size=ks.size[None])
    return IdMap(fix(m.rows), fix(m.pending), m.counts, m.seed[None])


class _Received(NamedTuple):
    """One shard's ids of a stack from every source: the distinct ones `u [Q, 2]` (FREE = none), each entry's
    index among what was received `slot_of [S * C]`, and those indices' distinct id (`inverse`, None with one
    source: its ids arrive distinct) and occurrences (`occ`, only for admission counts)."""

    u: jax.Array
    slot_of: jax.Array
    inverse: jax.Array | None
    occ: jax.Array | None

    def entries(self, coo: RawIdBatch) -> tuple[jax.Array, jax.Array] | None:
        """With one source (its entries are this device's own), `(slot_of, gains)`: what a touch that hands the
        entries their rows takes (`KeySearch.touch_many`); None with several (their rows travel back first)."""
        return (self.slot_of, coo.values) if self.inverse is None else None


def _receive(stack: StackPlan, axis: str, coo: RawIdBatch, search: kernels.KeySearch) -> _Received:
    """Inside shard_map: every source sends each shard the ids it owns (the lookup's exchange)."""
    S = stack.num_shards
    C = coo.col_ids.shape[0] // S
    send = lambda x: jax.lax.all_to_all(x.reshape(S, C, *x.shape[1:]), axis, 0, 0, tiled=True)
    cols, keys = send(coo.col_ids), send(coo.keys)  # [D, C], [D, C, 2] from every source
    # each entry's slot among the distinct ids received (out of range: none; one source: its own column)
    slot_of = (cols if S == 1 else jnp.where(cols < C, jnp.arange(S)[:, None] * C + cols, S * C)).reshape(-1)
    u, inverse = (keys.reshape(C, 2), None) if S == 1 else search.unique(keys.reshape(S * C, 2))
    occ = None  # occurrences of each distinct id: only admission counts them
    if stack.dynamic.admit_after > 1:
        occ = jnp.zeros((S * C,), jnp.int32).at[slot_of].add(1, mode="drop")
        occ = occ if inverse is None else jnp.zeros((S * C,), jnp.int32).at[inverse].add(occ, mode="drop")
    return _Received(u, slot_of, inverse, occ)


def _stack_body(stack: StackPlan, axis: str, coo: RawIdBatch, v: EmbeddingVariables, m: IdMap,
                step: jax.Array, train: bool, search: kernels.KeySearch, rec: _Received, touched):
    """Inside shard_map, one stack: map the received ids, send every segment its rows."""
    S, R = stack.num_shards, stack.rows_per_shard
    C = coo.col_ids.shape[0] // S

    def finish(rows):  # the distinct ids' rows -> each received entry's row (unused entries: R), [its gain]
        if rec.inverse is None:  # one source: its ids arrive distinct (preprocessing numbered them)
            got = search.take(rows, rec.slot_of, R)
            return got, jnp.where(got < R, coo.values, 0.0)  # as key_set.entry_rows
        return search.take(search.take(rows, rec.inverse, R), rec.slot_of, R), None

    mapped = _map_shard(stack, v, m, rec.u, rec.occ, step, jax.lax.axis_index(axis), train, search, touched, finish)
    v, (rows, gains) = mapped.tables, mapped.entries
    back = jax.lax.all_to_all(rows.reshape(S, C), axis, 0, 0, tiled=True).reshape(-1)  # [S * C] in my layout
    gains = jnp.where(back < R, coo.values, 0.0) if gains is None else gains
    rows = (coo.shard_starts, coo.shard_ends, back, coo.row_ids, gains)
    if stack.dynamic.default is None:
        batch = ShardedCooMatrix(*rows, layout=coo.layout)
    else:  # per output row: the gains of its ids without a row
        lost = jnp.where((back >= R) & (coo.col_ids < C), coo.values, 0.0)
        batch = MappedIdBatch(*rows, jnp.zeros((stack.rows_per_device,), jnp.float32).at[coo.row_ids].add(
            lost, mode="drop"), layout=coo.layout)
    stats = jax.tree.map(lambda x: jax.lax.psum(x, axis), mapped.stats)
    return batch, v, mapped.ids, stats, (mapped.new_rows, rec.u)


def _check_raw_coo(plan: EmbeddingPlan, stack: StackPlan, coo: RawIdBatch) -> None:
    """One raw-id stack's batch entry: keyed, and shaped (`[D, S * capacity]`) and typed as this plan's."""
    if not is_batch(coo):
        raise TypeError(f"Stack {stack.name!r}: batch entry must be a RawIdBatch (from sparse_embed.preprocess), got "
                        f"{type(coo).__name__}.")
    if not isinstance(coo, RawIdBatch):
        raise ValueError(f"Stack {stack.name!r} is keyed by raw ids but its batch holds rows (no keys): it was "
                         "already mapped, or built for a plan where the table is not dynamic.")
    D, S, n = plan.num_shards, stack.num_shards, tuple(coo.col_ids.shape)
    arrays = coo[:6]  # shard_starts, shard_ends, col_ids, row_ids, values, keys
    shapes = [(D, S), (D, S), n, n, n, (*n, 2)]
    dtypes = [jnp.int32] * 4 + [jnp.float32, jnp.int32]
    if (len(n) != 2 or n[0] != D or n[1] % S or any(tuple(x.shape) != w for x, w in zip(arrays, shapes))
            or any(x.dtype != w for x, w in zip(arrays, dtypes))):
        raise ValueError(f"Stack {stack.name!r}: batch arrays have shapes {[tuple(x.shape) for x in arrays]} and "
                         f"dtypes {[str(x.dtype) for x in arrays]}, which do not fit this plan ({D} devices, {S} "
                         "shards): the batch was built by another plan; build it with "
                         "sparse_embed.preprocess(plan, ...).")
    why = layout_error(stack.name, coo.layout, stack.batch_layout)
    if why:
        raise ValueError(why)


def check_raw_batch(plan: EmbeddingPlan, batch: Mapping[str, ShardedCooMatrix], id_maps,
                    tables: Mapping[str, EmbeddingVariables] | None) -> None:
    """Clear errors for a batch, tables (None: not given) or maps that do not fit the plan, before `map_ids`
    reads an array.

    Only the stacks' names and the arrays' shapes tell which plan built a batch: one from a plan that stacks
    its tables otherwise, or from another mesh, is named as such (not a KeyError or a shard_map error).
    """
    dyn = {s.name for s in dynamic_stacks(plan)}
    if set(id_maps) != dyn:
        raise ValueError(f"id_maps has stacks {sorted(id_maps)} but the plan's raw-id stacks are {sorted(dyn)}; "
                         "make them with sparse_embed.init_id_maps(plan, rng).")
    want = _map_shapes(plan)
    for name in sorted(dyn):
        got = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), id_maps[name])
        if got != want[name]:
            raise ValueError(f"Stack {name!r}: its id map does not fit this plan (arrays {jax.tree.leaves(got)}, "
                             f"the plan's {jax.tree.leaves(want[name])}): it was made for another plan (another "
                             "vocabulary_size, Dynamic settings or mesh); make it with sparse_embed.init_id_maps(plan, "
                             "rng), or restore it into this plan.")
    missing, unknown = sorted(set(plan.stack_names) - set(batch)), sorted(set(batch) - set(plan.stack_names))
    if missing or unknown:
        raise ValueError(f"batch has stacks {sorted(batch)} but the plan has {sorted(plan.stack_names)} (stacks "
                         f"missing {missing}, unknown {unknown}): the batch was built by another plan (other tables, "
                         "or tables stacked otherwise); build it with sparse_embed.preprocess(plan, ...).")
    if tables is not None:
        check_state(plan, tables)
    for s in dynamic_stacks(plan):
        _check_raw_coo(plan, s, batch[s.name])


def map_ids(
    plan: EmbeddingPlan,
    batch: Mapping[str, ShardedCooMatrix],
    tables: Mapping[str, EmbeddingVariables],
    id_maps: Mapping[str, IdMap],
    step: jax.Array | int,
    *,
    train: bool = True,
) -> tuple[dict[str, ShardedCooMatrix], dict[str, EmbeddingVariables], dict[str, IdMap], dict[str, IdMapStats]]:
    """Maps the raw ids of a batch to rows: `(batch, tables, id_maps, {stack: IdMapStats})`. Jit-able.

    Call it in the train step before `lookup`, with the batch from
    `preprocess` and the state from `init_id_maps`; replace `tables` and
    `id_maps` with what it returns (new ids' rows are re-initialised).
    Stacks without raw ids pass through. `train=False` (eval) admits,
    evicts and touches nothing: ids without a row read zeros (or `Dynamic.default`).
    """
    check_raw_batch(plan, batch, id_maps, tables)
    differentiated = sorted(s.name for s in dynamic_stacks(plan)
                            if any(isinstance(x, AD_TRACERS) for x in jax.tree.leaves(tables[s.name])))
    if differentiated:  # (jax would say only that a while_loop has no reverse-mode derivative)
        raise ValueError(f"map_ids: the tables of raw-id stacks {differentiated} are being differentiated: map_ids "
                         "was called inside jax.grad's (or nnx.value_and_grad's) loss. It changes the tables and id "
                         "maps and has no gradient: call it in the train step before the grad, and give the loss the "
                         "batch and tables it returns (docs/raw_ids.md).")
    step = checked_step(step, "map_ids").astype(jnp.int32)
    return _map_jit(plan, train, dict(batch), dict(tables), dict(id_maps), step)[:4]


def map_rows(plan: EmbeddingPlan, batch: Mapping[str, ShardedCooMatrix], id_maps: Mapping[str, IdMap],
             step: jax.Array | int, *, train: bool = True):
    """`map_ids` for raw-id tables whose rows live elsewhere (offloaded: `sparse_embed.tiers` caches the rows
    this maps ids to): `(batch, id_maps, {stack: IdMapStats}, {stack: (rows, keys)})`, the same map and batch
    as `map_ids`'. `rows [S * Q]` int32 (replicated): the row on shard `i // Q` each id `keys[i]` (`[S * Q, 2]`
    words) was given this step, -1 for none; those rows (and slots) start from `initial_rows` of their id."""
    check_raw_batch(plan, batch, id_maps, None)
    step = checked_step(step, "map_rows").astype(jnp.int32)
    batch, _, maps, stats, new = _map_jit(plan, train, dict(batch), None, dict(id_maps), step)
    return batch, maps, stats, new


@functools.partial(jax.jit, static_argnums=(0, 1))
def _map_jit(plan: EmbeddingPlan, train: bool, batch, tables, id_maps, step):
    """`(batch, tables, id_maps, stats, new)`: `map_ids`' results, and with `tables` None (`map_rows`) the
    rows each stack gave its new ids (else {})."""
    axis, dyn = plan.axis_name, dynamic_stacks(plan)
    if not dyn:
        return batch, tables, id_maps, {}, {}
    rows_only = tables is None
    tables = {} if rows_only else tables

    def body(batch, tables, maps, step):
        coo = {s.name: jax.tree.map(lambda x: x[0], batch[s.name]) for s in dyn}
        local = {s.name: _local(maps[s.name]) for s in dyn}
        search = {s.name: kernels.key_search(plan, s) for s in dyn}
        rec = {s.name: _receive(s, axis, coo[s.name], search[s.name]) for s in dyn}
        touched = {}
        if train:  # the stacks of one kernel touch their maps in one call: their searches share the cores
            groups: dict = {}
            for s in dyn:
                groups.setdefault(kernels.for_stack(plan, s), []).append(s)
            for group in groups.values():
                sets = [(local[s.name].rows, rec[s.name].u, _stale_before(s.dynamic, step),
                         rec[s.name].entries(coo[s.name])) for s in group]  # with one source: its entries' rows too
                done = search[group[0].name].touch_many(sets, step)
                touched.update({s.name: t for s, t in zip(group, done)})
        out = {}
        for s in dyn:
            b, v, m, st, new = _stack_body(s, axis, coo[s.name], tables.get(s.name), local[s.name], step, train,
                                           search[s.name], rec[s.name], touched.get(s.name))
            new = new if rows_only else ()
            out[s.name] = (jax.tree.map(lambda x: x[None], b), v, _stacked(m), st, new)
        return out

    sub = {s.name: batch[s.name] for s in dyn}
    specs = (P(axis), P(axis), P(axis), P())
    out_specs = {s.name: (P(axis), P(axis), P(axis), P(), P(axis)) for s in dyn}
    res = jax.shard_map(body, mesh=plan.mesh, in_specs=specs, out_specs=out_specs)(
        sub, {k: tables[k] for k in sub if k in tables}, id_maps, step)
    batch, tables = dict(batch), None if rows_only else dict(tables)
    for name, (b, v, _, _, _) in res.items():
        batch[name] = b
        if not rows_only:
            tables[name] = v
    maps, stats = {k: r[2] for k, r in res.items()}, {k: r[3] for k, r in res.items()}
    everywhere = NamedSharding(plan.mesh, P())  # the new rows: on every device (and process)
    return batch, tables, maps, stats, {k: jax.lax.with_sharding_constraint(r[4], everywhere)
                                        for k, r in res.items() if rows_only}
