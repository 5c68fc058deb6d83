"""Input pipelines that resume exactly, and a reader of Criteo click logs (docs/data.md).

- `Loader(plan, dataset, inputs=..., state=...)`: `preprocess` over a grain
  dataset, a few batches ahead of the loop, with `get_state()` for
  `CheckpointManager.save(..., data=)`; `Preprocess`: `preprocess` as a
  grain map transform;
- `CriteoSource(paths, batch_size, vocabulary=...)`: Criteo-format files
  (plain or gzip) as a grain random-access source of `CriteoBatch`es
  (this process's rows of each batch); `criteo_ids(batch)` its ids for
  `preprocess`; `CriteoFiles`: the files as chunks of examples;
  `parse_lines`: a block of lines in numpy; `hash_ids`: raw ids to rows of
  a static table; `MISSING_ID`: a missing categorical value's raw id.

Implemented in `sparse_embed.host` (`grain_input`, `criteo`, `criteo_files`, `criteo_source`); loaded on first
use (grain only then).
"""

from sparse_embed import _lazy

__all__ = [
    "CriteoBatch",
    "CriteoFiles",
    "CriteoSource",
    "Loader",
    "MISSING_ID",
    "Preprocess",
    "criteo_ids",
    "hash_ids",
    "parse_lines",
]

__getattr__, __dir__ = _lazy.attach(__name__, {
    "sparse_embed.host.criteo": ("MISSING_ID", "hash_ids", "parse_lines"),
    "sparse_embed.host.criteo_files": ("CriteoFiles",),
    "sparse_embed.host.criteo_source": ("CriteoBatch", "CriteoSource", "criteo_ids"),
    "sparse_embed.host.grain_input": ("Loader", "Preprocess"),
})
