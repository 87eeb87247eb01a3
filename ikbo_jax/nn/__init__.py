"""Flax NNX modules built on the IKBO ops."""

from ikbo_jax.nn.linear_compression import LinearCompression
from ikbo_jax.nn.target_attention import TargetAttention

__all__ = ["LinearCompression", "TargetAttention"]
