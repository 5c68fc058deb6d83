"""Adapters to other libraries: optax, Flax linen and nnx, LayoutMap shardings, jax-tpu-embedding's layout.

They add no logic of their own; they import the layers below.
"""
