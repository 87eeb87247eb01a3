"""ikbo_jax: In-Kernel Broadcast Optimization kernels for recommender models in JAX."""

from typing import TYPE_CHECKING

from ikbo_jax import _lazy

__version__ = "0.3.0"
__all__ = ["CandidateIndex", "TwoLevelIndex", "linear_compression", "self_target_attention",
           "target_attention", "two_level_linear_compression", "two_level_target_attention"]
__getattr__, __dir__ = _lazy.exports(__name__, {
    "CandidateIndex": "ikbo_jax.index",
    "TwoLevelIndex": "ikbo_jax.two_level_index",
    "linear_compression": "ikbo_jax.ops.linear_compression",
    "self_target_attention": "ikbo_jax.ops.self_target_attention",
    "target_attention": "ikbo_jax.ops.target_attention",
    "two_level_linear_compression": "ikbo_jax.ops.two_level_linear_compression",
    "two_level_target_attention": "ikbo_jax.ops.two_level_target_attention",
})

if TYPE_CHECKING:
  from ikbo_jax.index import CandidateIndex
  from ikbo_jax.ops.linear_compression import linear_compression
  from ikbo_jax.ops.self_target_attention import self_target_attention
  from ikbo_jax.ops.target_attention import target_attention
  from ikbo_jax.ops.two_level_linear_compression import two_level_linear_compression
  from ikbo_jax.ops.two_level_target_attention import two_level_target_attention
  from ikbo_jax.two_level_index import TwoLevelIndex
