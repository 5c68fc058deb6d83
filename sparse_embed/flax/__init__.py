"""Flax adapters: `linen.Embed` and `nnx.Embed` own the stacked tables and call `lookup`.

    from sparse_embed.flax import linen as se_linen   # or: nnx as se_nnx

They add no logic: the tables are `init_tables(plan, rng)`, the forward is
`lookup(plan, batch, tables, step)`, and the backward returns the updated
tables as their "gradient" (see `sparse_embed.optax_tx` / `apply_updates`
for linen, `sparse_embed.flax.nnx.Optimizer` for nnx).
"""

from sparse_embed.flax import linen, nnx

__all__ = ["linen", "nnx"]
