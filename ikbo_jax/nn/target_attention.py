"""`TargetAttention`: a Flax NNX layer in which candidates attend to their user's history."""

from __future__ import annotations

import jax
from flax import nnx
from flax.nnx.nn import initializers

from ikbo_jax.index import CandidateIndex
from ikbo_jax.nn._projections import default_kernel_init, head_projections
from ikbo_jax.ops.target_attention import Implementation, target_attention


class TargetAttention(nnx.Module):
  """Multi-head target attention with the user side computed once per user.

  The key and value projections run at batch U on each user's behaviour
  sequence; the query projection runs at batch B on the candidates' query
  tokens; the attention reads each user's K/V by index. With the same weights
  this equals `nnx.MultiHeadAttention` applied to the candidate tokens and the
  user sequence copied to every candidate (masked past `kv_len`), without the
  copy or the U-to-B projections.

  Args:
    num_heads: number of attention heads.
    user_features: feature size of the user sequence (keys and values).
    cand_features: feature size of the candidate tokens (queries; default
      `user_features`).
    qkv_features: total query/key/value size over all heads (default
      `user_features`); must divide by `num_heads`.
    out_features: output feature size (default `cand_features`).
    dtype: computation dtype (default: inferred from the inputs).
    param_dtype: parameter dtype.
    kernel_init: initializer of the projection kernels.
    bias_init: initializer of the projection biases.
    use_bias: whether the projections have biases.
    implementation: passed to `ikbo_jax.target_attention`.
    interpret: run a kernel implementation under the Pallas interpreter.
    rngs: random number generators.

  Example:

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from ikbo_jax import CandidateIndex
  >>> from ikbo_jax.nn import TargetAttention
  >>> attn = TargetAttention(num_heads=2, user_features=8, cand_features=6, rngs=nnx.Rngs(0))
  >>> index = CandidateIndex.from_counts([2, 1])
  >>> user_seq = jnp.ones((2, 10, 8))          # [U, S, user_features]
  >>> cand_tokens = jnp.ones((3, 4, 6))        # [B, n_seed, cand_features]
  >>> attn(user_seq, cand_tokens, index, kv_len=jnp.array([10, 6])).shape
  (3, 4, 6)
  """

  def __init__(self, num_heads: int, user_features: int, cand_features: int | None = None,
               qkv_features: int | None = None, out_features: int | None = None, *,
               dtype=None, param_dtype=jax.numpy.float32,
               kernel_init: nnx.Initializer = default_kernel_init,
               bias_init: nnx.Initializer = initializers.zeros_init(), use_bias: bool = True,
               implementation: Implementation | None = None, interpret: bool = False,
               rngs: nnx.Rngs):
    cand_features = user_features if cand_features is None else cand_features
    qkv_features = user_features if qkv_features is None else qkv_features
    self.head_dim, to_heads, from_heads = head_projections(
        num_heads, qkv_features, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
        bias_init=bias_init, use_bias=use_bias, rngs=rngs)
    self.num_heads = num_heads
    self.user_features, self.cand_features = user_features, cand_features
    self.qkv_features = qkv_features
    self.out_features = cand_features if out_features is None else out_features
    self.implementation, self.interpret = implementation, interpret
    self.query = to_heads(cand_features)
    self.key = to_heads(user_features)
    self.value = to_heads(user_features)
    self.out = from_heads(self.out_features)

  def __call__(self, user_seq: jax.Array, cand_tokens: jax.Array, index: CandidateIndex, *,
               kv_len: jax.Array | None = None, checked: bool = False) -> jax.Array:
    """`user_seq [U, S, user_features]`, `cand_tokens [B, T, cand_features]` -> `[B, T, out]`."""
    q = self.query(cand_tokens)
    k, v = self.key(user_seq), self.value(user_seq)  # at batch U: once per user
    attended = target_attention(q, k, v, index, kv_len=kv_len,
                                implementation=self.implementation, checked=checked,
                                interpret=self.interpret)
    return self.out(attended)
