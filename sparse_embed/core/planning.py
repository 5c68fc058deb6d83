"""Planning: specs + mesh -> a static, hashable `EmbeddingPlan`.

The plan decides which tables share one stacked array, where each table's
rows live inside it, how rows are assigned to shards and how the samples of
the features that read a stack are laid out on each device. It is a static
argument of `jit` and an immutable value: nothing in it depends on data. (An
auto capacity's high-water mark is host state, kept by `preprocess`; the
capacity a batch was built with travels in the batch's array shapes.)

Placements (`StackPlan.placement`; docs/placement.md) are strategies
(`core.placements`): each one owns how a stack's rows and columns map to the
devices, its relayout, its exchange and its cost. The plan holds their
layout as plain data and asks `StackPlan.strategy` for what follows from
it; the cost model (`core.cost`) and the planner's choice ("auto",
`core.placement`) read it. SparseCore geometry (`sparsecores`, `mod_shards`,
`sc_rows`, slices) is the "row" layout over every SparseCore (`core.sparsecore`);
a stack's `backend` names the backend that runs it, if any (`core.kernels`
and `preprocess` pick its kernel and preprocessing hook by it).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import warnings
from typing import Any, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sparse_embed.core import cost, offload_plan
from sparse_embed.core import placement as placement_lib
from sparse_embed.core import placements
from sparse_embed.core import sparsecore
from sparse_embed.core.batch import BatchLayout, Stats
from sparse_embed.core.collectives import KernelStack  # noqa: F401 (re-exported from its earlier home)
from sparse_embed.core.placements import CAPACITY_ALIGNMENT, round_up
from sparse_embed.core.sparsecore import layout as sparsecore_layout
from sparse_embed.core.specs import FeatureSpec, TableSpec

OVERFLOW_POLICIES = ("error", "drop")
KERNELS = ("auto", "generic", "native")  # implementations of the lookup's per-shard work (`core.kernels`)
KERNEL_ENV = "SPARSE_EMBED_KERNEL"  # overrides kernel="auto" when a plan is made
NONFINITE_POLICIES = ("skip", "apply")


@dataclasses.dataclass(frozen=True)
class TablePlacement:
    """Where a table lives inside its stack."""

    table: TableSpec
    row_offset: int  # stack row of the table's id 0; a multiple of num_shards
    padded_rows: int  # vocabulary_size rounded up to a multiple of num_shards
    shard: int | None = None  # the one device that holds the table, where its placement puts it on one
    expected_ids: float = 0.0  # ids its features send per device and step, as the cost model expects them
    rotation: int = 0  # SparseCore stacks: SparseCore of id 0 (jax-tpu-embedding's shard_rotation)


@dataclasses.dataclass(frozen=True)
class FeatureLayout:
    """Where a feature's samples live among a stack's per-device output rows."""

    feature: FeatureSpec
    table_row_offset: int  # row_offset of the feature's table in the stack
    row_offset: int  # first per-device output row of this feature
    samples_per_device: int  # batch_size // num_devices
    shard: int | None = None  # the one device that holds the feature's table, if one does (`TablePlacement`)
    partial_offset: int | None = None  # then: first row of this feature in its shard's partials
    table_rotation: int = 0  # rotation of the feature's table in the stack (SparseCores; `TablePlacement`)
    slices: int = 1  # SparseCore stacks: its rows are cut into one slice per SparseCore of the device,
    slice_rows: int = 0  # slice k at output rows `[k * slice_rows + row_offset, ... + rows_per_device / slices)`

    def out_rows(self, local):
        """The row of each of this feature's local rows `[0, rows_per_device)` in a shard's partial activations
        (`partial_row_offset` on; on SparseCores, slice by slice). numpy or jnp."""
        if self.slices == 1:
            return self.partial_row_offset + local
        b = self.rows_per_device // self.slices
        return local // b * self.slice_rows + self.row_offset + local % b

    def take(self, a):
        """This feature's rows `[..., rows_per_device, w]` of a stack's per-device rows `[..., rows, w]`."""
        if self.slices == 1:
            return a[..., self.row_offset:self.row_offset + self.rows_per_device, :]
        b = self.rows_per_device // self.slices
        x = a.reshape(*a.shape[:-2], self.slices, self.slice_rows, a.shape[-1])
        return x[..., self.row_offset:self.row_offset + b, :].reshape(*a.shape[:-2], self.rows_per_device, a.shape[-1])

    @property
    def partial_row_offset(self) -> int:
        """First row of this feature in a shard's partial activations (see `StackPlan.partial_rows`)."""
        return self.row_offset if self.partial_offset is None else self.partial_offset

    @property
    def rows_per_device(self) -> int:
        """Output rows on each device: one per sample, or per (sample, position)."""
        return self.samples_per_device * max(self.feature.max_sequence_length, 1)


@dataclasses.dataclass(frozen=True)
class StackPlan:
    """One stacked table: `[num_shards * rows_per_shard, embedding_dim]`, a frozen value.

    Its layout follows from its data and its placement's strategy
    (`strategy`); its cost is `core.cost`'s, its exchange the strategy's
    (called by the lookup).
    """

    name: str
    tables: tuple[TablePlacement, ...]
    features: tuple[FeatureLayout, ...]
    num_shards: int  # devices of the mesh axis (each one a source of ids, and a holder of rows)
    capacity: int | None  # COO entries per (device, shard) partition; None = auto
    placement: str = placements.DEFAULT  # a registered placement's name (`core.placements`)
    shard_rows: int = 0  # rows each device holds where the placement fixes them when it assigns tables (else 0)
    sparsecores: int = 0  # SparseCores per device that run it on TPU (0: none; `core.sparsecore`)

    @property
    def strategy(self) -> placements.Placement:
        """The placement's strategy object: its layout, relayout, exchange and cost."""
        return placements.get(self.placement)

    @property
    def backend(self) -> str | None:
        """The backend that runs the stack with its own kernel and batch (`core.sparsecore.NAME`), or None: the
        lookup's usual exchange and kernels, on COO batches."""
        return sparsecore.NAME if self.sparsecores else None

    @property
    def first(self) -> TableSpec:
        return self.tables[0].table

    @property
    def embedding_dim(self) -> int:
        return self.first.embedding_dim

    @property
    def optimizer(self):
        return self.first.resolved_optimizer

    @property
    def max_norm(self) -> float | None:
        return self.first.max_norm

    @property
    def dtype(self):
        return self.first.dtype

    @property
    def dynamic(self):
        """The stack's `Dynamic` policy (a raw-id table is always alone in its stack), or None."""
        return self.first.dynamic

    @property
    def total_rows(self) -> int:
        """Rows of the stack-row space (every table's rows, padded; or every device's block)."""
        return self.strategy.total_rows(self)

    @property
    def rows_per_shard(self) -> int:
        """Rows each device holds."""
        return self.strategy.rows_per_shard(self)

    @property
    def slice_rows(self) -> int:
        """SparseCore stacks: output rows of one SparseCore's slice (a device's rows over its SparseCores)."""
        return self.rows_per_device // self.sparsecores

    @property
    def mod_shards(self) -> int:
        """The shards rows are MOD-sharded over ("row"): the devices, or on SparseCores every SparseCore."""
        return self.num_shards * max(self.sparsecores, 1)

    @property
    def sc_rows(self) -> int:
        """Rows of one of `mod_shards` ("row": a device's rows, or one SparseCore's)."""
        return self.rows_per_shard // max(self.sparsecores, 1)

    def join_rows(self, parts):
        """Per-feature rows `[..., rows_per_device_f, w]` (in `features` order) -> the stack's `[..., rows, w]`
        (jnp; the inverse of `FeatureLayout.take`)."""
        if not self.sparsecores:
            return jnp.concatenate(parts, axis=-2)
        C = self.sparsecores
        cut = [p.reshape(*p.shape[:-2], C, p.shape[-2] // C, p.shape[-1]) for p in parts]
        x = jnp.concatenate(cut, axis=-2)
        return x.reshape(*x.shape[:-3], self.rows_per_device, x.shape[-1])

    @property
    def array_dim(self) -> int:
        """Columns of the stacked arrays on each device: `embedding_dim`, or its share of it."""
        return self.strategy.array_dim(self)

    def slot_widths(self) -> dict[str, int]:
        """Columns of each optimizer slot's stacked array (a slot split like the table: its share)."""
        return {k: self.array_dim if self.splits(v.width) else v.width
                for k, v in self.optimizer.slots(self.embedding_dim).items()}

    @property
    def array_rows(self) -> int:
        """Rows of the stacked (global) table array: `num_shards * rows_per_shard`."""
        return self.num_shards * self.rows_per_shard

    @property
    def segments(self) -> int:
        """Destination segments of each device's COO batch: the devices ids go to (1: the device's own ids,
        read locally or gathered by every device)."""
        return self.strategy.segments(self)

    @property
    def rows_per_device(self) -> int:
        """Output rows of this stack on each device (all its features)."""
        return sum(f.rows_per_device for f in self.features)

    @property
    def partial_rows(self) -> int:
        """Rows of the partial activations a shard computes for each source device (every feature's rows, or
        only those of the shard's own tables where each table is on one device)."""
        return self.strategy.partial_rows(self)

    @property
    def activations_per_feature(self) -> bool:
        """Are a shard's partial activations this device's activations as they are (one shard, or every device
        holding the whole table), with the features' rows side by side? Then the kernel writes each feature's
        activations as an array of its own, which the lookup returns without a copy."""
        tiled = all(f.row_offset == sum(g.rows_per_device for g in self.features[:i]) and f.slices == 1
                    for i, f in enumerate(self.features))
        return (self.strategy.whole_activations(self) and not self.sparsecores and tiled
                and sum(f.rows_per_device for f in self.features) == self.rows_per_device)

    def splits(self, width: int) -> bool:
        """Is an array of `width` natural columns split over the devices (e.g. "column": the table and the slots
        as wide as it), rather than held whole where its rows are (every other array, e.g. a per-row slot)?"""
        return self.strategy.splits(self, width)

    def row_sums(self, skip_nonfinite: bool = True) -> int:
        """`core.cost.row_sums` (kept here for `kernels.native_cpu`)."""
        return cost.row_sums(self, skip_nonfinite)

    @functools.cached_property
    def batch_layout(self) -> BatchLayout:
        """What decides which rows and output rows this stack's batch entries mean (every field that does, and
        nothing that differs between processes or batches, such as functions or the capacity): the mark
        `preprocess` puts on its batch, which the lookup checks (`core.batch`)."""
        key = (self.name, self.placement, self.num_shards, self.shard_rows, self.sparsecores, self.rows_per_shard,
               tuple((t.table.name, t.table.vocabulary_size, t.table.dynamic is not None, t.row_offset,
                      t.padded_rows, t.shard, t.rotation) for t in self.tables),
               tuple((f.feature.name, f.feature.table.name, f.feature.batch_size, f.feature.max_sequence_length,
                      str(f.feature.table.combiner), f.table_row_offset, f.row_offset, f.samples_per_device,
                      f.shard, f.partial_offset, f.table_rotation, f.slices, f.slice_rows) for f in self.features))
        tables = ", ".join(t.table.name for t in self.tables)
        return BatchLayout(self.name, hashlib.sha256(repr(key).encode()).hexdigest()[:16],
                           f"placement {self.placement!r} over {self.num_shards} devices, {self.rows_per_shard} "
                           f"rows each, tables {tables}")


@dataclasses.dataclass(frozen=True, repr=False)
class EmbeddingPlan:
    """The static result of `plan()`. Hashable; a static argument of jit."""

    mesh: Mesh
    axis_name: str
    stacks: tuple[StackPlan, ...]
    on_overflow: str
    nonfinite_gradients: str = "skip"
    kernel: Any = "auto"  # the per-shard implementation of the lookup: a name or a kernel (`core.kernels`)
    tiered: tuple[TableSpec, ...] = ()  # offloaded tables as declared (their stacks hold `cache_rows` rows)

    @property
    def num_shards(self) -> int:
        return self.mesh.shape[self.axis_name]

    @property
    def stack_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stacks)

    def __repr__(self) -> str:
        policies = f"on_overflow={self.on_overflow!r}"
        if self.nonfinite_gradients != "skip":
            policies += f", nonfinite_gradients={self.nonfinite_gradients!r}"
        if self.kernel != "auto":
            policies += f", kernel={self.kernel!r}"
        lines = [f"EmbeddingPlan({self.num_shards} shards on mesh axis {self.axis_name!r}, {policies})"]
        for s in self.stacks:
            tables = ", ".join(f"{p.table.name}[{p.table.vocabulary_size}]" for p in s.tables)
            feats = ", ".join(
                f.feature.name + (f"[seq {f.feature.max_sequence_length}]" if f.feature.is_sequence else "")
                for f in s.features)
            raw = f", raw ids {s.dynamic}" if s.dynamic else ""
            where = ("" if s.placement == placements.DEFAULT else f", {s.placement}") + (
                f", {s.sparsecores} SparseCores per device" if s.sparsecores else "")
            lines.append(f"  stack {s.name!r}: [{s.array_rows}, {s.embedding_dim}] {type(s.optimizer).__name__}, "
                         f"tables {tables}; features {feats}; capacity {s.capacity or 'auto'}{raw}{where}")
        return "\n".join(lines)

    def collective_bytes(self, capacities: Mapping[str, int] | None = None) -> int:
        """Bytes one device receives through collectives in one train step of `lookup` (`core.cost`);
        `capacities` (e.g. `Stats.capacity`) for stacks of auto capacity."""
        return cost.plan_collective_bytes(self, capacities)

    def memory_per_device(self) -> int:
        """Bytes of tables and optimizer slots on each device."""
        return cost.plan_memory(self)

    def describe(self, capacities: Mapping[str, int] | None = None, offload: Mapping[str, Any] | None = None) -> str:
        """A table of where every table lives, its memory per device and the bytes its stack exchanges
        (`core.cost.describe`); offloaded tables' caches, with their hit rates from `offload` (`Tiers.stats()`)."""
        return cost.describe(self, capacities, offload)

    def stack(self, name: str) -> StackPlan:
        for s in self.stacks:
            if s.name == name:
                return s
        raise KeyError(f"No stack {name!r} in this plan; stacks are {list(self.stack_names)}.")

    @property
    def features(self) -> dict[str, FeatureSpec]:
        return {f.feature.name: f.feature for s in self.stacks for f in s.features}

    @property
    def tables(self) -> dict[str, TableSpec]:
        """name -> TableSpec as the stacks hold it (an offloaded table: its cache of `cache_rows` rows)."""
        return {t.table.name: t.table for s in self.stacks for t in s.tables}

    @property
    def tiered_tables(self) -> dict[str, TableSpec]:
        """name -> TableSpec as declared, of the offloaded tables (`storage=`): `vocabulary_size` is all its rows."""
        return {t.name: t for t in self.tiered}

    def stack_of_table(self, table_name: str) -> tuple[StackPlan, TablePlacement]:
        for s in self.stacks:
            for t in s.tables:
                if t.table.name == table_name:
                    return s, t
        raise KeyError(f"No table {table_name!r} in this plan; tables are {sorted(self.tables)}.")

    def table_sharding(self) -> NamedSharding:
        """Sharding of every stacked table and slot: rows over the plan's axis.

        Spelled `P(axis)` (not the equivalent `P(axis, None)`), as jit outputs
        are, so that a step's output tables hit the same jit cache entry.
        """
        return NamedSharding(self.mesh, P(self.axis_name))

    def batch_sharding(self) -> NamedSharding:
        """Sharding of preprocessed batch arrays: leading device axis over the plan's axis."""
        return NamedSharding(self.mesh, P(self.axis_name))

    def capacity(self, stack: str) -> int | None:
        """The explicit capacity of a stack; None = auto (sized by `preprocess` from the data)."""
        return self.stack(stack).capacity


def _stack_key(t: TableSpec) -> tuple:
    """Tables with equal keys can share a stack; a raw-id table's key is its own (it maps its own rows)."""
    own = t.dynamic or t.storage  # raw ids and tiered tables: a stack of their own
    return (t.embedding_dim, t.resolved_optimizer, t.combiner, t.max_norm, t.dtype, t.name if own else None)


def _describe_incompatibility(a: TableSpec, b: TableSpec) -> str:
    if a.dynamic or b.dynamic:
        return f"table {(a if a.dynamic else b).name!r} is keyed by raw ids (dynamic=...), which is never stacked"
    if a.storage or b.storage:
        return f"table {(a if a.storage else b).name!r} is offloaded (storage=...), which is never stacked"
    names = ("embedding_dim", "optimizer", "combiner", "max_norm", "dtype")
    diffs = [
        f"{n}: {x!r} vs {y!r}" for n, x, y in zip(names, _stack_key(a), _stack_key(b)) if x != y
    ]
    return "; ".join(diffs)


def _normalise_features(features: Mapping[str, FeatureSpec] | Sequence[FeatureSpec]) -> dict[str, FeatureSpec]:
    if isinstance(features, Mapping):
        items = list(features.items())
    else:
        items = [(getattr(f, "name", None), f) for f in features]
    if not items:
        raise ValueError("plan() needs at least one FeatureSpec.")
    out: dict[str, FeatureSpec] = {}
    for key, f in items:
        if not isinstance(f, FeatureSpec):
            raise TypeError(f"Feature {key!r}: expected a FeatureSpec, got {type(f).__name__}.")
        if key != f.name:
            raise ValueError(f"Feature key {key!r} differs from its FeatureSpec name {f.name!r}.")
        if f.name in out:
            raise ValueError(f"Feature {f.name!r} is given twice.")
        out[f.name] = f
    return out


def _collect_tables(features: dict[str, FeatureSpec]) -> dict[str, TableSpec]:
    tables: dict[str, TableSpec] = {}
    for f in features.values():
        t = tables.setdefault(f.table.name, f.table)
        if t != f.table:
            raise ValueError(
                f"Two different tables are named {t.name!r} (feature {f.name!r} reads one of them); "
                "table names must be unique."
            )
    return tables


def _group_tables(tables: dict[str, TableSpec], stacking: Any, placements: dict[str, str]) -> list[list[str]]:
    """Table-name groups, each group one stack (the tables of a stack share a placement)."""
    if stacking is None:
        return [[n] for n in sorted(tables)]
    if isinstance(stacking, str):
        if stacking != "auto":
            raise ValueError(f"stacking must be 'auto', None or a list of lists of table names, got {stacking!r}.")
        groups: dict[tuple, list[str]] = {}
        for n in sorted(tables):
            groups.setdefault((_stack_key(tables[n]), placements[n]), []).append(n)
        return list(groups.values())
    groups_out: list[list[str]] = []
    seen: set[str] = set()
    for group in stacking:
        if isinstance(group, str) or not isinstance(group, Iterable):
            raise ValueError(f"stacking must be a list of lists of table names; got the element {group!r}.")
        group = list(group)
        if not group:
            raise ValueError("stacking contains an empty group.")
        for n in group:
            if n not in tables:
                raise ValueError(f"stacking names table {n!r}, which no feature reads; tables are {sorted(tables)}.")
            if n in seen:
                raise ValueError(f"stacking names table {n!r} more than once.")
            seen.add(n)
            if _stack_key(tables[n]) != _stack_key(tables[group[0]]):
                raise ValueError(
                    f"Tables {group[0]!r} and {n!r} cannot be stacked: "
                    f"{_describe_incompatibility(tables[group[0]], tables[n])}."
                )
            if placements[n] != placements[group[0]]:
                raise ValueError(f"Tables {group[0]!r} and {n!r} cannot be stacked: their placements differ "
                                 f"({placements[group[0]]!r} vs {placements[n]!r}).")
        groups_out.append(sorted(group))
    groups_out += [[n] for n in sorted(tables) if n not in seen]
    return groups_out


def _resolve_axis(mesh: Mesh | None, axis_name: str | None) -> tuple[Mesh, str]:
    """The mesh (default: every device on one axis) and the axis that shards the tables."""
    if mesh is None:
        mesh = Mesh(np.array(jax.devices()), ("device",))
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if axis_name is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(
                f"The mesh has axes {mesh.axis_names}; pass axis_name= to say which one shards the tables."
            )
        axis_name = mesh.axis_names[0]
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}.")
    kind = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()))).get(axis_name)
    if kind is not None and kind != jax.sharding.AxisType.Auto:  # (jax.make_mesh's default axes are Explicit)
        raise ValueError(f"The mesh's axis {axis_name!r} is {kind.name}: the plan shards its tables with sharding "
                         "constraints and shard_map, which need an Auto axis; make the mesh with jax.make_mesh(..., "
                         "axis_types=(jax.sharding.AxisType.Auto, ...)) or jax.sharding.Mesh(devices, names).")
    check_replicas_in_one_process(np.asarray(mesh.devices), tuple(mesh.axis_names), axis_name)
    return mesh, axis_name


def check_replicas_in_one_process(devices: np.ndarray, axis_names: tuple[str, ...], axis: str) -> None:
    """Over the mesh's other axes a plan's tables are replicated, each replica fed the same batch: only a process
    holds that batch (each preprocesses its own samples), so replicas in several processes would train apart."""
    rows = np.moveaxis(devices, axis_names.index(axis), 0).reshape(devices.shape[axis_names.index(axis)], -1)
    for row in rows:
        if len({int(d.process_index) for d in row}) > 1:
            others = [a for a in axis_names if a != axis]
            raise ValueError(f"The mesh's axes {others} besides the plan's axis {axis!r} span several processes: "
                             "the tables would be replicated over them, each process training its copy on its own "
                             "samples, apart from the others. Shard the tables over an axis that spans every "
                             "process (a 1-D mesh of all devices, or axis_name= that axis).")


def _check_policies(on_overflow: str, nonfinite_gradients: str) -> None:
    if on_overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"on_overflow must be one of {OVERFLOW_POLICIES}, got {on_overflow!r}.")
    if nonfinite_gradients not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite_gradients must be one of {NONFINITE_POLICIES}, got {nonfinite_gradients!r}.")


def _check_kernel(kernel: Any) -> Any:
    """A kernel name of KERNELS ("auto" overridden by $SPARSE_EMBED_KERNEL), or a kernel instance."""
    if not isinstance(kernel, str):
        # (imported here: the kernels import the plan)
        from sparse_embed.core.kernels.interface import missing_methods

        missing = missing_methods(kernel)
        if missing:
            raise TypeError(f"kernel must be one of {KERNELS} or a kernel (the Kernel protocol of "
                            "sparse_embed.core.kernels.interface; subclass sparse_embed.core.kernels.KernelBase for "
                            f"its defaults), got {kernel!r}, which lacks {missing}.")
        return kernel
    source = ""
    if kernel == "auto" and os.environ.get(KERNEL_ENV):
        kernel, source = os.environ[KERNEL_ENV], f" (from ${KERNEL_ENV})"
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}{source}.")
    return kernel


def _check_capacity(what: str, c: Any) -> int:
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c <= 0:
        raise ValueError(f"{what}: capacity must be a positive int, got {c!r}.")
    return round_up(int(c), CAPACITY_ALIGNMENT)


def plan(
    features: Mapping[str, FeatureSpec] | Sequence[FeatureSpec],
    mesh: Mesh | None = None,
    *,
    axis_name: str | None = None,
    stacking: Any = "auto",
    capacity: int | Mapping[str, int] | None = None,
    on_overflow: str = "error",
    nonfinite_gradients: str = "skip",
    kernel: Any = "auto",
    placement: str | Mapping[str, str] = placements.DEFAULT,
    memory_budget: int | None = None,
    offload_to: str | None = None,
    ids_per_sample: float | Mapping[str, float] | None = None,
    stats: Any = None,
    sparsecores: int | None = None,
) -> EmbeddingPlan:
    """The `EmbeddingPlan`: the stacked, sharded layout of the tables `features` read.

    Args:
      features: name -> FeatureSpec (or a sequence of FeatureSpecs).
      mesh: the device mesh; default, a 1-D mesh over all devices ("device").
      axis_name: the mesh axis that shards the tables and splits the batch;
        default, the mesh's only axis.
      stacking: "auto" (stack tables with equal dim, optimizer, combiner,
        max_norm and dtype), None (one stack per table), or lists of table
        names. A raw-id table (`dynamic=`) is always a stack of its own. A stack is
        named by its tables' names, sorted and joined with "_".
      capacity: static COO entries per (source device, destination shard)
        partition, an int or {stack_name: int}; None sizes each stack from
        the first batch and grows it (one recompile) when a batch needs more.
      on_overflow: with an explicit capacity, "error" (ValueError) or "drop"
        (the last ids in sample order dropped, counted in Stats).
      nonfinite_gradients: "skip" (a row with a NaN/inf gradient keeps its
        values, counted in `nonfinite_rows`) or "apply".
      kernel: "auto" (fastest for the platform and optimizer;
        `$SPARSE_EMBED_KERNEL` overrides it), "generic" (jnp, the reference),
        "native" (C++, CPU) or a kernel from `sparse_embed.core.kernels`.
      placement: "row" (the default), "column", "table", "replicated",
        "auto" (the cost model of `core.placement` chooses per table) or
        `{table: placement}` (others "auto"); see docs/placement.md.
      memory_budget: bytes of tables and slots per device: "auto" moves tables to cheaper placements until they
        fit (else a ValueError); with `offload_to` (a directory) the largest go to disk under caches that fit.
      ids_per_sample: the cost model's ids per sample, one number or
        `{feature: ids}` (default 1, or what `stats` observed).
      stats: `Stats` of earlier batches (their stacks' traffic, for the cost model).
      sparsecores: SparseCores per device (default: detected; 0 off TPU) that run the stacks they can on TPU.
    """
    mesh, axis = _resolve_axis(mesh, axis_name)
    num_shards, sc = mesh.shape[axis], sparsecore_layout.count(sparsecores, mesh.devices.flat)
    feats, tables, tiered = _cached_features(_offloaded(features, memory_budget, offload_to, num_shards))
    _check_policies(on_overflow, nonfinite_gradients)
    _check_batch_sizes(feats, num_shards, axis)
    per_sample = _ids_per_sample(feats, tables, ids_per_sample, stats)
    loads = cost.table_loads(feats, tables, num_shards, per_sample, nonfinite_gradients == "skip")
    stacks = _fit_budget(lambda chosen: _stacks(tables, feats, chosen, stacking, num_shards, capacity, loads, sc),
                         _fixed_placements(tables, placement), _explicit_groups(stacking, loads), loads, num_shards,
                         memory_budget)
    sparsecore_layout.warn_fallbacks(stacks, sc)  # once, for the stacks chosen (`_fit_budget` tries several)
    return EmbeddingPlan(mesh, axis, stacks, on_overflow, nonfinite_gradients, _check_kernel(kernel), tiered)


def _explicit_groups(stacking: Any, loads: dict) -> list[list[str]]:
    """The tables of each explicit stack (`stacking=[[...], ...]`), whose tables share one placement; else []."""
    if isinstance(stacking, str) or not isinstance(stacking, Iterable):
        return []
    return [[n for n in g if n in loads] for g in stacking if not isinstance(g, str) and isinstance(g, Iterable)]


def _offloaded(features: Any, budget: int | None, where: str | None, num_shards: int) -> dict[str, FeatureSpec]:
    """The features (normalised), their tables offloaded where `offload_to_fit` decides (with a budget and a
    place, `core.offload_plan`, docs/offload.md)."""
    whole = isinstance(budget, (int, np.integer)) and not isinstance(budget, bool)
    if budget is not None and not (whole and budget > 0):
        raise ValueError(f"memory_budget must be a positive number of bytes per device (an int), got {budget!r}.")
    feats = _normalise_features(features)
    if where is None:
        return feats
    if budget is None:
        raise ValueError("offload_to needs a memory_budget: the bytes per device the tables and caches may take.")
    tables = offload_plan.offload_to_fit(_collect_tables(feats), budget, os.fspath(where), num_shards)
    return {n: dataclasses.replace(f, table=tables[f.table.name]) for n, f in feats.items()}


def _cached_features(feats: dict[str, FeatureSpec]) -> tuple[dict, dict[str, TableSpec], tuple[TableSpec, ...]]:
    """Features of offloaded tables read the table's cache instead: a table of `cache_rows` rows (ids are mapped
    to cache rows on the host, `sparse_embed.tiers`). Returns the features, their tables and the offloaded
    tables as declared."""
    declared = _collect_tables(feats)
    tiered = tuple(declared[n] for n in sorted(declared) if declared[n].storage is not None)
    _check_one_store_each(tiered)
    # a raw-id table's ids are mapped (to rows, then cache rows) before its stack sees them: the cache is static
    cached = {t.name: dataclasses.replace(t, vocabulary_size=t.cache_rows, dynamic=None) for t in tiered}
    feats = {n: dataclasses.replace(f, table=cached[f.table.name]) if f.table.name in cached else f
             for n, f in feats.items()}
    return feats, {**declared, **cached}, tiered


def _check_one_store_each(tiered: tuple[TableSpec, ...]) -> None:
    """Each offloaded table has a store directory of its own (a second table on one would find it locked by the
    first, or open a store of another table)."""
    seen: dict[str, str] = {}
    for t in tiered:
        where = os.path.realpath(t.storage.path)
        if where in seen:
            raise ValueError(f"Tables {seen[where]!r} and {t.name!r} are offloaded to the same store directory "
                             f"{t.storage.path!r}: give each table's Offload(...) a directory of its own.")
        seen[where] = t.name


_INT32_MAX = 2**31 - 1


def _check_row_numbers(stacks: Sequence[StackPlan]) -> None:
    """A batch numbers a device's table rows and output rows in int32, its padding one past the last of each:
    more would wrap to other rows."""
    for s in stacks:
        tables = ", ".join(repr(t.table.name) for t in s.tables)
        if s.rows_per_shard >= _INT32_MAX:
            raise ValueError(f"Stack {s.name!r} (tables {tables}, placement {s.placement!r}): {s.rows_per_shard} "
                             f"table rows on each device, more than a batch's int32 row numbers hold "
                             f"({_INT32_MAX - 1}); split them over more devices (placement 'row') or use smaller "
                             "tables.")
        if s.rows_per_device >= _INT32_MAX:
            raise ValueError(f"Stack {s.name!r} (tables {tables}): {s.rows_per_device} output rows on each device, "
                             f"more than int32 row numbers hold; use a smaller batch per device.")


def _check_batch_sizes(feats: dict[str, FeatureSpec], num_shards: int, axis: str) -> None:
    for f in feats.values():
        if f.batch_size % num_shards:
            raise ValueError(f"Feature {f.name!r}: batch_size {f.batch_size} does not divide evenly over the "
                             f"{num_shards} devices of mesh axis {axis!r}; use a multiple of {num_shards}.")


def _fit_budget(make, fixed: dict[str, str], groups: list[list[str]], loads: dict, num_shards: int,
                memory_budget: int | None) -> tuple[StackPlan, ...]:
    """`make(placements)` of the cost model's choice, with tables moved to placements cheaper in memory
    (`core.placement.to_move`) until the stacks fit the budget.

    The moves end only when every table not fixed needs no more memory where it is than on the default
    placement (memory per table is exact but for "table", which a move always leaves for "row" on D > 1
    devices), so a budget that the plan with those tables on "row" meets always gives a plan. After each move
    the others are chosen again with the moved tables fixed: a table a move left alone in a "table" stack
    goes back to its cheapest other placement, as `choose` does for a plan without a budget. An explicit stack
    (`groups`) has one placement (`stack_mates_alike`): a move of one of its tables moves them all; only the
    caller's `fixed` placements never move.
    """
    stack_of = lambda chosen: {t.table.name: s.name for s in make(chosen) for t in s.tables}  # noqa: E731
    group_of = {n: g for g in groups for n in g}
    held = dict.fromkeys([*fixed, *(n for g in groups if any(m in fixed for m in g) for n in g)])  # + stack mates
    moved: dict[str, str] = {}
    while True:
        given = placement_lib.stack_mates_alike({**fixed, **moved}, groups, loads, num_shards)
        chosen = placement_lib.choose(loads, given, stack_of, num_shards)
        stacks = make(chosen)
        need = sum(cost.memory_per_device(s) for s in stacks)
        if memory_budget is None or need <= memory_budget:
            _check_row_numbers(stacks)
            return stacks
        move = placement_lib.to_move(chosen, held, loads, num_shards)  # (a moved table may move on, lower)
        if move is None:
            free = f"let tables {sorted(fixed)} be placed \"auto\" (they are yours, never moved), " if fixed else ""
            raise ValueError(
                f"No placement fits memory_budget={memory_budget} bytes per device: the plan needs {need} "
                f"({', '.join(f'{t}: {p}' for t, p in sorted(chosen.items()))}). Give more devices, a larger "
                f"budget or smaller tables, {free}or keep the largest on disk (offload_to=<directory>, "
                "docs/offload.md).")
        moved.update(dict.fromkeys(group_of.get(move[0], [move[0]]), move[1]))


def _fixed_placements(tables: dict[str, TableSpec], placement: Any) -> dict[str, str]:
    """The placements the caller fixed: `{table: placement}` (the rest are chosen by the cost model)."""
    names = placements.names()
    raw = {n: placements.DEFAULT for n, t in tables.items() if t.dynamic or t.storage}
    if isinstance(placement, str):
        if placement != placements.AUTO and placement not in names:
            raise ValueError(f"placement must be one of {(*names, placements.AUTO)} or {{table: placement}}, "
                             f"got {placement!r}.")
        fixed = {} if placement == placements.AUTO else dict.fromkeys(tables, placement)
        fixed.update(raw)  # raw ids and tiered tables: always the default placement
        for n, p in fixed.items():
            _check_placement(tables[n], p)
        return fixed
    if not isinstance(placement, Mapping):
        raise TypeError(f"placement must be a string or a {{table: placement}} mapping, got {type(placement).__name__}.")
    unknown = sorted(set(placement) - set(tables))
    if unknown:
        raise ValueError(f"placement names tables {unknown}, which no feature reads; tables are {sorted(tables)}.")
    for n, p in placement.items():
        if p not in names:
            raise ValueError(f"Table {n!r}: placement must be one of {names}, got {p!r}.")
        _check_placement(tables[n], p)
    return {**raw, **placement}


def _check_placement(t: TableSpec, placement: str) -> None:
    """Raises a ValueError naming the table if it cannot have this placement."""
    if t.storage and placement != placements.DEFAULT:
        raise ValueError(f"Table {t.name!r} is offloaded (storage=...): its cache is placed by rows "
                         f"({placements.DEFAULT!r}); got {placement!r}.")
    if t.dynamic and not placements.get(placement).raw_ids:
        which = " or ".join(f'"{n}"' for n in placements.raw_id_names())
        raise ValueError(f"Table {t.name!r} is keyed by raw ids (dynamic=...), which only the {which} placement "
                         f"supports; got {placement!r}.")


def _ids_per_sample(feats: dict[str, FeatureSpec], tables: dict[str, TableSpec], given: Any, stats: Any
                    ) -> dict[str, float]:
    """Each feature's ids per sample for the cost model: given, else observed in `stats`, else 1."""
    out = dict.fromkeys(feats, 1.0)
    if stats is not None and not isinstance(stats, Stats):
        raise TypeError(f"stats must be the Stats that preprocess returns (merged with Stats.merge), got "
                        f"{type(stats).__name__}; per feature numbers go in ids_per_sample=.")
    for stack_name, total in (stats.num_ids.items() if stats is not None else ()):
        mine = _stack_tables(stack_name, sorted(tables))
        if mine is None:
            warnings.warn(f"plan(stats=): the stats' stack {stack_name!r} is not made of tables of these features "
                          "(stats of another model?); its traffic is left out of the cost model.", stacklevel=3)
            continue
        users = [f for f in feats.values() if f.table.name in mine]
        # a batch's ids of the stack over the global samples of its features (whatever placement the stats'
        # plan had: its partitions hold a device's ids over D shards under "row", in one elsewhere)
        for f in users:
            out[f.name] = max(1.0, total / max(stats.batches, 1) / sum(u.batch_size for u in users))
    if isinstance(given, Mapping):
        unknown = sorted(set(given) - set(feats))
        if unknown:
            raise ValueError(f"ids_per_sample names unknown features {unknown}; features are {sorted(feats)}.")
        out.update(given)
    elif given is not None:
        out = dict.fromkeys(feats, given)
    for name, v in out.items():
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not 0 < v < math.inf:
            raise ValueError(f"Feature {name!r}: ids_per_sample must be a positive number, got {v!r}.")
    return {k: float(v) for k, v in out.items()}


def _stack_tables(stack_name: str, names: list[str], start: int = 0, after: str = "") -> list[str] | None:
    """The tables (of sorted `names`) that, sorted and joined with "_", make `stack_name[start:]`, or None. A
    table named as the whole stack is that stack (tables "a", "b" and "a_b": stack "a_b" is the table)."""
    if start == 0 and stack_name in names:
        return [stack_name]
    for t in names:
        end = start + len(t)
        if t > after and stack_name.startswith(t, start) and (end == len(stack_name) or stack_name[end] == "_"):
            rest = [] if end == len(stack_name) else _stack_tables(stack_name, names, end + 1, t)
            if rest is not None:
                return [t, *rest]
    return None


def _stacks(tables, feats, chosen, stacking, num_shards, capacity, loads, sparsecores) -> tuple[StackPlan, ...]:
    """The stacks of one choice of placements (those that balance tables over the devices share `device_load`)."""
    groups = _group_tables(tables, stacking, chosen)
    names = ["_".join(g) for g in groups]
    if len(set(names)) != len(names):
        raise ValueError(f"Stack names collide: {names}; rename tables or pass stacking explicitly.")
    caps = _capacities(names, capacity)
    device_load = [0.0] * num_shards  # bytes of tables already on each device (placements that balance them)

    def cores(group):  # the stack's SparseCores (0 if they cannot run it: `plan` warns)
        rows = {f.name: f.batch_size // num_shards * max(f.max_sequence_length, 1)
                for f in feats.values() if f.table.name in group}
        return sparsecore_layout.resolve([tables[n] for n in group], chosen[group[0]], sparsecores, rows, num_shards)

    return tuple(_stack_plan(name, [tables[n] for n in group], feats, num_shards, caps[name], chosen[group[0]],
                             loads, device_load, cores(group))
                 for name, group in zip(names, groups))


def _capacities(names: list[str], capacity: int | Mapping[str, int] | None) -> dict[str, int | None]:
    """Each stack's explicit capacity (None = auto)."""
    if isinstance(capacity, Mapping):
        unknown = set(capacity) - set(names)
        if unknown:
            raise ValueError(f"capacity names unknown stacks {sorted(unknown)}; stacks are {names}.")
        return {n: _check_capacity(f"Stack {n!r}", capacity[n]) if n in capacity else None for n in names}
    if capacity is None:
        return dict.fromkeys(names)
    return dict.fromkeys(names, _check_capacity("plan()", capacity))


def _stack_plan(name: str, tables: list[TableSpec], feats: dict[str, FeatureSpec], num_shards: int,
                capacity: int | None, placement: str, loads: dict, device_load: list, sparsecores: int = 0
                ) -> StackPlan:
    """The tables where their placement puts them (`Placement.assign`), the features that read them, by name.

    SparseCores (jax-tpu-embedding's layout): each device's output rows are
    one slice per SparseCore, each holding its share of every feature.
    """
    where, shard_rows = placements.get(placement).assign(tables, loads, device_load, num_shards, sparsecores)
    placed = {t.name: TablePlacement(t, w.row_offset, w.padded_rows, w.shard, loads[t.name].ids, w.rotation)
              for t, w in zip(tables, where)}
    layouts, row, partial = [], 0, [0] * num_shards
    for fname in sorted(feats):
        f = feats[fname]
        if f.table.name in placed:
            p = placed[f.table.name]
            lay = FeatureLayout(f, p.row_offset, row, f.batch_size // num_shards, p.shard,
                                None if p.shard is None else partial[p.shard], p.rotation)
            layouts.append(lay)
            row += lay.rows_per_device // max(sparsecores, 1)
            if p.shard is not None:
                partial[p.shard] += lay.rows_per_device
    if sparsecores:
        layouts = [dataclasses.replace(lay, slices=sparsecores, slice_rows=row) for lay in layouts]
    return StackPlan(name, tuple(placed.values()), tuple(layouts), num_shards, capacity, placement, shard_rows,
                     sparsecores)


def grow_capacity(plan: EmbeddingPlan, stats, *, headroom: float = 1.0) -> EmbeddingPlan:
    """A new plan whose explicit capacities fit what `stats` observed.

    Each stack's capacity becomes the larger of its current one (explicit,
    or the one `stats` saw it built with) and
    `headroom * stats.max_ids_per_partition[stack]` (rounded up to a multiple
    of 8). Stacks not in `stats` keep their capacity.
    """
    if not isinstance(stats, Stats):
        raise TypeError(f"grow_capacity: stats must be the Stats that preprocess returns, got {type(stats).__name__}.")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float, np.integer, np.floating)) or not (
            1.0 <= headroom < math.inf):
        raise ValueError(f"headroom must be a finite number >= 1, got {headroom!r}.")
    other = [s.name for s in plan.stacks if stats.layouts.get(s.name, s.batch_layout.digest) != s.batch_layout.digest]
    if other:
        raise ValueError(f"grow_capacity: the stats of stacks {other} were measured under another plan's layout "
                         "(placement, shards or tables), so their counts do not size this plan's capacities: "
                         "preprocess a batch with this plan and grow from its stats.")
    stacks = []
    for s in plan.stacks:
        seen = stats.max_ids_per_partition.get(s.name)
        current = s.capacity if s.capacity is not None else stats.capacity.get(s.name)
        if seen is None:
            stacks.append(s)
            continue
        want = round_up(max(1, math.ceil(seen * headroom)), CAPACITY_ALIGNMENT)
        stacks.append(dataclasses.replace(s, capacity=max(want, current or 0)))
    return dataclasses.replace(plan, stacks=tuple(stacks))
