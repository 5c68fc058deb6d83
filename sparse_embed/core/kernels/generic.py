"""The generic kernel: the lookup's per-shard work in jnp/lax, on any platform; the reference.

Forward: gathers and pools the received entries a chunk at a time (`chunk`
entries), so no `[entries, dim]` temporary is built; XLA fuses each chunk's
gather, scale and scatter-add into one loop.

Backward, by optimizer:

- SGD-like updates (`Optimizer.is_linear`, no max_norm, f32 table): each
  occurrence's delta is scatter-added to its row; duplicates need no
  combining.
- Other optimizers on f32 tables with fewer than `exact_index_limit`
  entries per shard: duplicates are combined without a sort, at a
  representative entry per row (`_representatives`), then each touched row
  and its slots are updated once, in chunks.
- Everything else (bf16 tables, more entries): a sort and a segment sum.
  So do "column" stacks that need statistics of whole rows (max_norm, a
  row-wise optimizer): every device then holds each touched row at the same
  position, and a psum over the mesh axis (`KernelStack.row_sum`) adds its
  columns' partial sums; a `Custom` optimizer there gets the touched rows
  whole (an all_gather of their columns) and each device keeps its own.

Tricks this kernel owns: the forward saves element 0 of each row for the
representatives, and returns the table tied after its reads (`_after`) so
XLA never copies a donated table to keep the forward's reads before the
backward's in-place writes. On CPU, XLA still copies whole tables in a
train step unless its copy insertion uses region analysis: that is
`CPU_FLAGS`, which must be in `XLA_FLAGS` before JAX starts its backend
(`configure_xla_cpu()` puts it there); a train step traced without it warns.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from sparse_embed.core import pooling
from sparse_embed.core.kernels.base import KernelBase
from sparse_embed.core.kernels.entries import Entries, bad_groups, entries, nonfinite, output_rows, segments
from sparse_embed.core.kernels.interface import Forward, Received, join_blocks, split_blocks
from sparse_embed.core.planning import EmbeddingPlan, StackPlan
from sparse_embed.core.state import EmbeddingVariables


CPU_FLAGS = ("--xla_cpu_copy_insertion_use_region_analysis=true",)


def _missing_cpu_flags() -> list[str]:
    flags = os.environ.get("XLA_FLAGS", "")
    return [f for f in CPU_FLAGS if f.split("=")[0] not in flags]


def configure_xla_cpu() -> str:
    """Adds the XLA:CPU flags that keep the generic kernel's train step from copying whole tables.

    They go into the `XLA_FLAGS` environment variable, which XLA reads once,
    when JAX starts its backend: call this before the first JAX computation
    (or set `XLA_FLAGS=--xla_cpu_copy_insertion_use_region_analysis=true`
    yourself). Only the generic kernel on CPU needs them. Returns the new
    `XLA_FLAGS`.
    """
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_missing_cpu_flags()]).strip()
    return os.environ["XLA_FLAGS"]


def warn_if_slow_on_cpu(plan: EmbeddingPlan, stacks: list[str]) -> None:
    """Warns when a train step of the generic kernel is traced for CPU without `CPU_FLAGS`."""
    missing = _missing_cpu_flags()
    if stacks and missing and plan.mesh.devices.flat[0].platform == "cpu":
        warnings.warn(
            f"XLA_FLAGS lacks {' '.join(missing)}: on CPU this train step may copy the whole tables of stacks "
            f"{stacks} (the generic kernel) on every step. Call sparse_embed.tuning.configure_xla_cpu() before the "
            "first JAX computation, or put the flag in XLA_FLAGS before starting Python.", stacklevel=2)


def _poisoned(cols: jax.Array, bad: jax.Array) -> jax.Array:
    """Per entry: does any entry with the same col have `bad` set? Sorts only when some entry is bad."""

    def spread(_):
        group_bad, order, segment = bad_groups(cols, bad)
        return jnp.zeros_like(bad).at[order].set(group_bad[segment], unique_indices=True)

    return jax.lax.cond(bad.any(), spread, lambda _: bad, None)


def _dedup(cols: jax.Array, grads: jax.Array, rows_per_shard: int):
    """Sums the gradients of duplicate row ids, by a sort.

    cols `[N]` (padding = rows_per_shard), grads `[N, dim]` -> unique cols
    `[N]` (unused slots get distinct out-of-range ids) and their summed grads.
    """
    n = cols.shape[0]
    order, sorted_cols, segment = segments(cols)
    summed = jax.ops.segment_sum(grads[order], segment, num_segments=n, indices_are_sorted=True)
    unused = rows_per_shard + 1 + jnp.arange(n, dtype=cols.dtype)
    # The padding entries form one segment at col rows_per_shard: out of range too.
    return unused.at[segment].set(sorted_cols, indices_are_sorted=True), summed


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


def _representatives(table: jax.Array, cols: jax.Array, none: int):
    """One representative entry per distinct col, without a sort (f32 tables, N < 2**24).

    Every entry writes its index (exact as a float) into element 0 of its
    row and reads it back; all entries of a row read the one write that
    landed. Returns the scribbled table and each entry's representative
    `[N]` (`none` for padding). The caller must rewrite every touched row
    (the representatives' rows), element 0 from the values the forward read
    (its saved `first`: reading them in the forward keeps that read ordered
    before these writes).
    """
    table = table.at[cols, 0].set(jnp.arange(cols.shape[0], dtype=table.dtype), mode="drop")
    return table, table.at[cols, 0].get(mode="fill", fill_value=none).astype(jnp.int32)


def _update_rows(stack: StackPlan, state: EmbeddingVariables, cols, rows, slots, grads, step,
                 skip_nonfinite: bool) -> EmbeddingVariables:
    """Applies the optimizer to `rows [C, dim]` and their `slots` at distinct `cols` and writes them
    back (out-of-range cols write nothing). With `skip_nonfinite`, a row whose summed gradient is
    non-finite (if any of its terms is, or if it overflows), or whose update is (a finite gradient whose
    square overflows: inf in Adagrad's accumulator, NaN in FTRL's row), keeps its values and slots."""
    if stack.gathers_rows:  # an optimizer that sees whole rows, on rows split by columns
        new_rows, new_slots, skipped = _update_whole_rows(stack, rows, slots, grads, step)
    else:
        new_rows, new_slots = stack.optimizer.update(rows, slots, grads, step, stack.row_mean)
        new_rows = stack.real_columns(new_rows)  # a split row's padding columns stay zero
        skipped = _nonfinite_update(grads, new_rows, new_slots)
    if skip_nonfinite:
        if stack.needs_row_sums and not stack.gathers_rows:  # skipped on every device that holds its columns
            skipped = stack.row_sum(skipped.astype(jnp.float32)) > 0
        new_rows = jnp.where(skipped, rows, new_rows)
        new_slots = {k: jnp.where(skipped, slots[k], v) for k, v in new_slots.items()}
    put = lambda dst, vals: dst.at[cols].set(vals.astype(dst.dtype), mode="drop", unique_indices=True)
    return EmbeddingVariables(put(state.table, new_rows), {k: put(state.slots[k], new_slots[k]) for k in slots})


def _update_whole_rows(stack: StackPlan, rows, slots, grads, step):
    """The update of rows split by columns, applied to the whole rows (gathered from every device) on every
    device, which keeps its columns: `(rows', slots', non-finite flags [U, 1])`."""
    split = {k for k in slots if stack.splits_slot(k)}
    whole = lambda d: {k: stack.whole(v) if k in split else v for k, v in d.items()}  # noqa: E731
    grads = stack.whole(grads)
    new_rows, new_slots = stack.optimizer.update(stack.whole(rows), whole(slots), grads, step)
    own = {k: stack.own(v) if k in split else v for k, v in new_slots.items()}
    return stack.own(new_rows), own, _nonfinite_update(grads, new_rows, new_slots)


def _nonfinite_update(grads, new_rows, new_slots) -> jax.Array:
    """`[U, 1]`: does a row's gradient, its updated row or one of its updated slots hold a NaN or inf?"""
    bad = nonfinite(grads) | nonfinite(new_rows)
    for v in new_slots.values():
        bad = bad | nonfinite(v)
    return bad[:, None]


@dataclasses.dataclass(frozen=True)
class GenericKernel(KernelBase):
    """The jnp/lax implementation (see the module docstring).

    Attributes:
      chunk: entries gathered or scattered at a time (temporaries of
        `chunk x dim` floats).
      exact_index_limit: f32 tables whose shards receive fewer entries
        combine duplicates by representatives (entry indices must be exact
        as f32: below 2**24); others sort. 0 always sorts.
    """

    chunk: int = 16384
    exact_index_limit: int = 2**24
    name: ClassVar[str] = "generic"
    needs_xla_cpu_flags: ClassVar[bool] = True  # see `CPU_FLAGS`

    def unsupported(self, stack: StackPlan) -> str | None:
        return None

    # ------------------------------------------------------------ chunking
    def _chunks(self, n: int) -> tuple[int, int]:
        """(number, size) of the chunks n entries are cut into: number * size >= n."""
        k = max(1, -(-n // self.chunk))
        return k, -(-n // k)

    def _scan_chunks(self, body, carry, *entries: jax.Array, fills: tuple):
        """Folds `body(carry, *chunk) -> (carry, y)` over `[N, ...]` entries, `chunk` at a time along axis 0.

        Returns the final carry and the ys (None, or `[N, ...]` per-entry
        outputs). Keeps temporaries at `chunk x dim` instead of `N x dim`
        (nothing large to page in; gathered rows stay in cache until they
        are scattered). Entries are padded with `fills` to whole chunks.
        """
        n = entries[0].shape[0]
        k, size = self._chunks(n)
        padded = [jnp.pad(x, [(0, k * size - n)] + [(0, 0)] * (x.ndim - 1), constant_values=f)
                  .reshape(k, size, *x.shape[1:]) for x, f in zip(entries, fills)]
        carry, ys = jax.lax.scan(lambda c, xs: body(c, *xs), carry, padded)
        return carry, jax.tree.map(lambda y: y.reshape(k * size, *y.shape[2:])[:n], ys)

    def _path(self, stack: StackPlan, dtype, num_entries: int) -> str:
        """How the backward combines duplicates: not at all ("linear"), by representatives ("deduped") or a sort."""
        f32 = dtype == jnp.float32
        if stack.optimizer.is_linear and stack.max_norm is None and f32:
            return "linear"
        # Statistics of rows split over devices are summed in one order on every device: the sort's.
        deduped = f32 and num_entries <= self.exact_index_limit and not stack.needs_row_sums
        return "deduped" if deduped else "sorted"

    # ------------------------------------------------------------ forward
    def forward(self, stack: StackPlan, rec: Received, table: jax.Array) -> Forward:
        D, rpd, dim = stack.num_shards, stack.rows_per_device, stack.embedding_dim
        keep_first = self._path(stack, table.dtype, rec.col_ids.size) == "deduped"

        def pool(acc, cols, out, values):
            rows = table.at[cols].get(mode="fill", fill_value=0).astype(jnp.float32)
            # Element 0 of each row, which the backward's representatives overwrite (see _representatives).
            # A gather of its own: slicing `rows` would materialise them, which XLA:CPU does slowly.
            first = table.at[cols, 0].get(mode="fill", fill_value=0) if keep_first else None
            if stack.max_norm is not None:
                rows = rows * pooling.max_norm_scale(rows, stack.max_norm, jnp, stack.row_sum)[0]
            return acc.at[out].add(rows * values[:, None], mode="drop"), first

        zeros = jnp.zeros_like(rec.values, shape=(D * (rpd + 1), dim))  # varying over the mesh axis, like rec
        partial, first = self._scan_chunks(pool, zeros, rec.col_ids.reshape(-1), output_rows(stack, rec),
                                           rec.values.reshape(-1), fills=(stack.rows_per_shard, D * (rpd + 1), 0.0))
        partial = partial.reshape(D, rpd + 1, dim)[:, :rpd]
        saved = first.reshape(rec.values.shape) if keep_first else None
        return Forward(split_blocks(stack, partial), _after(table, partial), saved)

    # ------------------------------------------------------------ backward
    def backward(self, stack: StackPlan, rec: Received, saved, variables: EmbeddingVariables, grads: Any,
                 step, skip_nonfinite: bool) -> EmbeddingVariables:
        e = entries(stack, rec, join_blocks(grads))
        path = self._path(stack, variables.table.dtype, e.cols.size)
        if path == "linear":
            return EmbeddingVariables(self._apply_linear(stack, e, variables.table, step, skip_nonfinite),
                                      variables.slots)
        if path == "deduped":
            return self._apply_deduped(stack, e, saved.reshape(-1), variables, step, skip_nonfinite)
        return self._apply_sorted(stack, e, variables, step, skip_nonfinite)

    def _apply_linear(self, stack: StackPlan, e: Entries, table: jax.Array, step, skip_nonfinite: bool):
        """e.g. plain SGD: scatter-adds each occurrence's delta, chunk by chunk."""
        opt, pad = stack.optimizer, stack.rows_per_shard
        # Under skip_nonfinite, every occurrence of a row with a non-finite gradient is dropped (sent out of range).
        cols = jnp.where(_poisoned(e.cols, e.bad), pad, e.cols) if skip_nonfinite else e.cols

        def add(tbl, cols, src, values):
            return tbl.at[cols].add(opt.linear_delta(e.grads(src, values), step), mode="drop"), None

        return self._scan_chunks(add, table, cols, e.src, e.values, fills=(pad, stack.rows_per_device, 0.0))[0]

    def _apply_deduped(self, stack: StackPlan, e: Entries, first: jax.Array, variables: EmbeddingVariables,
                       step, skip_nonfinite: bool) -> EmbeddingVariables:
        """Sums the gradients of each touched row, then applies the optimizer to it once, in chunks.

        The sums go to the representative entry's position in `acc [N', dim]`
        (N' = N rounded up to whole chunks, so the update loop reads it chunk
        by chunk without padding it).
        """
        n, dim, pad = e.cols.shape[0], stack.embedding_dim, stack.rows_per_shard
        padded = math.prod(self._chunks(n))
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
                grads = pooling.max_norm_vjp(read(table, cols, first), grads, stack.max_norm, jnp)
            return acc.at[rep].add(grads, mode="drop"), None

        acc, _ = self._scan_chunks(accumulate, jnp.zeros_like(e.values, shape=(padded, dim)), e.cols, e.src, e.values, rep,
                                   first, fills=(pad, stack.rows_per_device, 0.0, padded, 0.0))
        # Only the representatives write their (whole) rows back; the others are dropped.
        own = jnp.where(rep == jnp.arange(n, dtype=jnp.int32), e.cols, pad)

        def update(state, cols, first, grads):
            at = jnp.minimum(cols, pad - 1)
            old = {k: v.at[at].get(mode="promise_in_bounds") for k, v in state.slots.items()}
            rows = read(state.table, cols, first)
            return _update_rows(stack, state, cols, rows, old, grads, step, skip_nonfinite), None

        return self._scan_chunks(update, EmbeddingVariables(table, dict(variables.slots)), own, first, acc[:n],
                                 fills=(pad, 0.0, 0.0))[0]

    def _apply_sorted(self, stack: StackPlan, e: Entries, variables: EmbeddingVariables, step,
                      skip_nonfinite: bool) -> EmbeddingVariables:
        """The general path (tables that are not f32, or many entries): sort-based dedup, unchunked."""
        table = variables.table
        grads = e.grads(e.src, e.values)
        if stack.max_norm is not None:
            rows = table.at[e.cols].get(mode="fill", fill_value=0).astype(jnp.float32)
            grads = pooling.max_norm_vjp(rows, grads, stack.max_norm, jnp, stack.row_sum)
        cols, grads = _dedup(e.cols, grads, stack.rows_per_shard)
        rows = table.at[cols].get(mode="fill", fill_value=0).astype(jnp.float32)
        slots = {k: v.at[cols].get(mode="fill", fill_value=0) for k, v in variables.slots.items()}
        return _update_rows(stack, variables, cols, rows, slots, grads, step, skip_nonfinite)
