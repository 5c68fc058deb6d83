"""Several processes (`jax.distributed`): which rows each process feeds to `preprocess`.

See `sparse_embed.host.distributed` and docs/distributed.md.
"""

from sparse_embed.host.distributed import local_positions, process_rows, process_slice

__all__ = ["local_positions", "process_rows", "process_slice"]
