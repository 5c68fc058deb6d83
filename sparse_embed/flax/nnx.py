"""`Embed` and its `Optimizer` for Flax nnx (see `sparse_embed.integrations.flax_nnx`)."""

from sparse_embed.integrations.flax_nnx import DENSE, Embed, EmbeddingSlot, EmbeddingTable, Optimizer

__all__ = ["DENSE", "Embed", "EmbeddingSlot", "EmbeddingTable", "Optimizer"]
