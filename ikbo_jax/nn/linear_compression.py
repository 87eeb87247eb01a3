"""`LinearCompression`: a Flax NNX layer for Wukong-style linear compression with IKBO."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from ikbo_jax.index import CandidateIndex
from ikbo_jax.nn._projections import default_kernel_init
from ikbo_jax.ops.linear_compression import Implementation, linear_compression


class LinearCompression(nnx.Module):
  """Compresses a stack of user and candidate embeddings with one shared weight.

  Equivalent to `W @ concat(e_user[cand_to_user[b]], e_cand[b])` along the
  stacking axis, with `W = concat(w_user, w_cand)`, but the user half runs once
  per user and is added inside the kernel by index: the user embeddings are never
  copied to the candidate batch.

  Args:
    user_features: K_user, the number of user embeddings stacked per request.
    cand_features: K_cand, the number of candidate embeddings stacked per candidate.
    out_features: M, the number of compressed embeddings.
    dtype: computation dtype (default: inferred from the inputs).
    param_dtype: parameter dtype.
    kernel_init: initializer of the joint weight, called with `nnx.Linear`'s
      shape `[K_user + K_cand, M]` (fan-in first); stored transposed and split
      into `w_user [M, K_user]` and `w_cand [M, K_cand]`.
    implementation: passed to `ikbo_jax.linear_compression`.
    interpret: run a kernel implementation under the Pallas interpreter.
    rngs: random number generators.

  Example:

  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> from ikbo_jax import CandidateIndex
  >>> from ikbo_jax.nn import LinearCompression
  >>> layer = LinearCompression(6, 5, 4, rngs=nnx.Rngs(0))
  >>> index = CandidateIndex.from_counts([2, 1])
  >>> e_user = jnp.ones((2, 6, 8))            # [U, K_user, N]
  >>> e_cand = jnp.ones((3, 5, 8))            # [B, K_cand, N]
  >>> layer(e_user, e_cand, index).shape       # [B, M, N]
  (3, 4, 8)
  """

  def __init__(self, user_features: int, cand_features: int, out_features: int, *,
               dtype=None, param_dtype=jnp.float32,
               kernel_init: nnx.Initializer = default_kernel_init,
               implementation: Implementation | None = None, interpret: bool = False,
               rngs: nnx.Rngs):
    # One init over the joint weight in `nnx.Linear`'s `[in, out]` layout (the
    # initializer takes fan-in from the second-to-last axis), then split and
    # stored `[out, in]` as the op takes it: the scale of `nnx.Linear(K_user +
    # K_cand -> M)` over the concatenated stack.
    w = kernel_init(rngs.params(), (user_features + cand_features, out_features), param_dtype).T
    self.w_user = nnx.Param(w[:, :user_features])
    self.w_cand = nnx.Param(w[:, user_features:])
    self.user_features, self.cand_features = user_features, cand_features
    self.out_features = out_features
    self.dtype, self.param_dtype = dtype, param_dtype
    self.implementation, self.interpret = implementation, interpret

  def __call__(self, e_user: jax.Array, e_cand: jax.Array, index: CandidateIndex, *,
               checked: bool = False) -> jax.Array:
    """`e_user [U, K_user, N]`, `e_cand [B, K_cand, N]` -> `[B, out_features, N]`."""
    w_user, w_cand, e_user, e_cand = dtypes.promote_dtype(
        (self.w_user[...], self.w_cand[...], e_user, e_cand), dtype=self.dtype)
    return linear_compression(w_user, w_cand, e_user, e_cand, index,
                              implementation=self.implementation, checked=checked,
                              interpret=self.interpret)
