"""Host-side (numpy / C) work: id formats, preprocessing into `ShardedCooMatrix` batches, prefetch, several hosts.

Imports `sparse_embed.core` and nothing above it.
"""
