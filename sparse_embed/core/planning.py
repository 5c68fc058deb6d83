"""Planning: specs + mesh -> a static, hashable `EmbeddingPlan`.

The plan decides which tables share one stacked array, where each table's
rows live inside it, how rows are assigned to shards and how the samples of
the features that read a stack are laid out on each device. It is a static
argument of `jit` and an immutable value: nothing in it depends on data. (An
auto capacity's high-water mark is host state, kept by `preprocess`; the
capacity a batch was built with travels in the batch's array shapes.)

Row layout (MOD sharding): with S shards, stack row `r` lives on shard
`r % S` at local row `r // S`. Every table's padded size is a multiple of S,
so table rows `[0, vocabulary_size)` map to stack rows `[row_offset,
row_offset + vocabulary_size)` and shard `id % S` (for any table in a stack).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sparse_embed.core.specs import FeatureSpec, TableSpec

OVERFLOW_POLICIES = ("error", "drop")
KERNELS = ("auto", "generic", "native")  # implementations of the lookup's per-shard work (`core.kernels`)
KERNEL_ENV = "SPARSE_EMBED_KERNEL"  # overrides kernel="auto" when a plan is made
NONFINITE_POLICIES = ("skip", "apply")
CAPACITY_ALIGNMENT = 8


@dataclasses.dataclass(frozen=True)
class TablePlacement:
    """Where a table lives inside its stack."""

    table: TableSpec
    row_offset: int  # stack row of the table's id 0; a multiple of num_shards
    padded_rows: int  # vocabulary_size rounded up to a multiple of num_shards


@dataclasses.dataclass(frozen=True)
class FeatureLayout:
    """Where a feature's samples live among a stack's per-device output rows."""

    feature: FeatureSpec
    table_row_offset: int  # row_offset of the feature's table in the stack
    row_offset: int  # first per-device output row of this feature
    samples_per_device: int  # batch_size // num_devices

    @property
    def rows_per_device(self) -> int:
        """Output rows on each device: one per sample, or per (sample, position)."""
        return self.samples_per_device * max(self.feature.max_sequence_length, 1)


@dataclasses.dataclass(frozen=True)
class StackPlan:
    """One stacked table: `[num_shards * rows_per_shard, embedding_dim]`."""

    name: str
    tables: tuple[TablePlacement, ...]
    features: tuple[FeatureLayout, ...]
    num_shards: int
    capacity: int | None  # COO entries per (device, shard) partition; None = auto

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
        return sum(t.padded_rows for t in self.tables)

    @property
    def rows_per_shard(self) -> int:
        return self.total_rows // self.num_shards

    @property
    def rows_per_device(self) -> int:
        """Output rows of this stack on each device (all its features)."""
        return sum(f.rows_per_device for f in self.features)


@dataclasses.dataclass(frozen=True, repr=False)
class EmbeddingPlan:
    """The static result of `plan()`. Hashable; a static argument of jit."""

    mesh: Mesh
    axis_name: str
    stacks: tuple[StackPlan, ...]
    on_overflow: str
    nonfinite_gradients: str = "skip"
    kernel: Any = "auto"  # the per-shard implementation of the lookup: a name or a kernel (`core.kernels`)

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
            lines.append(f"  stack {s.name!r}: [{s.total_rows}, {s.embedding_dim}] {type(s.optimizer).__name__}, "
                         f"tables {tables}; features {feats}; capacity {s.capacity or 'auto'}{raw}")
        return "\n".join(lines)

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
        return {t.table.name: t.table for s in self.stacks for t in s.tables}

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


def round_up(x: int, m: int) -> int:
    """The smallest multiple of m that is >= x."""
    return -(-x // m) * m


def _stack_key(t: TableSpec) -> tuple:
    """Tables with equal keys can share a stack; a raw-id table's key is its own (it maps its own rows)."""
    return (t.embedding_dim, t.resolved_optimizer, t.combiner, t.max_norm, t.dtype, t.name if t.dynamic else None)


def _describe_incompatibility(a: TableSpec, b: TableSpec) -> str:
    if a.dynamic or b.dynamic:
        return f"table {(a if a.dynamic else b).name!r} is keyed by raw ids (dynamic=...), which is never stacked"
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


def _group_tables(tables: dict[str, TableSpec], stacking: Any) -> list[list[str]]:
    """Table-name groups, each group one stack."""
    if stacking is None:
        return [[n] for n in sorted(tables)]
    if isinstance(stacking, str):
        if stacking != "auto":
            raise ValueError(f"stacking must be 'auto', None or a list of lists of table names, got {stacking!r}.")
        groups: dict[tuple, list[str]] = {}
        for n in sorted(tables):
            groups.setdefault(_stack_key(tables[n]), []).append(n)
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
        groups_out.append(sorted(group))
    groups_out += [[n] for n in sorted(tables) if n not in seen]
    return groups_out


def _resolve_axis(mesh: Mesh, axis_name: str | None) -> str:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if axis_name is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(
                f"The mesh has axes {mesh.axis_names}; pass axis_name= to say which one shards the tables."
            )
        return mesh.axis_names[0]
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}.")
    return axis_name


def _check_policies(on_overflow: str, nonfinite_gradients: str) -> None:
    if on_overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"on_overflow must be one of {OVERFLOW_POLICIES}, got {on_overflow!r}.")
    if nonfinite_gradients not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite_gradients must be one of {NONFINITE_POLICIES}, got {nonfinite_gradients!r}.")


def _check_kernel(kernel: Any) -> Any:
    """A kernel name of KERNELS ("auto" overridden by $SPARSE_EMBED_KERNEL), or a kernel instance."""
    if not isinstance(kernel, str):
        if not all(callable(getattr(kernel, m, None)) for m in ("forward", "backward", "unsupported")):
            raise TypeError(f"kernel must be one of {KERNELS} or a kernel (see sparse_embed.core.kernels), "
                            f"got {kernel!r}.")
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
) -> EmbeddingPlan:
    """Plans the stacked, sharded layout of the tables that `features` read.

    Args:
      features: name -> FeatureSpec (or a sequence of FeatureSpecs).
      mesh: the device mesh; default, a 1-D mesh over all devices (axis "device").
      axis_name: the mesh axis the tables are sharded over and the batch is
        split over; default, the mesh's only axis.
      stacking: "auto" (stack tables with equal dim, optimizer, combiner,
        max_norm and dtype), None (one stack per table), or a list of lists of
        table names (unlisted tables get their own stack). A table keyed by
        raw ids (`dynamic=`) is always a stack of its own.
      capacity: static COO entries per (source device, destination shard)
        partition, an int for all stacks or {stack_name: int}. None (the
        default) sizes each stack from the first batch and grows it (one
        recompile) when a later batch needs more.
      on_overflow: with an explicit capacity, what a batch that needs more
        does: "error" (ValueError) or "drop" (excess ids dropped
        deterministically, the last ones in sample order, counted in Stats).
      nonfinite_gradients: what the backward does with a row whose gradient
        is NaN or inf: "skip" (the row and its slots keep their old values;
        `nonfinite_rows` counts such rows) or "apply" (update it anyway).
      kernel: the implementation of `lookup`'s per-shard work: "auto" (the
        fastest for the platform and optimizer; `$SPARSE_EMBED_KERNEL`
        overrides it), "generic" (jnp, the reference; GPU and TPU), "native"
        (C++, CPU) or a kernel from `sparse_embed.core.kernels`.

    Returns:
      The `EmbeddingPlan`. Stacks are named by their tables' names joined
      with "_" (sorted), or the table's own name.
    """
    feats = _normalise_features(features)
    tables = _collect_tables(feats)
    mesh = Mesh(np.array(jax.devices()), ("device",)) if mesh is None else mesh
    axis = _resolve_axis(mesh, axis_name)
    num_shards = mesh.shape[axis]
    _check_policies(on_overflow, nonfinite_gradients)
    kernel = _check_kernel(kernel)
    for f in feats.values():
        if f.batch_size % num_shards:
            raise ValueError(f"Feature {f.name!r}: batch_size {f.batch_size} does not divide evenly over the "
                             f"{num_shards} devices of mesh axis {axis!r}; use a multiple of {num_shards}.")
    groups = _group_tables(tables, stacking)
    names = ["_".join(g) for g in groups]
    if len(set(names)) != len(names):
        raise ValueError(f"Stack names collide: {names}; rename tables or pass stacking explicitly.")
    caps = _capacities(names, capacity)
    stacks = tuple(_stack_plan(name, [tables[n] for n in group], feats, num_shards, caps[name])
                   for name, group in zip(names, groups))
    return EmbeddingPlan(mesh, axis, stacks, on_overflow, nonfinite_gradients, kernel)


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
                capacity: int | None) -> StackPlan:
    """Tables one after the other (each padded to a multiple of S rows); the features that read them, by name."""
    placements, offset = {}, 0
    for t in tables:
        placements[t.name] = TablePlacement(t, offset, round_up(t.vocabulary_size, num_shards))
        offset += placements[t.name].padded_rows
    layouts, row = [], 0
    for fname in sorted(feats):
        f = feats[fname]
        if f.table.name in placements:
            lay = FeatureLayout(f, placements[f.table.name].row_offset, row, f.batch_size // num_shards)
            layouts.append(lay)
            row += lay.rows_per_device
    return StackPlan(name, tuple(placements.values()), tuple(layouts), num_shards, capacity)


def grow_capacity(plan: EmbeddingPlan, stats, *, headroom: float = 1.0) -> EmbeddingPlan:
    """A new plan whose explicit capacities fit what `stats` observed.

    Each stack's capacity becomes the larger of its current one (explicit,
    or the one `stats` saw it built with) and
    `headroom * stats.max_ids_per_partition[stack]` (rounded up to a multiple
    of 8). Stacks not in `stats` keep their capacity.
    """
    if headroom < 1.0:
        raise ValueError(f"headroom must be >= 1, got {headroom}.")
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
