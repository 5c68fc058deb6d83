"""`Embed`, a Flax linen module over `init_tables` + `lookup` (see `sparse_embed.integrations.flax_linen`)."""

from sparse_embed.integrations.flax_linen import Embed

__all__ = ["Embed"]
