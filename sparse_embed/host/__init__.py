"""Host-side (numpy / C) work: id formats, preprocessing into batches, prefetch, several hosts.

`preprocessing` builds each stack's COO batch (`core.batch`), and runs a
backend's hook for its stacks (`sparsecore_input`: SparseCore's CSR).

Imports `sparse_embed.core` and nothing above it.
"""
