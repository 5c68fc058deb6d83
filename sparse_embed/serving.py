"""Serving beyond `export_serving` / `load_serving` / `serving_lookup`: quantized tables and live updates.

- `quantize(rows, bits)` / `dequantize(fused, dim)`: the row-wise int8 / int4
  layout that `export_serving(..., dtype="int8" | "int4")` stores (codes,
  then float32 scale and bias per row) and `serving_lookup` reads;
- training side: `Changes.since(export)` starts tracking at a serving export,
  `changes.touched_ids(plan, ids)` adds a step's ids (a new tracker),
  `export_delta(dir, plan, tables, changes)` writes the rows changed since as
  the next delta (`delta_name`), numbered after the export (`export_id`);
  `write_delta` writes one from host rows;
- serving side: `LiveTables(export)` serves `snapshot`s and `apply`s deltas
  (or `catch_up(dir)`) while lookups run; `Snapshot`, `load_snapshot` and
  `apply_delta` are the same as pure functions.

See docs/serving.md. Implemented in `sparse_embed.io.quantize`, `.changes` and `.live`; loaded on first use.
"""

from sparse_embed import _lazy

__all__ = [
    "Changes",
    "LiveTables",
    "Snapshot",
    "apply_delta",
    "delta_name",
    "dequantize",
    "export_delta",
    "export_id",
    "load_snapshot",
    "quantize",
    "write_delta",
]

__getattr__, __dir__ = _lazy.attach(__name__, {
    "sparse_embed.io.changes": ("Changes", "delta_name", "export_delta", "export_id", "write_delta"),
    "sparse_embed.io.live": ("LiveTables", "Snapshot", "apply_delta", "load_snapshot"),
    "sparse_embed.io.quantize": ("dequantize", "quantize"),
})
