"""The pure-JAX core: specs, optimizers, the plan, table state and its layouts, the batch contract, the lookup.

Imports nothing outside `sparse_embed.core`. The per-shard work of the
lookup sits behind `core.kernels` (one interface, several implementations).
"""
