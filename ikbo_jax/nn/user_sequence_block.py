"""`UserSequenceBlock`: self-attention over the user sequence and target attention of the candidates."""

from __future__ import annotations

import jax
from flax import nnx
from flax.nnx.nn import initializers

from ikbo_jax.index import CandidateIndex
from ikbo_jax.nn._projections import default_kernel_init, head_projections
from ikbo_jax.ops.self_target_attention import Implementation, self_target_attention


class UserSequenceBlock(nnx.Module):
  """The attention of a user-sequence encoder whose candidates read the same keys and values.

  One key and one value projection run at batch U on the user sequence and
  serve both query kinds: the user sequence's own queries (self-attention,
  updating the sequence) and the candidates' query tokens (target attention,
  producing the candidate representation). Both attentions run in one fused
  op (`ikbo_jax.self_target_attention`), which on a Hopper GPU is one kernel
  launch. With the same weights this equals two `nnx.MultiHeadAttention`
  calls that share their key/value projections: one on the user sequence, one
  on the candidates with the user sequence copied to every candidate, without
  the copy or the U-to-B projections. Residuals and normalization are left to
  the model around it.

  Args:
    num_heads: number of attention heads.
    user_features: feature size of the user sequence.
    cand_features: feature size of the candidate tokens (default `user_features`).
    qkv_features: total query/key/value size over all heads (default
      `user_features`); must divide by `num_heads`.
    out_features: output feature size of both outputs (default `user_features`).
    causal: user position `s` attends to positions `<= s` only.
    dtype: computation dtype (default: inferred from the inputs).
    param_dtype: parameter dtype.
    kernel_init: initializer of the projection kernels.
    bias_init: initializer of the projection biases.
    use_bias: whether the projections have biases.
    implementation: passed to `ikbo_jax.self_target_attention`.
    interpret: run the kernel implementation under the Pallas interpreter.
    rngs: random number generators.

  Example:

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from ikbo_jax import CandidateIndex
  >>> from ikbo_jax.nn import UserSequenceBlock
  >>> block = UserSequenceBlock(num_heads=2, user_features=8, causal=True, rngs=nnx.Rngs(0))
  >>> index = CandidateIndex.from_counts([2, 1])
  >>> user_seq = jnp.ones((2, 10, 8))           # [U, S, user_features]
  >>> cand_tokens = jnp.ones((3, 4, 8))         # [B, n_seed, cand_features]
  >>> new_seq, cand_repr = block(user_seq, cand_tokens, index, kv_len=jnp.array([10, 6]))
  >>> new_seq.shape, cand_repr.shape
  ((2, 10, 8), (3, 4, 8))
  """

  def __init__(self, num_heads: int, user_features: int, cand_features: int | None = None,
               qkv_features: int | None = None, out_features: int | None = None, *,
               causal: bool = False, dtype=None, param_dtype=jax.numpy.float32,
               kernel_init: nnx.Initializer = default_kernel_init,
               bias_init: nnx.Initializer = initializers.zeros_init(), use_bias: bool = True,
               implementation: Implementation | None = None, interpret: bool = False,
               rngs: nnx.Rngs):
    qkv_features = user_features if qkv_features is None else qkv_features
    self.head_dim, to_heads, from_heads = head_projections(
        num_heads, qkv_features, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
        bias_init=bias_init, use_bias=use_bias, rngs=rngs)
    self.num_heads = num_heads
    self.user_features, self.qkv_features = user_features, qkv_features
    self.out_features = user_features if out_features is None else out_features
    self.cand_features = user_features if cand_features is None else cand_features
    self.causal, self.implementation, self.interpret = causal, implementation, interpret
    self.user_query = to_heads(user_features)
    self.cand_query = to_heads(self.cand_features)
    self.key = to_heads(user_features)
    self.value = to_heads(user_features)
    self.user_out = from_heads(self.out_features)
    self.cand_out = from_heads(self.out_features)

  def __call__(self, user_seq: jax.Array, cand_tokens: jax.Array, index: CandidateIndex, *,
               kv_len: jax.Array | None = None,
               checked: bool = False) -> tuple[jax.Array, jax.Array]:
    """`user_seq [U, S, user_features]`, `cand_tokens [B, T, cand_features]` -> `([U, S, out], [B, T, out])`.

    Positions of `user_seq` at or past `kv_len[u]` are padding: they are
    neither attended to nor attend, and their attention output is zero (the
    output projection then adds only its bias).
    """
    k, v = self.key(user_seq), self.value(user_seq)  # at batch U: once per user
    out_user, out_cand = self_target_attention(
        self.user_query(user_seq), self.cand_query(cand_tokens), k, v, index, kv_len=kv_len,
        causal=self.causal, implementation=self.implementation, checked=checked,
        interpret=self.interpret)
    return self.user_out(out_user), self.cand_out(out_cand)
