"""Storage and serving: Orbax checkpoints, conversion, serving exports and the single-device serving lookup.

Imports `sparse_embed.core` and `sparse_embed.host`.
"""
