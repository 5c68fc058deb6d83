"""Offloaded tables: a table on disk under a device cache of its hot rows (docs/offload.md).

- `Offload(path, cache_rows)`: a `TableSpec`'s `storage=`;
- `Tiers(plan, rng)`: the host side of a plan's offloaded tables: its
  `prefetch`/`preprocess` map ids to cache rows and read the misses ahead,
  `swap` brings a batch's rows into the cache before its step, `flush`
  makes the store hold every row; `TierStats` are its counts, `Swap` one
  batch's swap;
- `CorruptStoreError`: a store row fails its checksum, or the store belongs to another table;
  `StoreInUseError`: a store is open for training already (one `Tiers`, `store_state` or `write_store` at a time);
- `StoreServer(path, cache_bytes)`: serving lookups of one store (read-only) through a bounded RAM cache,
  picking up what a training run commits; `load_parameter_server(config)`: a `ParameterServer` of the stores
  a JSON config names, `lookup(model, table, ids)`; `ServingStats` are their counts.

Implemented in `sparse_embed.core.specs`, `sparse_embed.core.row_swap` and `sparse_embed.tiers`; loaded on
first use.
"""

from sparse_embed import _lazy

__all__ = [
    "CorruptStoreError",
    "Offload",
    "ParameterServer",
    "ServingStats",
    "StoreInUseError",
    "StoreServer",
    "Swap",
    "TierStats",
    "TieredItem",
    "Tiers",
    "load_parameter_server",
    "store_state",
    "write_store",
]

__getattr__, __dir__ = _lazy.attach(__name__, {
    "sparse_embed.core.specs": ("Offload",),
    "sparse_embed.tiers.store": ("CorruptStoreError", "StoreInUseError"),
    "sparse_embed.tiers.tiered": ("Swap", "TierStats", "TieredItem", "Tiers"),
    "sparse_embed.tiers.convert": ("store_state", "write_store"),
    "sparse_embed.tiers.serving": ("ParameterServer", "ServingStats", "StoreServer", "load_parameter_server"),
})
