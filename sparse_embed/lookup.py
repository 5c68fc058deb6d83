"""The sharded lookup: a `jax.custom_vjp` whose backward applies the optimizer.

Forward (under `jax.shard_map`, per stack): each device sends every
destination shard its segment of the COO batch (`all_to_all`); each shard
gathers the rows, scales them by the gains (and `max_norm`), pools them into
per-source-device partial activations and sends them back (`all_to_all`);
each device sums the partials of its rows.

Backward: the activation gradients are gathered onto every shard
(`all_gather`) and turned into per-entry row gradients, CHUNK entries at a
time. SGD-like updates are scatter-added per occurrence; other optimizers
first sum the gradients of duplicate ids (at a representative entry found
without a sort, see `_representatives`), then update exactly the touched
rows and their slots, once each. No work is proportional to the vocabulary. The
cotangent returned for `tables` is the *updated* state, so
`jax.grad(loss)(tables)` returns the new tables. Under the plan's default
`nonfinite_gradients="skip"`, a row whose gradient is NaN/inf keeps its
values and slots; `nonfinite_rows` counts such rows.
"""

from __future__ import annotations

import functools
import math
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sparse_embed.planning import EmbeddingPlan, StackPlan
from sparse_embed.preprocess import ShardedCooMatrix
from sparse_embed.tables import EmbeddingVariables, check_state


CHUNK = 16384  # entries gathered/scattered at a time: temporaries of CHUNK x dim floats
EXACT_F32_INDEX = 2**24  # entry indices below this are exact in float32 (see _representatives)


class _Received(NamedTuple):
    """The COO entries a shard received, `[D, C]` each (from every source device)."""

    col_ids: jax.Array
    row_ids: jax.Array
    values: jax.Array
    first: jax.Array | None = None  # element 0 of each entry's row, read by the forward


def _exchange(stack: StackPlan, axis: str, coo: ShardedCooMatrix) -> _Received:
    """Sends segment s of this device's batch to shard s (inside shard_map)."""
    S = stack.num_shards

    def send(x):
        return jax.lax.all_to_all(x.reshape(S, -1), axis, 0, 0, tiled=True)

    return _Received(send(coo.col_ids), send(coo.row_ids), send(coo.values))


def _clip_scale(rows: jax.Array, max_norm: float) -> tuple[jax.Array, jax.Array]:
    """Scale that brings each row's L2 norm to at most max_norm, and the norm. `[..., 1]` each."""
    norm = jnp.sqrt(jnp.sum(rows * rows, axis=-1, keepdims=True))
    return jnp.where(norm > max_norm, max_norm / jnp.where(norm > 0, norm, 1.0), 1.0), norm


def _chunks(n: int) -> tuple[int, int]:
    """(number, size) of the chunks `_scan_chunks` cuts n entries into: number * size >= n."""
    k = max(1, -(-n // CHUNK))
    return k, -(-n // k)


def _scan_chunks(body, carry, *entries: jax.Array, fills: tuple):
    """Folds `body(carry, *chunk) -> (carry, y)` over `[N, ...]` entries in chunks of at most CHUNK along axis 0.

    Returns the final carry and the ys (None, or `[N, ...]` per-entry outputs).

    Gathering and scattering a chunk at a time keeps temporaries at
    `CHUNK x dim` instead of `N x dim` (no large buffer to page in, and the
    gathered rows stay in cache until they are scattered). Entries are padded
    with `fills` to a whole number of chunks.
    """
    n = entries[0].shape[0]
    k, size = _chunks(n)
    padded = [jnp.pad(x, [(0, k * size - n)] + [(0, 0)] * (x.ndim - 1), constant_values=f)
              .reshape(k, size, *x.shape[1:]) for x, f in zip(entries, fills)]
    carry, ys = jax.lax.scan(lambda c, xs: body(c, *xs), carry, padded)
    return carry, jax.tree.map(lambda y: y.reshape(k * size, *y.shape[2:])[:n], ys)


def _forward_stack(stack: StackPlan, axis: str, coo: ShardedCooMatrix, table: jax.Array, keep_first: bool):
    """Per device: `[rows_per_device, dim]` activations, the received entries (with `first` where the
    backward needs it) and the table for the backward (`_after` the forward's reads)."""
    rec = _exchange(stack, axis, coo)
    D, rpd, dim = stack.num_shards, stack.rows_per_device, stack.embedding_dim
    # Output row of each entry in the [D, rpd + 1] partials; row rpd of each source is the padding trash row.
    out = (jnp.arange(D, dtype=jnp.int32)[:, None] * (rpd + 1) + rec.row_ids).reshape(-1)

    def pool(acc, cols, out, values):
        rows = table.at[cols].get(mode="fill", fill_value=0).astype(jnp.float32)
        # Element 0 of each row, which the backward's representatives overwrite (see _representatives).
        # A gather of its own: slicing `rows` would materialise them, which XLA:CPU does slowly.
        first = table.at[cols, 0].get(mode="fill", fill_value=0) if keep_first else None
        if stack.max_norm is not None:
            rows = rows * _clip_scale(rows, stack.max_norm)[0]
        return acc.at[out].add(rows * values[:, None], mode="drop"), first

    zeros = jax.lax.pcast(jnp.zeros((D * (rpd + 1), dim), jnp.float32), (axis,), to="varying")
    partial, first = _scan_chunks(pool, zeros, rec.col_ids.reshape(-1), out, rec.values.reshape(-1),
                                  fills=(stack.rows_per_shard, D * (rpd + 1), 0.0))
    partial = partial.reshape(D, rpd + 1, dim)[:, :rpd]
    pooled = jax.lax.all_to_all(partial, axis, 0, 0, tiled=True)  # [S, rpd, dim]
    if keep_first:
        rec = rec._replace(first=first.reshape(rec.values.shape))
    return pooled.sum(axis=0), rec, _after(table, partial)


def _after(x: jax.Array, dep: jax.Array) -> jax.Array:
    """`x`, unchanged but data-dependent on `dep` (a value computed from x's reads).

    Rewrites row 0 with itself at an index XLA cannot fold (min(bits, 0),
    clamped to 0). The backward updates the table in place; without this
    edge, a cotangent that does not depend on the activations leaves the
    forward's reads and the backward's writes unordered, and XLA copies the
    whole table to keep them apart.
    """
    i = jnp.minimum(jax.lax.bitcast_convert_type(dep.reshape(-1)[0], jnp.int32), 0)
    return jax.lax.dynamic_update_slice_in_dim(x, jax.lax.dynamic_slice_in_dim(x, i, 1), i, axis=0)


def _segments(cols: jax.Array):
    """Groups equal cols: the sorting order, the sorted cols and each sorted entry's group index."""
    order = jnp.argsort(cols)
    sorted_cols = cols[order]
    is_new = jnp.concatenate([jnp.ones((1,), bool), sorted_cols[1:] != sorted_cols[:-1]])
    return order, sorted_cols, jnp.cumsum(is_new) - 1


def _dedup(cols: jax.Array, grads: jax.Array, rows_per_shard: int):
    """Sums the gradients of duplicate row ids.

    cols `[N]` (padding = rows_per_shard), grads `[N, dim]` ->
    unique cols `[N]` (unused slots get distinct out-of-range ids) and their
    summed grads `[N, dim]`.
    """
    n = cols.shape[0]
    order, sorted_cols, segment = _segments(cols)
    summed = jax.ops.segment_sum(grads[order], segment, num_segments=n, indices_are_sorted=True)
    unused = rows_per_shard + 1 + jnp.arange(n, dtype=cols.dtype)
    unique_cols = unused.at[segment].set(sorted_cols, indices_are_sorted=True)
    # The padding entries form one segment at col rows_per_shard: out of range too.
    return unique_cols, summed


def _nonfinite(grads: jax.Array) -> jax.Array:
    """Per gradient row `[N, dim]`: does it hold a NaN or inf? `[N]` bool."""
    return ~jnp.isfinite(grads).all(axis=-1)


def _bad_groups(cols: jax.Array, bad: jax.Array):
    """Per group of equal cols: does any of its entries have `bad` set? And each sorted entry's group."""
    order, _, segment = _segments(cols)
    hits = jax.ops.segment_sum(bad[order].astype(jnp.int32), segment, num_segments=cols.shape[0],
                               indices_are_sorted=True)
    return hits > 0, order, segment


def _poisoned(cols: jax.Array, bad: jax.Array) -> jax.Array:
    """Per entry: does any entry with the same col have `bad` set? Sorts only when some entry is bad."""

    def spread(_):
        group_bad, order, segment = _bad_groups(cols, bad)
        return jnp.zeros_like(bad).at[order].set(group_bad[segment], unique_indices=True)

    return jax.lax.cond(bad.any(), spread, lambda _: bad, None)


def _check_trainable(stack: StackPlan, variables: EmbeddingVariables) -> None:
    want = sorted(stack.optimizer.slots(stack.embedding_dim))
    if sorted(variables.slots) != want:
        raise ValueError(
            f"Stack {stack.name!r} cannot be trained: its {type(stack.optimizer).__name__} optimizer needs "
            f"slots {want} but the tables have {sorted(variables.slots)} (created with with_slots=False for "
            "inference?). Create them with slots, e.g. init_tables(plan, rng) or stack_tables(plan, arrays)."
        )


class _Entries(NamedTuple):
    """The received entries of one shard, flat `[N]`, with the activation gradients they read.

    An entry's gradient is `grads_all[src] * value`; it is computed chunk by
    chunk where it is used, never as an `[N, dim]` array.
    """

    cols: jax.Array  # row on this shard; padding = rows_per_shard (out of range)
    src: jax.Array  # row of grads_all; padding entries read a zero row
    values: jax.Array
    grads_all: jax.Array  # [D * (rows_per_device + 1), dim] activation gradients of every source
    bad: jax.Array  # [N] bool: the entry's activation gradient holds a NaN/inf
    first: jax.Array | None  # [N] element 0 of the entry's row before the update (from the forward)

    def grads(self, src: jax.Array, values: jax.Array) -> jax.Array:
        return self.grads_all[src] * values[:, None]


def _entries(stack: StackPlan, axis: str, rec: _Received, g: jax.Array) -> _Entries:
    D, rpd, dim = stack.num_shards, stack.rows_per_device, stack.embedding_dim
    # Activation gradients of every source device, with a zero row rpd per source for padding entries.
    grads_all = jnp.pad(jax.lax.all_gather(g, axis, tiled=False), ((0, 0), (0, 1), (0, 0)))
    grads_all = grads_all.reshape(D * (rpd + 1), dim)
    src = (jnp.arange(D, dtype=jnp.int32)[:, None] * (rpd + 1) + rec.row_ids).reshape(-1)
    # NaN/inf checked per activation row (cheaper than per entry).
    return _Entries(rec.col_ids.reshape(-1), src, rec.values.reshape(-1), grads_all, _nonfinite(grads_all)[src],
                    None if rec.first is None else rec.first.reshape(-1))


def _apply_linear(stack: StackPlan, e: _Entries, table: jax.Array, step, skip_nonfinite: bool) -> jax.Array:
    """e.g. plain SGD: no need to combine duplicates; scatter-adds each occurrence's delta, chunk by chunk."""
    opt, pad = stack.optimizer, stack.rows_per_shard
    # Under skip_nonfinite, every occurrence of a row with a non-finite gradient is dropped (sent out of range).
    cols = jnp.where(_poisoned(e.cols, e.bad), pad, e.cols) if skip_nonfinite else e.cols

    def add(tbl, cols, src, values):
        return tbl.at[cols].add(opt.linear_delta(e.grads(src, values), step), mode="drop"), None

    return _scan_chunks(add, table, cols, e.src, e.values, fills=(pad, stack.rows_per_device, 0.0))[0]


def _representatives(table: jax.Array, cols: jax.Array, none: int):
    """One representative entry per distinct col, without a sort (f32 tables, N < 2**24).

    Every entry writes its index (exact as a float) into element 0 of its
    row and reads it back; all entries of a row read the one write that
    landed. Returns the scribbled table and each entry's representative
    `[N]` (`none` for padding). The caller must rewrite every touched row
    (the representatives' rows), element 0 from the values the forward read
    (`_Entries.first`: reading them in the forward keeps that read ordered
    before these writes).
    """
    table = table.at[cols, 0].set(jnp.arange(cols.shape[0], dtype=table.dtype), mode="drop")
    return table, table.at[cols, 0].get(mode="fill", fill_value=none).astype(jnp.int32)


def _apply_deduped(stack: StackPlan, axis: str, e: _Entries, variables: EmbeddingVariables, step,
                   skip_nonfinite: bool) -> EmbeddingVariables:
    """Sums the gradients of each touched row, then applies the optimizer to it once, in chunks.

    The sums go to the representative entry's position in `acc [N', dim]`
    (N' = N rounded up to whole chunks, so the update loop reads it chunk by
    chunk without padding it).
    """
    opt, n, dim, pad = stack.optimizer, e.cols.shape[0], stack.embedding_dim, stack.rows_per_shard
    padded = math.prod(_chunks(n))
    table, rep = _representatives(variables.table, e.cols, none=padded)

    def read(tbl, cols, first):
        """Rows `[C, dim]` with element 0 restored. Out-of-range cols read some real row, clamped (no
        per-element bounds check); their entries write nothing. A select, not a slice update: XLA:CPU
        keeps the gather fused into its consumers."""
        rows = tbl.at[jnp.minimum(cols, pad - 1)].get(mode="promise_in_bounds").astype(jnp.float32)
        return jnp.where(jnp.arange(dim) == 0, first[:, None], rows)

    def accumulate(acc, cols, src, values, rep, first):
        grads = e.grads(src, values)
        if stack.max_norm is not None:
            grads = _clipped_grads(read(table, cols, first), grads, stack.max_norm)
        return acc.at[rep].add(grads, mode="drop"), None

    zeros = jax.lax.pcast(jnp.zeros((padded, dim), jnp.float32), (axis,), to="varying")
    acc, _ = _scan_chunks(accumulate, zeros, e.cols, e.src, e.values, rep, e.first,
                          fills=(pad, stack.rows_per_device, 0.0, padded, 0.0))
    # Only the representatives write their (whole) rows back; the others are dropped.
    own = jnp.where(rep == jnp.arange(n, dtype=jnp.int32), e.cols, pad)

    def update(state, cols, first, grads):
        at = jnp.minimum(cols, pad - 1)
        old = {k: v.at[at].get(mode="promise_in_bounds") for k, v in state.slots.items()}
        return _update_rows(opt, state, cols, read(state.table, cols, first), old, grads, step, skip_nonfinite), None

    return _scan_chunks(update, EmbeddingVariables(table, dict(variables.slots)), own, e.first, acc[:n],
                        fills=(pad, 0.0, 0.0))[0]


def _update_rows(opt, state: EmbeddingVariables, cols, rows, slots, grads, step,
                 skip_nonfinite: bool) -> EmbeddingVariables:
    """Applies the optimizer to `rows [C, dim]` and their `slots` at distinct `cols` and writes them
    back (out-of-range cols write nothing). With `skip_nonfinite`, a row whose summed gradient is
    non-finite (if any of its terms is, or if it overflows) keeps its values and slots."""
    new_rows, new_slots = opt.update(rows, slots, grads, step)
    if skip_nonfinite:
        skipped = _nonfinite(grads)[:, None]
        new_rows = jnp.where(skipped, rows, new_rows)
        new_slots = {k: jnp.where(skipped, slots[k], v) for k, v in new_slots.items()}
    put = lambda dst, vals: dst.at[cols].set(vals.astype(dst.dtype), mode="drop", unique_indices=True)
    return EmbeddingVariables(put(state.table, new_rows), {k: put(state.slots[k], new_slots[k]) for k in slots})


def _clipped_grads(x: jax.Array, grads: jax.Array, max_norm: float) -> jax.Array:
    """Gradients through the forward's `max_norm` clipping of rows x `[N, dim]`."""
    scale, norm = _clip_scale(x, max_norm)
    clipped = norm > max_norm
    radial = jnp.sum(x * grads, axis=-1, keepdims=True) / jnp.where(clipped, norm * norm, 1.0)
    return scale * (grads - jnp.where(clipped, radial * x, 0.0))


def _apply_sorted(stack: StackPlan, e: _Entries, variables: EmbeddingVariables, step,
                  skip_nonfinite: bool) -> EmbeddingVariables:
    """The general path (tables that are not f32, or 2**24+ entries): sort-based dedup, unchunked."""
    table, opt = variables.table, stack.optimizer
    grads = e.grads(e.src, e.values)
    if stack.max_norm is not None:
        grads = _clipped_grads(table.at[e.cols].get(mode="fill", fill_value=0).astype(jnp.float32), grads,
                               stack.max_norm)
    cols, grads = _dedup(e.cols, grads, stack.rows_per_shard)
    rows = table.at[cols].get(mode="fill", fill_value=0).astype(jnp.float32)
    slots = {k: v.at[cols].get(mode="fill", fill_value=0) for k, v in variables.slots.items()}
    return _update_rows(opt, variables, cols, rows, slots, grads, step, skip_nonfinite)


def _backward_stack(
    stack: StackPlan, axis: str, rec: _Received, variables: EmbeddingVariables, g: jax.Array, step,
    skip_nonfinite: bool,
) -> EmbeddingVariables:
    """Per shard: applies the optimizer to the rows the received entries touched.

    With `skip_nonfinite`, a row whose gradient is NaN/inf keeps its values and slots.
    """
    _check_trainable(stack, variables)
    e = _entries(stack, axis, rec, g)
    path = _backward_path(stack, variables.table.dtype, e.cols.size)
    if path == "linear":
        return EmbeddingVariables(_apply_linear(stack, e, variables.table, step, skip_nonfinite), variables.slots)
    if path == "deduped":
        return _apply_deduped(stack, axis, e, variables, step, skip_nonfinite)
    return _apply_sorted(stack, e, variables, step, skip_nonfinite)


def _backward_path(stack: StackPlan, dtype, num_entries: int) -> str:
    """How the backward combines duplicate ids: not at all ("linear": SGD-like updates add per
    occurrence), by representatives ("deduped": f32 tables, indices exact as floats) or by a sort."""
    f32 = dtype == jnp.float32
    if stack.optimizer.is_linear and stack.max_norm is None and f32:
        return "linear"
    return "deduped" if f32 and num_entries <= EXACT_F32_INDEX else "sorted"


def _specs(plan: EmbeddingPlan, tables):
    row = P(plan.axis_name, None)
    return {
        s.name: EmbeddingVariables(row, {k: row for k in tables[s.name].slots}) for s in plan.stacks
    }


def _forward(plan: EmbeddingPlan, batch, tables):
    """Global activations per stack `[D * rows_per_device, dim]` and the received entries."""
    axis = plan.axis_name
    batch_spec = {s.name: ShardedCooMatrix(*([P(axis)] * 5)) for s in plan.stacks}
    table_spec = {s.name: P(axis, None) for s in plan.stacks}
    # `first` only where the backward uses it (entries per shard = the batch's S * capacity)
    keep = {s.name: _backward_path(s, tables[s.name].table.dtype, batch[s.name].col_ids.shape[1]) == "deduped"
            for s in plan.stacks}
    rec_spec = {k: _Received(P(axis), P(axis), P(axis), P(axis) if v else None) for k, v in keep.items()}

    def body(batch, tables):
        acts, recs, after = {}, {}, {}
        for s in plan.stacks:
            coo = jax.tree.map(lambda x: x[0], batch[s.name])
            acts[s.name], rec, after[s.name] = _forward_stack(s, axis, coo, tables[s.name], keep[s.name])
            recs[s.name] = jax.tree.map(lambda x: x[None], rec)
        return acts, recs, after

    fn = jax.shard_map(
        body, mesh=plan.mesh, in_specs=(batch_spec, table_spec),
        out_specs=({s.name: P(axis) for s in plan.stacks}, rec_spec, table_spec),
    )
    return fn(batch, {k: v.table for k, v in tables.items()})


def _backward(plan: EmbeddingPlan, recs, tables, grads, step):
    axis = plan.axis_name
    rec_spec = jax.tree.map(lambda _: P(axis), recs)
    state_spec = _specs(plan, tables)
    skip = plan.nonfinite_gradients == "skip"

    def body(recs, tables, grads, step):
        out = {}
        for s in plan.stacks:
            rec = jax.tree.map(lambda x: x[0], recs[s.name])
            out[s.name] = _backward_stack(s, axis, rec, tables[s.name], grads[s.name], step, skip)
        return out

    fn = jax.shard_map(
        body, mesh=plan.mesh,
        in_specs=(rec_spec, state_spec, {s.name: P(axis) for s in plan.stacks}, P()),
        out_specs=state_spec,
    )
    return fn(recs, tables, grads, step)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup_stacks(plan, batch, tables, step):
    return _forward(plan, batch, tables)[0]


def _lookup_fwd(plan, batch, tables, step):
    acts, recs, after = _forward(plan, batch, tables)
    tables = {k: EmbeddingVariables(after[k], v.slots) for k, v in tables.items()}
    return acts, (recs, tables, step)


def _lookup_bwd(plan, residuals, grads):
    recs, tables, step = residuals
    grads = {k: g.astype(jnp.float32) for k, g in grads.items()}
    return None, _backward(plan, recs, tables, grads, step), None


_lookup_stacks.defvjp(_lookup_fwd, _lookup_bwd)


def _check_batch(plan: EmbeddingPlan, batch: Mapping[str, ShardedCooMatrix]) -> None:
    if set(batch) != set(plan.stack_names):
        raise ValueError(
            f"batch has stacks {sorted(batch)} but the plan has {sorted(plan.stack_names)}; "
            "build it with sparse_embed.preprocess(plan, ...)."
        )
    D = plan.num_shards
    for name, coo in batch.items():
        if not isinstance(coo, ShardedCooMatrix):
            raise TypeError(f"Stack {name!r}: batch entry must be a ShardedCooMatrix, got {type(coo).__name__}.")
        n = coo.col_ids.shape
        if coo.shard_starts.shape != (D, D) or len(n) != 2 or n[0] != D or n[1] % D:
            raise ValueError(f"Stack {name!r}: batch arrays have shapes {[x.shape for x in coo]}, "
                             f"which do not fit a mesh of {D} devices; was it built for another plan?")
        for x in (coo.row_ids, coo.values):
            if x.shape != n:
                raise ValueError(f"Stack {name!r}: col_ids, row_ids and values must have equal shapes.")


def lookup(
    plan: EmbeddingPlan,
    batch: Mapping[str, ShardedCooMatrix],
    tables: Mapping[str, EmbeddingVariables],
    step: jax.Array | int | None = None,
) -> dict[str, jax.Array]:
    """Looks up every feature of the plan. Differentiable w.r.t. `tables`.

    Args:
      plan: the `EmbeddingPlan` (static).
      batch: `{stack: ShardedCooMatrix}` from `preprocess`.
      tables: `{stack: EmbeddingVariables}` from `init_tables`/`stack_tables`.
      step: the global step (int scalar); needed by learning-rate schedules.

    Returns:
      `{feature: activations}`, `[batch_size, dim]` (pooled) or
      `[batch_size, max_sequence_length, dim]` (sequence), float32, sharded
      over the batch.

    The "gradient" of the loss w.r.t. `tables` is the updated state: the
    optimizer already applied to the touched rows. Use `tables` only through
    one `lookup` in a loss, and replace them with what `jax.grad` returns.
    Rows whose gradient is NaN/inf are left unchanged unless the plan says
    `nonfinite_gradients="apply"` (see `nonfinite_rows`).
    """
    _check_batch(plan, batch)
    check_state(plan, tables)
    if step is not None:
        step = jnp.asarray(step)
    return _lookup_jit(plan, dict(batch), dict(tables), step)


@functools.partial(jax.jit, static_argnums=0)
def _lookup_jit(plan: EmbeddingPlan, batch, tables, step) -> dict[str, jax.Array]:
    """One compiled program when called eagerly; inlined into the caller's jit otherwise."""
    acts = _lookup_stacks(plan, batch, tables, step)
    out = {}
    for s in plan.stacks:
        a = acts[s.name].reshape(plan.num_shards, s.rows_per_device, s.embedding_dim)
        for lay in s.features:
            f = lay.feature
            x = a[:, lay.row_offset : lay.row_offset + lay.rows_per_device]
            out[f.name] = x.reshape(f.output_shape)
    return out


def _stack_grads(plan: EmbeddingPlan, grads: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """`{feature: dL/dactivations}` -> `{stack: [D * rows_per_device, dim]}` (inverse of `_lookup_jit`'s split)."""
    missing = sorted(set(plan.features) - set(grads))
    if missing:
        raise ValueError(f"activation_grads is missing features {missing}; give one per feature of the plan.")
    out = {}
    for s in plan.stacks:
        parts = []
        for lay in s.features:
            g = jnp.asarray(grads[lay.feature.name], jnp.float32)
            if g.shape != lay.feature.output_shape:
                raise ValueError(f"Feature {lay.feature.name!r}: activation_grads has shape {g.shape}, "
                                 f"but its activations have shape {lay.feature.output_shape}.")
            parts.append(g.reshape(plan.num_shards, lay.rows_per_device, s.embedding_dim))
        out[s.name] = jnp.concatenate(parts, axis=1).reshape(-1, s.embedding_dim)
    return out


@functools.partial(jax.jit, static_argnums=0)
def _nonfinite_rows_jit(plan: EmbeddingPlan, batch, grads) -> dict[str, jax.Array]:
    axis = plan.axis_name

    def body(batch, grads):
        out = {}
        for s in plan.stacks:
            rec = _exchange(s, axis, jax.tree.map(lambda x: x[0], batch[s.name]))
            e = _entries(s, axis, rec, grads[s.name])
            out[s.name] = jax.lax.psum(jnp.sum(_bad_groups(e.cols, e.bad)[0], dtype=jnp.int32), axis)
        return out

    fn = jax.shard_map(
        body, mesh=plan.mesh,
        in_specs=({s.name: ShardedCooMatrix(*([P(axis)] * 5)) for s in plan.stacks}, {s.name: P(axis) for s in plan.stacks}),
        out_specs={s.name: P() for s in plan.stacks},
    )
    return fn(batch, _stack_grads(plan, grads))


def nonfinite_rows(
    plan: EmbeddingPlan, batch: Mapping[str, ShardedCooMatrix], activation_grads: Mapping[str, jax.Array]
) -> dict[str, jax.Array]:
    """How many table rows a NaN/inf activation gradient reaches: `{stack: int32 count}`.

    These are the rows that the backward of `lookup` leaves unchanged under
    `plan(..., nonfinite_gradients="skip")` (or poisons under "apply"): rows
    read by an output row whose gradient holds a NaN or inf. (Optimizers
    that combine duplicates also skip a row whose finite gradients overflow
    when summed; that rare row is not counted here.) The
    backward cannot return this count through `jax.grad`, so compute it from
    the gradient of the loss w.r.t. the activations, e.g.
    `jax.grad(head_loss)(acts)`, when the loss is not finite. Jit-able.
    """
    _check_batch(plan, batch)
    return _nonfinite_rows_jit(plan, dict(batch), dict(activation_grads))
