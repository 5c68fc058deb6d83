"""Raw-id tables beyond the daily `Dynamic` / `init_id_maps` / `map_ids`: their map state and natural form.

- `IdMap`, `IdMapStats`: what `init_id_maps` builds and `map_ids` counts;
- `RawIdBatch`: a raw-id stack's batch from `preprocess` (before
  `map_ids`), and `MappedIdBatch`: `map_ids`' batch of rows for a table
  with a `Dynamic.default` (without one it is a `ShardedCooMatrix`);
- `id_table_contents(plan, tables, id_maps)` -> `{table: IdTable}` (live ids
  sorted, vectors, slots, last use), independent of the mesh, and
  `load_id_tables(plan, contents)`, which places it onto any plan.

See docs/raw_ids.md. Implemented in `sparse_embed.core.id_maps`, `sparse_embed.core.batch` and
`sparse_embed.io.id_tables`; loaded on first use.
"""

from sparse_embed import _lazy

__all__ = ["IdMap", "IdMapStats", "IdTable", "MappedIdBatch", "RawIdBatch", "id_table_contents", "load_id_tables"]

__getattr__, __dir__ = _lazy.attach(__name__, {
    "sparse_embed.core.batch": ("MappedIdBatch", "RawIdBatch"),
    "sparse_embed.core.id_maps": ("IdMap", "IdMapStats"),
    "sparse_embed.io.id_tables": ("IdTable", "id_table_contents", "load_id_tables"),
})
