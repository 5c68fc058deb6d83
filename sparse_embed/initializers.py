"""Table initializers (see `sparse_embed.core.initializers`): the positional truncated normal every table uses by default."""

from sparse_embed.core.initializers import TruncatedNormal, truncated_normal

__all__ = ["TruncatedNormal", "truncated_normal"]
