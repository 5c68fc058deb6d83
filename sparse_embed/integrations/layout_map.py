"""Shardings for a whole param or optimizer-state pytree from ordered path rules.

    layout = sparse_embed.LayoutMap(mesh, [
        (r"Dense_\\d+/kernel$", P(None, "model")),
        (r"bias$", P()),
    ], plan=plan)
    shardings = layout.shardings(params)          # same structure, NamedSharding leaves

A leaf's path is its pytree keys joined with "/" (dict keys, attribute
names, sequence indices; the `.value` of a box such as an nnx Variable is
left out), e.g. `Dense_0/kernel` in linen params, `opt_state/0/mu/dense/kernel`
in an nnx optimizer, `inner_states/dense/inner_state/0/mu/Dense_0/kernel` in
`optax_tx` state. The first rule whose regex `re.search`es the path wins
(anchor with `^`/`$` to match whole names); unmatched leaves are replicated.
Embedding state (`EmbeddingVariables` leaves, nnx `EmbeddingTable`
variables) always gets the plan's table sharding, whatever the rules say.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sparse_embed.core.planning import EmbeddingPlan
from sparse_embed.integrations.flax_nnx import EmbeddingTable
from sparse_embed.integrations.optax_utils import is_embedding

Rule = tuple[str, "P | None"]


def _key_name(key: Any) -> str | None:
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return None if key.name == "value" else key.name
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def path_string(path: tuple) -> str:
    """A pytree key path as the "/"-joined string the rules match against."""
    return "/".join(n for n in map(_key_name, path) if n is not None)


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


class LayoutMap:
    """Ordered `(regex, PartitionSpec)` rules -> `NamedSharding`s on `mesh`.

    Args:
      mesh: the mesh dense params and optimizer state are sharded over.
      rules: `(pattern, spec)` pairs, tried in order, or a `{pattern: spec}`
        mapping (in its order, as Keras' `LayoutMap` keys); `spec=None` (or
        `P()`) replicates, and stops later rules from matching.
      plan: the `EmbeddingPlan`; needed when the tree holds embedding state,
        which always gets `plan.table_sharding()` (the layout `lookup` needs).
    """

    def __init__(self, mesh: Mesh, rules: Iterable[Rule] | Mapping[str, P | None] = (), *,
                 plan: EmbeddingPlan | None = None):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"LayoutMap: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
        if plan is not None and list(plan.mesh.devices.flat) != list(mesh.devices.flat):
            # jit needs one device assignment: the meshes' devices in the same order, not only the same set
            which = "order" if set(plan.mesh.devices.flat) == set(mesh.devices.flat) else "set"
            raise ValueError(
                f"LayoutMap: the plan's mesh and `mesh` have a different device {which}; one jit cannot hold both. "
                "Plan over (an axis of) `mesh`: sparse_embed.plan(features, mesh, axis_name=...)."
            )
        self.mesh, self.plan = mesh, plan
        self.rules: list[tuple[re.Pattern, P]] = []
        for i, rule in enumerate(rules.items() if isinstance(rules, Mapping) else rules):
            if not isinstance(rule, (tuple, list)) or len(rule) != 2:
                raise ValueError(f"LayoutMap rule {i}: expected a (regex, PartitionSpec) pair, got {rule!r}.")
            pattern, spec = rule
            try:
                regex = re.compile(pattern)
            except (re.error, TypeError) as e:
                raise ValueError(f"LayoutMap rule {i}: {pattern!r} is not a valid regex: {e}.") from None
            if not isinstance(regex.pattern, str):  # it would fail on every (str) path, with re's TypeError
                raise ValueError(f"LayoutMap rule {i}: {pattern!r} is a bytes regex; paths are str, write "
                                 f"{regex.pattern.decode(errors='replace')!r}.")
            spec = P() if spec is None else spec
            if not isinstance(spec, P):
                raise TypeError(
                    f"LayoutMap rule {i} ({pattern!r}): expected a PartitionSpec or None, got {spec!r}; "
                    "write e.g. jax.sharding.PartitionSpec(None, 'model')."
                )
            if any(e is P.UNCONSTRAINED for e in spec):
                raise ValueError(f"LayoutMap rule {i} ({pattern!r}): {spec} has P.UNCONSTRAINED, which only a "
                                 "sharding constraint inside jit takes; a LayoutMap places arrays: write None for a "
                                 "dimension held whole.")
            unknown = [a for e in spec for a in _axes(e) if a not in mesh.axis_names]
            if unknown:
                raise ValueError(
                    f"LayoutMap rule {i} ({pattern!r}): {spec} names mesh axes {unknown}, "
                    f"but the mesh has axes {mesh.axis_names}."
                )
            self.rules.append((regex, spec))

    def spec_for(self, path: str) -> P | None:
        """The spec of the first rule matching `path`, or None if none does (replicated)."""
        for regex, spec in self.rules:
            if regex.search(path):
                return spec
        return None

    def _dense_sharding(self, path: str, leaf: Any) -> NamedSharding:
        """The `NamedSharding` of one dense leaf (array or ShapeDtypeStruct) at `path`."""
        spec = self.spec_for(path)
        if spec is None:
            return NamedSharding(self.mesh, P())
        shape = tuple(getattr(leaf, "shape", np.shape(leaf)))
        if len(spec) > len(shape):
            raise ValueError(
                f"LayoutMap: {spec} has {len(spec)} entries but the leaf at {path!r} has rank {len(shape)} "
                f"(shape {shape}); fix the rule matching {path!r} or add an earlier, narrower one."
            )
        seen: list[str] = []
        for dim, (size, entry) in enumerate(zip(shape, spec)):
            axes = _axes(entry)
            dup = [a for a in axes if a in seen]
            if dup:
                raise ValueError(f"LayoutMap: {spec} for {path!r} uses mesh axes {dup} twice.")
            seen += axes
            parts = math.prod(self.mesh.shape[a] for a in axes)
            if size % parts:
                raise ValueError(
                    f"LayoutMap: {spec} splits dim {dim} (size {size}) of the leaf at {path!r} (shape {shape}) "
                    f"into {parts} parts, which does not divide it; fix the rule matching {path!r}."
                )
        return NamedSharding(self.mesh, spec)

    def _table_sharding(self, path: str) -> NamedSharding:
        if self.plan is None:
            raise ValueError(f"LayoutMap: {path!r} is embedding state; pass plan= to shard it as lookup needs.")
        return self.plan.table_sharding()

    def shardings(self, tree: Any) -> Any:
        """`tree` (arrays or `jax.ShapeDtypeStruct`s) with a `NamedSharding` at every leaf.

        nnx Variables keep their type, holding their sharding (as
        `nnx.get_named_sharding` returns), so the result fits jit's
        `in_shardings`/`out_shardings` and `jax.device_put`.
        """
        def one(path, node):
            p = path_string(path)
            if is_embedding(node):
                return jax.tree.map(lambda _: self._table_sharding(p), node)
            if isinstance(node, EmbeddingTable):
                return node.replace(self._table_sharding(p))
            if isinstance(node, nnx.Variable):
                return node.replace(self._dense_sharding(p, node.get_value()))
            return self._dense_sharding(p, node)

        is_leaf = lambda x: is_embedding(x) or isinstance(x, nnx.Variable)
        return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_leaf)
