"""Flax NNX modules built on the IKBO ops."""

from ikbo_jax.nn.linear_compression import LinearCompression
from ikbo_jax.nn.target_attention import TargetAttention
from ikbo_jax.nn.two_level_linear_compression import TwoLevelLinearCompression
from ikbo_jax.nn.two_level_target_attention import TwoLevelTargetAttention
from ikbo_jax.nn.user_sequence_block import UserSequenceBlock

__all__ = ["LinearCompression", "TargetAttention", "TwoLevelLinearCompression",
           "TwoLevelTargetAttention", "UserSequenceBlock"]
