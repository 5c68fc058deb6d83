"""Flax adapters: `linen.Embed` and `nnx.Embed` own the stacked tables and call `lookup`.

    from sparse_embed.flax import linen as sel   # or: nnx as sen

They add no logic (see `sparse_embed.integrations.flax_linen` / `flax_nnx`).
"""

from sparse_embed.flax import linen, nnx

__all__ = ["linen", "nnx"]
