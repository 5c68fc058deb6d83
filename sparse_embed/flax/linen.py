"""`Embed`, a Flax linen module over `init_tables` + `lookup`, and `TrainState` for params that hold its
tables (see `sparse_embed.integrations.flax_linen`)."""

from sparse_embed.integrations.flax_linen import Embed, TrainState

__all__ = ["Embed", "TrainState"]
