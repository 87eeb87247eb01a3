"""ikbo_jax: In-Kernel Broadcast Optimization kernels for recommender models in JAX."""

from typing import TYPE_CHECKING

from ikbo_jax import _lazy

__version__ = "0.3.0"
__all__ = ["CandidateIndex", "linear_compression", "self_target_attention", "target_attention"]
__getattr__, __dir__ = _lazy.exports(__name__, {
    "CandidateIndex": "ikbo_jax.index",
    "linear_compression": "ikbo_jax.ops.linear_compression",
    "self_target_attention": "ikbo_jax.ops.self_target_attention",
    "target_attention": "ikbo_jax.ops.target_attention",
})

if TYPE_CHECKING:
  from ikbo_jax.index import CandidateIndex
  from ikbo_jax.ops.linear_compression import linear_compression
  from ikbo_jax.ops.self_target_attention import self_target_attention
  from ikbo_jax.ops.target_attention import target_attention
