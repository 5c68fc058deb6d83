"""A set of 64-bit keys on one shard, in fixed-size arrays: find, touch, insert with LRU eviction.

The raw-id tables' map (`id_maps`) keeps one per shard for the rows (slot =
local row) and one for ids still waiting for admission. Everything is
static-shape jnp, so it runs inside `shard_map` on any backend.

A key is a 64-bit id in `[0, 2**63)` held as two int32 words `(hi, lo)`
(jax runs without 64-bit integers by default); keys compare as the
unsigned 64-bit number. A free slot has `hi = -1`, which compares above
every key. State per slot, 16 bytes: `sorted_keys [N, 2]` (the live keys in
key order, then free markers), `order [N]` (the slot of each of those
positions: the `size` live slots first, then the free slots by slot index)
and `last [N]` by slot (the step it was last used, -1 when free); plus a
directory of `N / 16` buckets (a quarter byte per slot): the keys' values
scaled into buckets between the smallest and the largest key, and where
each bucket starts among the positions. A lookup searches its bucket only
(a few steps for keys spread over a range, `log N` at worst), whose keys
lie side by side in memory (one or two cache lines: what makes a lookup
cheap on a set far larger than the caches); an insert merges the new keys
in and rebuilds the directory in linear passes, `O(N + Q log N)`, without a
sort of the set.

A *compact* set (`sorted_keys [N]`, for ids below `2**id_bits` with
`id_bits <= compact_bits(N)`) holds only each key's low word: 12 bytes per
slot plus the directory. Its buckets are exact, `(key >> shift) - base`,
with `shift <= 32` the smallest that puts the live keys' range in the
buckets (`span [3]` int32: shift, base's two words), so a bucket's keys
share their high word; the search compares low words only. An insert
widens the set, inserts and compacts it again (`O(N)`, as an insert is).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

FREE = -1  # sorted_keys[:, 0] of a free position; last of a free slot


class KeySet(NamedTuple):
    """One shard's key set. `sorted_keys [N, 2]` int32 (compact: `[N]`, the low words), `last [N]` int32 (by
    slot), `order [N]` int32 (slot of each position), `size []` int32, `directory [B + 1]` int32 (bucket b's keys
    are at positions `directory[b]:directory[b + 1]`), `span [2]` float32 (the smallest key as a float, and
    buckets per unit of it; compact: `[3]` int32, see the module docstring)."""

    sorted_keys: jax.Array
    last: jax.Array
    order: jax.Array
    size: jax.Array
    directory: jax.Array
    span: jax.Array


def num_buckets(n: int) -> int:
    """Directory buckets of a set of `n` slots."""
    return max(1, n // 16)


def compact_bits(n: int) -> int:
    """The most id bits a compact set of `n` slots holds: a bucket's keys must share their high word."""
    return 32 + (num_buckets(n).bit_length() - 1)


def empty(n: int, compact: bool = False) -> KeySet:
    """A set of `n` free slots (compact: 4-byte keys, see the module docstring)."""
    keys = jnp.zeros((n,), jnp.int32) if compact else jnp.full((n, 2), FREE, jnp.int32)
    span = jnp.zeros((3,), jnp.int32) if compact else jnp.zeros((2,), jnp.float32)
    return KeySet(keys, jnp.full((n,), FREE, jnp.int32), jnp.arange(n, dtype=jnp.int32), jnp.zeros((), jnp.int32),
                  jnp.zeros((num_buckets(n) + 1,), jnp.int32), span)


def is_compact(s: KeySet) -> bool:
    return s.sorted_keys.ndim == 1


# 64-bit unsigned numbers as (hi, lo) uint32 words (jax runs without 64-bit integers). XLA's shifts by 32 or
# more give 0, which the shifts below rely on.
def _words(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    u = keys.astype(jnp.uint32)
    return u[..., 0], u[..., 1]


def _shr(hi, lo, t):
    """(hi, lo) >> t for 0 <= t <= 32."""
    t = jnp.asarray(t).astype(jnp.uint32)
    return hi >> t, (lo >> t) | (hi << (jnp.uint32(32) - t))


def _sub(ah, al, bh, bl):
    """(ah, al) - (bh, bl), modulo 2**64."""
    return ah - bh - (al < bl).astype(jnp.uint32), al - bl


def _add(ah, al, b):
    """(ah, al) + b for b uint32."""
    lo = al + b
    return ah + (lo < al).astype(jnp.uint32), lo


def _compact_bucket(s: KeySet, q: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For the keys of `q [Q, 2]` in a compact set: `(bucket, below, above)`, the bucket meaningful only
    where the key is neither below nor above the buckets' range."""
    b = s.directory.shape[0] - 1
    span = s.span.astype(jnp.uint32)
    xh, xl = _shr(*_words(q), span[0])
    below = (xh < span[1]) | ((xh == span[1]) & (xl < span[2]))
    dh, dl = _sub(xh, xl, span[1], span[2])
    above = ~below & ((dh != 0) | (dl >= b))
    return jnp.where(below | above, 0, dl).astype(jnp.int32), below, above


def full_keys(s: KeySet) -> jax.Array:
    """`[N, 2]` every position's key (free positions: FREE), whatever the layout."""
    if not is_compact(s):
        return s.sorted_keys
    n, b = s.order.shape[0], s.directory.shape[0] - 1
    p = jnp.arange(n, dtype=jnp.int32)
    bucket = jnp.clip(jnp.searchsorted(s.directory, p, side="right") - 1, 0, b - 1).astype(jnp.uint32)
    span = s.span.astype(jnp.uint32)
    hi = _shr(*_add(span[1], span[2], bucket), jnp.uint32(32) - span[0])[1]  # (key >> shift) >> (32 - shift)
    keys = jnp.stack([hi, s.sorted_keys.astype(jnp.uint32)], -1).astype(jnp.int32)
    return jnp.where((p < s.size)[:, None], keys, FREE)


def widen(s: KeySet) -> KeySet:
    """A compact set as a wide one (the same keys, slots and last-use steps)."""
    wide = s._replace(sorted_keys=full_keys(s), span=jnp.zeros((2,), jnp.float32))
    return with_directory(wide)


def compacted(s: KeySet) -> KeySet:
    """A wide set as a compact one: the keys' low words, and the exact directory (see the module docstring).
    Its keys must span less than `2**32` buckets' worth (`compact_bits`)."""
    n, b = s.order.shape[0], s.directory.shape[0] - 1
    keys = s.sorted_keys
    hi, lo = _words(keys)
    first, last = (jnp.clip(i, 0, n - 1) for i in (0, s.size - 1))
    shifts = jnp.arange(33, dtype=jnp.uint32)
    lh, ll = _shr(hi[last], lo[last], shifts)
    fh, fl = _shr(hi[first], lo[first], shifts)
    dh, dl = _sub(lh, ll, fh, fl)
    fits = (dh == 0) & (dl < b)  # some shift <= 32 fits when the keys are below 2**compact_bits(n)
    shift = jnp.where(s.size > 0, jnp.where(fits.any(), jnp.argmax(fits), 32), 0).astype(jnp.uint32)
    bh, bl = _shr(hi[first], lo[first], shift)
    bh, bl = jnp.where(s.size > 0, bh, 0), jnp.where(s.size > 0, bl, 0)
    span = jnp.stack([shift, bh, bl]).astype(jnp.int32)
    xh, xl = _shr(hi, lo, shift)
    live = jnp.arange(n) < s.size
    bucket = jnp.where(live, jnp.minimum(_sub(xh, xl, bh, bl)[1], b - 1).astype(jnp.int32), b)
    counts = jnp.zeros((b + 1,), jnp.int32).at[bucket].add(1)
    directory = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts[:b])]).astype(jnp.int32)
    return s._replace(sorted_keys=jnp.where(live, keys[:, 1], 0), directory=directory, span=span)


def _value(keys: jax.Array) -> jax.Array:
    """The keys as float32 numbers: nondecreasing in the key (each step rounds monotonically)."""
    u = keys.astype(jnp.uint32)
    return u[..., 0].astype(jnp.float32) * 4294967296.0 + u[..., 1].astype(jnp.float32)


def _bucket(s: KeySet, q: jax.Array) -> jax.Array:
    """The directory bucket of each key of `q [Q, 2]`: nondecreasing in the key, clipped to the buckets."""
    b = s.directory.shape[0] - 1
    x = jnp.floor((_value(q) - s.span[0]) * s.span[1])
    return jnp.clip(jnp.nan_to_num(x), 0, b - 1).astype(jnp.int32)


def with_directory(s: KeySet) -> KeySet:
    """`s` with its directory rebuilt from `sorted_keys` and `size` (linear)."""
    n, b = s.order.shape[0], s.directory.shape[0] - 1
    live = jnp.arange(n) < s.size
    first, last = (_value(s.sorted_keys[jnp.clip(i, 0, n - 1)]) for i in (0, s.size - 1))
    scale = jnp.where(last > first, b / jnp.maximum(last - first, 1e-30), 0.0)
    s = s._replace(span=jnp.stack([first, scale]).astype(jnp.float32))
    bucket = jnp.where(live, _bucket(s, s.sorted_keys), b)
    counts = jnp.zeros((b + 1,), jnp.int32).at[bucket].add(1)
    return s._replace(directory=jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts[:b])]).astype(jnp.int32))


def _less(a: jax.Array, b: jax.Array) -> jax.Array:
    """a < b for keys `[..., 2]` as unsigned 64-bit numbers (free slots, hi = -1, compare last)."""
    a, b = a.astype(jnp.uint32), b.astype(jnp.uint32)
    return (a[..., 0] < b[..., 0]) | ((a[..., 0] == b[..., 0]) & (a[..., 1] < b[..., 1]))


def same(a: jax.Array, b: jax.Array) -> jax.Array:
    return (a[..., 0] == b[..., 0]) & (a[..., 1] == b[..., 1])


def _bucket_bounds(s: KeySet, q: jax.Array):
    """The positions `[lo, hi)` of each query's bucket, and whether a position there holding its key (compact:
    its low word) is a match (a compact set's query outside its buckets' range: an empty range at the end
    of the keys below it)."""
    if not is_compact(s):
        b = _bucket(s, q)
        return s.directory[b], s.directory[b + 1], jnp.ones(q.shape[:1], bool)
    b, below, above = _compact_bucket(s, q)
    lo = jnp.where(below, 0, jnp.where(above, s.directory[-1], s.directory[b]))
    hi = jnp.where(below | above, lo, s.directory[b + 1])
    return lo, hi, ~(below | above)


def _key_less(s: KeySet, p: jax.Array, q: jax.Array) -> jax.Array:
    """The key at positions `p` < the query `q` (compact: the low words, within one bucket)."""
    if is_compact(s):
        return s.sorted_keys[p].astype(jnp.uint32) < q[..., 1].astype(jnp.uint32)
    return _less(s.sorted_keys[p], q)


def lower_bound(s: KeySet, q: jax.Array) -> jax.Array:
    """`[Q]`: for each key of `q [Q, 2]`, the first position p < size whose key is >= it (or size)."""
    n = s.order.shape[0]
    # The answer lies in the key's bucket (buckets are nondecreasing in the key): search only there.
    lo, hi, _ = _bucket_bounds(s, q)

    def halve(bounds):
        lo, hi = bounds
        mid = (lo + hi) // 2
        right = (lo < hi) & _key_less(s, jnp.minimum(mid, n - 1), q)
        return jnp.where(right, mid + 1, lo), jnp.where((lo < hi) & ~right, mid, hi)

    lo, _ = jax.lax.while_loop(lambda bounds: (bounds[0] < bounds[1]).any(), halve, (lo, hi))
    return lo


def find(s: KeySet, q: jax.Array) -> jax.Array:
    """`[Q]` slot of each key of `q [Q, 2]`, -1 if absent (or if the query is a free marker)."""
    p = jnp.minimum(lower_bound(s, q), s.order.shape[0] - 1)
    if is_compact(s):  # the low word, in the query's bucket (whose keys share the query's high word)
        _, end, inside = _bucket_bounds(s, q)
        hit = inside & (p < end) & (s.sorted_keys[p] == q[:, 1])
    else:
        hit = same(s.sorted_keys[p], q)
    hit = hit & (p < s.size) & (q[:, 0] != FREE)
    return jnp.where(hit, s.order[p], -1)


def touch(s: KeySet, q: jax.Array, step: jax.Array,
          stale_before: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`find`, and the last-use steps with every key found set to `step`: `(slots [Q], last [N], missing [])`.

    Keys last used before `stale_before` (expired) keep their step. The
    queries are distinct keys, so no slot is set twice. `missing`: the
    queries not found, free markers aside (int32; 0 = nothing to admit).
    """
    slot = find(s, q)
    fresh = (slot >= 0) & (s.last[jnp.maximum(slot, 0)] >= stale_before)
    missing = ((slot < 0) & (q[:, 0] != FREE)).sum().astype(jnp.int32)
    return slot, s.last.at[jnp.where(fresh, slot, s.last.shape[0])].set(step, mode="drop"), missing


def take(values: jax.Array, index: jax.Array, fill) -> jax.Array:
    """`values [Q]` at `index [E]` (the map's rows per entry); `fill` where an index is outside `[0, Q)` or the
    value is negative (no row)."""
    got = values.at[index].get(mode="fill", fill_value=fill, wrap_negative_indices=False)
    return jnp.where(got < 0, jnp.asarray(fill, got.dtype), got)


def entry_rows(rows: jax.Array, slot_of: jax.Array, values: jax.Array, fill: int) -> tuple[jax.Array, jax.Array]:
    """What a shard hands the entries of its one source: each entry's row `take(rows, slot_of, fill)` `[E]`, and its
    value `values [E]`, 0 where it got no row (`fill`)."""
    got = take(rows, slot_of, fill)
    return got, jnp.where(got < fill, values, jnp.zeros((), values.dtype))


def drop_missing(index: jax.Array, n: int) -> jax.Array:
    """Scatter indices with -1 (none) moved out of range, so that `mode="drop"` drops them."""
    return jnp.where(index >= 0, index, n)


def compact(values: jax.Array, keep: jax.Array, n: int, fill) -> tuple[jax.Array, jax.Array]:
    """The kept values in order, in `[n]` (then `fill`), and how many were kept."""
    pos = jnp.where(keep, jnp.cumsum(keep) - 1, n)
    return jnp.full((n,) + values.shape[1:], fill, values.dtype).at[pos].set(values, mode="drop"), keep.sum()


def _least_recent(s: KeySet, candidate: jax.Array, need: jax.Array, q: int) -> jax.Array:
    """`[q]` slots of the `need` candidates (mask by slot) used longest ago, ties by key; -1 after them.

    Linear, not a sort: a binary search for the last-use step below which
    enough candidates lie (32 counting passes), then the ties in key order.
    """
    n, big = s.order.shape[0], jnp.iinfo(jnp.int32).max
    last = jnp.where(candidate[s.order] & (jnp.arange(n) < s.size), s.last[s.order], big)  # by key position

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        enough = (last <= mid).sum() >= need
        return jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)

    t, _ = jax.lax.fori_loop(0, 32, halve, (last.min(), jnp.where(last < big, last, last.min()).max()))
    below, tied = last < t, (last == t) & (t < big)
    chosen = below | (tied & (jnp.cumsum(tied) <= need - below.sum()))
    by_slot = jnp.zeros((n,), bool).at[s.order].set(chosen)
    return compact(jnp.arange(n, dtype=jnp.int32), by_slot, q, -1)[0]


class Inserted(NamedTuple):
    set: KeySet
    slots: jax.Array  # [Q] slot given to each key, -1 (not wanted, or no room)
    evicted: jax.Array  # [] live keys evicted to make room


class _Placed(NamedTuple):
    """What an insert decides (its large outputs are the new sorted keys, order and directory)."""

    sorted_keys: jax.Array
    order: jax.Array
    size: jax.Array
    directory: jax.Array
    span: jax.Array
    slots: jax.Array  # [Q] in the caller's key order
    freed: jax.Array  # [2Q] slots emptied (removed or evicted), -1 padded
    evicted: jax.Array


def insert(s: KeySet, capacity: jax.Array, keys: jax.Array, want: jax.Array, removed: jax.Array | None,
           step: jax.Array) -> Inserted:
    """Removes the `removed` slots (mask `[N]`, or None) and inserts the wanted keys, evicting if full.

    `keys [Q, 2]` are distinct (the wanted ones absent from the set), in any
    order. They take, in key order: free slots (the first `capacity` slots
    only), the removed slots, then the slots of the least recently used
    keys whose `last < step` (ties by key). Keys left without a slot get -1.
    New keys get `last = step`. Last-use steps change by scatters of at
    most Q slots outside the branch that merges (XLA copies a branch's
    outputs).
    """
    k, n, q = want.sum(), s.order.shape[0], keys.shape[0]

    def sorted_insert():
        hi, lo, at = jax.lax.sort((keys[:, 0].astype(jnp.uint32), keys[:, 1].astype(jnp.uint32),
                                   jnp.arange(q, dtype=jnp.int32)), num_keys=2)
        gone = jnp.zeros((n,), bool) if removed is None else removed
        p = _insert(widen(s) if is_compact(s) else s, capacity, jnp.stack([hi, lo], -1).astype(jnp.int32),
                    want[at], gone, step, k)
        if is_compact(s):
            c = compacted(KeySet(p.sorted_keys, s.last, p.order, p.size, p.directory, p.span))
            p = p._replace(sorted_keys=c.sorted_keys, directory=c.directory, span=c.span)
        return p._replace(slots=jnp.zeros_like(p.slots).at[at].set(p.slots))

    def unchanged():
        none = jnp.full_like(want, -1, dtype=jnp.int32)
        return _Placed(s.sorted_keys, s.order, s.size, s.directory, s.span, none, jnp.concatenate([none, none]),
                       jnp.zeros_like(s.size))

    changes = k > 0 if removed is None else (k > 0) | removed.any()
    p = jax.lax.cond(changes, sorted_insert, unchanged)
    put = lambda a: a.at[drop_missing(p.freed, n)].set(FREE, mode="drop").at[drop_missing(p.slots, n)].set(
        step, mode="drop")
    last = jax.lax.cond(changes, put, lambda a: a, s.last)  # its own branch: XLA then updates it in place
    return Inserted(KeySet(p.sorted_keys, last, p.order, p.size, p.directory, p.span), p.slots, p.evicted)


def _insert(s: KeySet, capacity, keys, want, removed, step, k) -> _Placed:
    n, q = s.order.shape[0], keys.shape[0]
    free = jnp.maximum(capacity - s.size, 0)
    pos = s.size + jnp.arange(q)
    free_slots = jnp.where(pos < s.size + free, s.order[jnp.minimum(pos, n - 1)], -1)
    removed_slots, n_removed = compact(jnp.arange(n, dtype=jnp.int32), removed, q, -1)
    need = jnp.maximum(k - free - n_removed, 0)
    live = jnp.zeros((n,), bool).at[s.order].set(jnp.arange(n) < s.size)  # by slot
    candidate = live & ~removed & (s.last < step)
    lru = jax.lax.cond(need > 0, lambda: _least_recent(s, candidate, need, q), lambda: jnp.full_like(keys[:, 0], -1))
    avail = jnp.concatenate([free_slots, removed_slots, lru])
    avail, n_avail = compact(avail, avail >= 0, q, -1)
    rank = jnp.cumsum(want) - 1
    slots = jnp.where(want & (rank < n_avail), avail[jnp.clip(rank, 0, q - 1)], -1)
    evicted_mask = jnp.zeros((n,), bool).at[drop_missing(lru, n)].set(True, mode="drop")
    ks = with_directory(_merge(s, live & ~(removed | evicted_mask), keys, slots))
    return _Placed(ks.sorted_keys, ks.order, ks.size, ks.directory, ks.span, slots,
                   jnp.concatenate([removed_slots, lru]), evicted_mask.sum())


def _merge(s: KeySet, held: jax.Array, keys: jax.Array, slots: jax.Array) -> KeySet:
    """`s` with new `sorted_keys`, `order` and `size`: the keys of the `held` slots (a mask by slot, of live
    ones) and the inserted ones (`keys` given `slots`, -1: not inserted) merged by key in one linear pass."""
    n = s.order.shape[0]
    p = jnp.arange(n)
    survive = (p < s.size) & held[s.order]
    before = jnp.cumsum(survive)  # survivors at positions <= p
    ins = slots >= 0
    ins_keys, k = compact(keys, ins, keys.shape[0], FREE)
    ins_slots, _ = compact(slots, ins, keys.shape[0], -1)
    i = jnp.arange(ins_keys.shape[0])
    valid = i < k
    r = lower_bound(s, ins_keys)  # old positions with a smaller key
    at_new = i + jnp.where(r > 0, before[jnp.maximum(r - 1, 0)], 0)
    passed = jnp.cumsum(jnp.zeros((n + 1,), jnp.int32).at[jnp.where(valid, r, n)].add(1))[:n]
    at_old = before - 1 + passed
    size = before[-1] + k if n else k
    free = ~held.at[jnp.where(valid, ins_slots, n)].set(True, mode="drop")  # by slot
    at_free = size + jnp.cumsum(free) - 1
    old_at, new_at = jnp.where(survive, at_old, n), jnp.where(valid, at_new, n)
    order = jnp.zeros((n,), jnp.int32).at[old_at].set(s.order, mode="drop").at[new_at].set(ins_slots, mode="drop")
    order = order.at[jnp.where(free, at_free, n)].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    sorted_keys = jnp.full((n, 2), FREE, jnp.int32).at[old_at].set(s.sorted_keys, mode="drop").at[new_at].set(
        ins_keys, mode="drop")
    return s._replace(sorted_keys=sorted_keys, order=order, size=size.astype(jnp.int32))


def unique(q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Distinct keys of `q [Q, 2]` sorted (free markers last, as free), and each query's index into them."""
    n = q.shape[0]
    hi, lo = q[:, 0].astype(jnp.uint32), q[:, 1].astype(jnp.uint32)
    hi, lo, idx = jax.lax.sort((hi, lo, jnp.arange(n, dtype=jnp.int32)), num_keys=2)
    srt = jnp.stack([hi, lo], -1).astype(jnp.int32)
    first = jnp.concatenate([jnp.ones((1,), bool), ~same(srt[1:], srt[:-1])]) & (srt[:, 0] != FREE)
    uid = jnp.cumsum(first) - 1
    keys, _ = compact(srt, first, n, FREE)
    inverse = jnp.zeros((n,), jnp.int32).at[idx].set(jnp.where(srt[:, 0] != FREE, uid, n).astype(jnp.int32))
    return keys, inverse
