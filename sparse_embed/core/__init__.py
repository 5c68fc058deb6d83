"""The pure-JAX core: specs, optimizers, the plan, table state and its layouts, the batch contract, the lookup.

Imports nothing outside `sparse_embed.core`. The per-shard work of the
lookup sits behind `core.kernels` (one interface, several implementations);
a backend with its own kernel and batch format is a package of its own
(`core.sparsecore`, whose preprocessing hook is `host.sparsecore_input`).
"""
