"""Runnable examples of sparse_embed (`python -m sparse_embed.examples.demo`)."""
