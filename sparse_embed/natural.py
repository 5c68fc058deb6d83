"""The natural (mesh-independent) layout of a table, and on-device conversion to/from stacks.

A table's *natural block* array is `[stored_rows, width]` in id order
(row `i` is id `i`), rows `>= vocabulary_size` zero, with
`stored_rows = vocabulary_size` rounded up to a multiple of `S * S` and
sharded `P(axis, None)` over the S devices: device `d` holds ids
`[d * stored_rows / S, (d + 1) * stored_rows / S)`. This is what checkpoints
store (one array per table and per slot), so a checkpoint means the same on
any mesh.

The conversion between a stack (MOD rows: shard `b`, local row `j` is id
`j * S + b`) and the natural blocks is one `all_to_all` per array under
`shard_map`: every device only ever holds its own block and its own shard,
never a whole table.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sparse_embed.planning import EmbeddingPlan, StackPlan
from sparse_embed.tables import SLOT_DTYPE, EmbeddingVariables, _natural_table, blocks_to_mod

TABLE_KEY = "table"  # the table's own entry among {"table": ..., slot_name: ...}


def stored_rows(vocabulary_size: int, num_shards: int) -> int:
    """Rows of the natural block array of a table on `num_shards` devices."""
    m = num_shards * num_shards
    return -(-vocabulary_size // m) * m


def _mod_to_blocks(stack: StackPlan, local: jax.Array, axis: str) -> list[jax.Array]:
    """Inside shard_map: this shard's MOD rows `[rps, w]` -> each table's natural block `[n*S, w]`."""
    S = stack.num_shards
    out = []
    for p in stack.tables:
        n = stored_rows(p.table.vocabulary_size, S) // (S * S)
        x = local[p.row_offset // S : (p.row_offset + p.padded_rows) // S]
        x = jnp.pad(x, ((0, S * n - x.shape[0]), (0, 0)))
        x = jax.lax.all_to_all(x.reshape(S, n, -1), axis, 0, 0, tiled=True)  # [S(b), n(a), w]
        x = x.reshape(S, n, -1).transpose(1, 0, 2).reshape(n * S, -1)  # id d*n*S + a*S + b
        block = jax.lax.axis_index(axis) * n * S + jnp.arange(n * S)
        out.append(jnp.where((block < p.table.vocabulary_size)[:, None], x, jnp.zeros((), x.dtype)))
    return out


def to_natural(plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables]) -> dict[str, dict[str, jax.Array]]:
    """Stacked state -> `{table: {"table": [stored_rows, dim], slot: [stored_rows, width]}}`, sharded.

    One jit; the results are new arrays (the caller may donate `tables` after).
    """
    axis, sharding = plan.axis_name, plan.table_sharding()

    def convert(state):
        out = {}
        for s in plan.stacks:
            arrays = {TABLE_KEY: state[s.name].table, **state[s.name].slots}
            for key, a in arrays.items():
                fn = jax.shard_map(
                    lambda x, s=s: tuple(_mod_to_blocks(s, x, axis)), mesh=plan.mesh,
                    in_specs=P(axis, None), out_specs=P(axis, None),
                )
                for p, block in zip(s.tables, fn(a)):
                    out.setdefault(p.table.name, {})[key] = block
        return out

    return jax.jit(convert, out_shardings=sharding)(dict(tables))


def from_natural(
    plan: EmbeddingPlan,
    natural: Mapping[str, Mapping[str, jax.Array]],
    valid_rows: Mapping[str, int],
    rng: jax.Array | None = None,
) -> dict[str, EmbeddingVariables]:
    """Natural blocks (sharded as `plan.table_sharding()`, `[stored_rows(vocab, S), w]`) -> stacked state.

    Rows of table `t` with id `>= valid_rows[t]` (rows a smaller, older
    vocabulary did not have) get the table's initializer (from `rng`, the
    same values `init_tables(plan, rng)` gives) and the slots' initial
    values.
    """
    axis, sharding = plan.axis_name, plan.table_sharding()
    grows = any(valid_rows[t] < spec.vocabulary_size for t, spec in plan.tables.items())
    if grows and rng is None:
        raise ValueError("Restoring a larger vocabulary needs rng= to initialise the new rows.")

    def fill(s: StackPlan, i: int, key: str, x: jax.Array, rng) -> jax.Array:
        """Rows `< valid`: restored; `[valid, vocab)`: initial values; past the vocabulary: padding."""
        t, valid = s.tables[i].table, valid_rows[s.tables[i].table.name]
        ids = jnp.arange(x.shape[0])[:, None]
        if key == TABLE_KEY:  # the initializer pads past the vocabulary with zeros
            init = _natural_table(plan, s, rng, i).astype(x.dtype) if valid < t.vocabulary_size else jnp.zeros((), x.dtype)
        else:  # slot padding holds the initial value, as in init_tables
            x, init = x.astype(SLOT_DTYPE), jnp.asarray(s.optimizer.slots(s.embedding_dim)[key].init, SLOT_DTYPE)
        return jnp.where(ids < valid, x, init)

    def convert(natural, rng):
        out = {}
        for s in plan.stacks:
            keys = [TABLE_KEY, *s.optimizer.slots(s.embedding_dim)]
            keys = [k for k in keys if k in natural[s.tables[0].table.name]]
            arrays = {}
            for key in keys:
                blocks = [fill(s, i, key, natural[p.table.name][key], rng) for i, p in enumerate(s.tables)]
                fn = jax.shard_map(
                    lambda *b, s=s: blocks_to_mod(s, list(b), axis), mesh=plan.mesh,
                    in_specs=P(axis, None), out_specs=P(axis, None),
                )
                arrays[key] = fn(*blocks)
            if TABLE_KEY in arrays:
                arrays[TABLE_KEY] = arrays[TABLE_KEY].astype(s.dtype)
            slots = {k: v.astype(SLOT_DTYPE) for k, v in arrays.items() if k != TABLE_KEY}
            out[s.name] = EmbeddingVariables(arrays[TABLE_KEY], slots)
        return out

    return jax.jit(convert, out_shardings=sharding)(dict(natural), rng)
