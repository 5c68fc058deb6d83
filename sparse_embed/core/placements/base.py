"""What a placement is: the strategy that owns one way of laying a stack's tables out on the devices.

A `Placement` is a stateless object, registered by name (`placements`).
A `StackPlan` names its placement (`StackPlan.placement`) and gets the
object from `StackPlan.strategy`; the plan, the relayout, the lookup and
the cost model ask it instead of branching on names. Every method takes the
frozen `StackPlan` it is asked about (or, for the cost model before there
is a plan, a `core.cost.TableLoad`). Its four parts:

- layout (plan time, plain numbers): where each table's rows go
  (`assign`), the shape of the stacked array (`rows_per_shard`,
  `array_dim`) and of the batch (`segments`, `partial_rows`);
- relayout (host numpy, or jnp inside `shard_map`): the stacked array to
  and from natural (id) order, whole (`from_shard_major`, `stack_rows`,
  `local_columns`, `blocks_to_local`) and in checkpoint chunks
  (`to_natural_chunk`, `from_natural_chunk`);
- exchange (jnp inside the lookup's `shard_map`, with `core.collectives`):
  the entries each device sends (`exchange`), the view its kernel gets
  (`view`), the activations it gets back (`activations`), the backward's
  routing of the activation gradients (`backward`, `nonfinite_rows`);
- cost (`core.cost` reads it): bytes through collectives (`traffic` per
  table, `collective_bytes` per stack), extra work (`work`) and memory
  (`memory`, `held_rows`).

The defaults below are those of a placement that holds whole, unsplit rows;
a method without one must be written by every placement.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, NamedTuple, Sequence

import jax

from sparse_embed.core.collectives import KernelStack, kernel_stack

CAPACITY_ALIGNMENT = 8  # COO entries per (device, segment) partition are a multiple of this


def round_up(x: int, m: int) -> int:
    """The smallest multiple of m that is >= x."""
    return -(-x // m) * m


class Where(NamedTuple):
    """Where one table of a stack lives (`planning.TablePlacement` adds the table and its expected ids)."""

    row_offset: int  # stack row of the table's id 0
    padded_rows: int  # its rows, padded
    shard: int | None = None  # the one device that holds it, if one does
    rotation: int = 0  # SparseCore stacks: SparseCore of id 0 (jax-tpu-embedding's shard_rotation)


def one_after_another(tables: Sequence, num_shards: int, sparsecores: int = 0) -> list[Where]:
    """The tables one after the other, each padded to a multiple of S rows (`8 * sparsecores * S` on
    SparseCores, where table k is rotated by `k * sparsecores` SparseCores: jax-tpu-embedding's layout)."""
    out, offset, align = [], 0, num_shards * (8 * sparsecores or 1)
    for k, t in enumerate(tables):
        out.append(Where(offset, round_up(t.vocabulary_size, align), None,
                         k * sparsecores % (num_shards * sparsecores or 1)))
        offset += out[-1].padded_rows
    return out


def padded_vocab(load, num_devices: int) -> int:
    """A `TableLoad`'s rows as the plan pads them: a multiple of the devices."""
    return round_up(load.vocab, num_devices)


def routed_bytes(stack, capacity: int) -> int:
    """Bytes one device receives in a train step when entries go to their segment's device (3 words each) and
    every shard's partial activations come back and its gradients go out (`partial_rows` each)."""
    D, dim = stack.num_shards, stack.embedding_dim
    return (D - 1) * (12 * stack.segments * capacity + 2 * 4 * stack.partial_rows * dim * D) // D


class Placement:
    """One placement of a stack's tables (see the module docstring)."""

    name: ClassVar[str]
    raw_ids: ClassVar[bool] = False  # can it hold a raw-id (dynamic=) table, whose map lives on its owner shard?
    sparsecores: ClassVar[bool] = False  # can SparseCores run it (rows MOD-sharded over every SparseCore)?
    memory_target: ClassVar[bool] = True  # may a memory budget move a table here (`core.placement.to_move`)?
    shares_stacks: ClassVar[bool] = False  # does its traffic depend on how many tables share a stack (`share`)?

    def __repr__(self) -> str:
        return f"<placement {self.name!r}>"

    # ------------------------------------------------------------------ layout
    def assign(self, tables: Sequence, loads: dict, device_load: list[float], num_shards: int,
               sparsecores: int = 0) -> tuple[list[Where], int]:
        """Where each of a stack's `TableSpec`s lives, and the rows each device holds if the placement fixes
        them (else 0). `loads`: `{table: TableLoad}`; `device_load`: bytes per device of earlier stacks that
        balance tables over the devices (updated in place by those)."""
        return one_after_another(tables, num_shards, sparsecores), 0

    def total_rows(self, stack) -> int:
        """Rows of the stack-row space (every table's rows, padded)."""
        return sum(t.padded_rows for t in stack.tables)

    def rows_per_shard(self, stack) -> int:
        """Rows each device holds."""
        raise NotImplementedError

    def array_dim(self, stack) -> int:
        """Columns of the stacked arrays on each device."""
        return stack.embedding_dim

    def splits(self, stack, width: int) -> bool:
        """Is an array of `width` natural columns split over the devices (rather than held whole)?"""
        return False

    def segments(self, stack) -> int:
        """Destination segments of each device's COO batch (the devices its ids go to; 1: its own)."""
        raise NotImplementedError

    def partial_rows(self, stack) -> int:
        """Rows of the partial activations a shard computes for each source device."""
        return stack.rows_per_device

    def whole_activations(self, stack) -> bool:
        """Are a shard's partial activations this device's activations as they are (nothing to exchange)?"""
        return False

    # ---------------------------------------------------------------- relayout
    def from_shard_major(self, stack, array, width: int | None):
        """A stacked global array (host numpy) -> `[total_rows, width]` in stack-row order."""
        raise NotImplementedError

    def stack_rows(self, stack, global_rows):
        """The stack row held at each global row of a stacked array (numpy or jnp)."""
        raise NotImplementedError

    def local_columns(self, stack, global_rows, x, fill, xp):
        """Whole rows `x [n, width]` of the stack rows at `global_rows` -> the columns those global rows hold
        (padding columns `fill`). `xp`: numpy or jax.numpy."""
        return x

    def block_rows(self, stack, i: int, rows: int) -> int:
        """Rows of table i's natural blocks as `blocks_to_local` takes them (`rows`: `relayout.stored_rows`)."""
        return rows

    def blocks_to_local(self, stack, blocks: list[jax.Array], axis: str) -> jax.Array:
        """Inside shard_map: each table's natural blocks (`relayout`) -> this device's rows of the stack."""
        raise NotImplementedError

    def chunk_align(self, stack) -> int:
        """Streamed chunks' rows per device are a multiple of this (`relayout.chunk_rows`)."""
        return stack.num_shards

    def table_range(self, stack, i: int) -> tuple[int, int, int]:
        """Where table i lies, as the chunk functions read it: `(start, count, rotation)`."""
        p = stack.tables[i]
        return p.row_offset, p.padded_rows, 0

    def to_natural_chunk(self, stack, local: jax.Array, where: jax.Array, m: int, axis: str,
                         width: int) -> jax.Array:
        """Inside shard_map: this device's natural rows `[c0 * S + d * m, +m)` of one table (see
        `relayout.mod_to_natural_chunk`)."""
        raise NotImplementedError

    def from_natural_chunk(self, stack, local: jax.Array, chunk: jax.Array, where: jax.Array,
                           axis: str) -> jax.Array:
        """Inside shard_map: the inverse of `to_natural_chunk`, written into `local`."""
        raise NotImplementedError

    # ---------------------------------------------------------------- exchange
    def exchange(self, stack, axis: str, coo) -> tuple[jax.Array, jax.Array, jax.Array]:
        """This device's COO batch -> the `(col_ids, row_ids, values)` `[sources, C]` its kernel reads."""
        raise NotImplementedError

    def view(self, stack, axis: str, per_feature: bool = False) -> KernelStack:
        """The stack as this placement's kernel sees it in the forward and backward."""
        return kernel_stack(stack, per_feature=per_feature)

    def activations(self, stack, axis: str, partials: jax.Array) -> jax.Array:
        """Every shard's partials `[D, partial_rows, dim]` -> this device's activations `[rows_per_device, dim]`."""
        raise NotImplementedError

    def backward(self, stack, axis: str, kernel, rec, saved: Any, state, grads: Any, step, skip: bool):
        """This device's activation gradients -> the stack's updated `EmbeddingVariables` (by `kernel`)."""
        raise NotImplementedError

    def nonfinite_rows(self, stack, axis: str, rec, grads: jax.Array,
                       count: Callable[[KernelStack, Any, jax.Array], jax.Array]) -> jax.Array:
        """Table rows a NaN/inf activation gradient reaches, over every device (`count`: one shard's)."""
        raise NotImplementedError

    # -------------------------------------------------------------------- cost
    def choosable(self, load) -> bool:
        """May "auto" choose this placement for a table of `load`?"""
        return True

    def share(self, tables: int, num_devices: int) -> float | None:
        """`shares_stacks`: the `share` of `traffic` for a table of a stack of `tables` tables."""
        return None

    def traffic(self, load, num_devices: int, share: float | None = None) -> float:
        """Bytes one device receives through collectives per train step for a table of `load` (D > 1)."""
        raise NotImplementedError

    def work(self, load, num_devices: int) -> float:
        """Bytes of extra work per train step, counted as traffic by "auto" (D > 1)."""
        return 0.0

    def memory(self, load, num_devices: int) -> float:
        """Bytes of a table of `load` and its slots on the devices that hold it, as the plan pads them."""
        raise NotImplementedError

    def held_rows(self, stack, p) -> int:
        """Rows of table placement `p` on a device that holds it."""
        return p.padded_rows

    def most_ids(self, stack) -> float:
        """The most ids one device is expected to send one segment (`core.cost.expected_capacity`)."""
        return sum(t.expected_ids for t in stack.tables) / self.segments(stack)

    def collective_bytes(self, stack, capacity: int, skip_nonfinite: bool) -> int:
        """Bytes one device receives through the collectives of one train step of `lookup` for this stack."""
        raise NotImplementedError

    def row_sums(self, stack, skip_nonfinite: bool = True) -> int:
        """f32 all-reduced per received entry in a train step for statistics of rows split over devices."""
        return 0

    def row_gathers(self, stack) -> int:
        """f32 arrays `[D*C, array_dim]` all_gathered whole per train step for rows split over devices."""
        return 0

