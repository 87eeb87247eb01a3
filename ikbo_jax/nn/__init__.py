"""Flax NNX modules built on the IKBO ops."""

from ikbo_jax.nn.linear_compression import LinearCompression

__all__ = ["LinearCompression"]
