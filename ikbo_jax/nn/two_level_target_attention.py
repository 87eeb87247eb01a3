"""`TwoLevelTargetAttention`: items attend to their user's and their group's histories."""

from __future__ import annotations

import jax
from flax import nnx
from flax.nnx.nn import initializers

from ikbo_jax.nn._projections import default_kernel_init, head_projections
from ikbo_jax.ops.target_attention import Implementation
from ikbo_jax.ops.two_level_target_attention import two_level_target_attention
from ikbo_jax.two_level_index import TwoLevelIndex


class TwoLevelTargetAttention(nnx.Module):
  """Multi-head target attention over two histories, each projected once at its own batch.

  The key and value projections run at batch U on each user's behaviour sequence and at
  batch G on each group's (a campaign's recent engagements, say), with the same weights;
  the query projection runs at batch B on the items' query tokens; one softmax covers
  both histories (`ikbo_jax.two_level_target_attention`). With the same weights this equals
  `nnx.MultiHeadAttention` of the item tokens over the user's sequence and the group's,
  concatenated and copied to every item.

  Args:
    num_heads: number of attention heads.
    history_features: feature size of both histories (keys and values).
    item_features: feature size of the item tokens (queries; default `history_features`).
    qkv_features: total query/key/value size over all heads (default `history_features`).
    out_features: output feature size (default `item_features`).
    dtype, param_dtype, kernel_init, bias_init, use_bias: as for `TargetAttention`.
    implementation: passed to `ikbo_jax.two_level_target_attention`.
    interpret: run a kernel implementation under the Pallas interpreter.
    rngs: random number generators.

  Example:

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from ikbo_jax import TwoLevelIndex
  >>> from ikbo_jax.nn import TwoLevelTargetAttention
  >>> attn = TwoLevelTargetAttention(num_heads=2, history_features=8, rngs=nnx.Rngs(0))
  >>> index = TwoLevelIndex.from_mappings([0, 1, 1], group_to_user=[0, 0], num_users=1)
  >>> user_seq, group_seq = jnp.ones((1, 10, 8)), jnp.ones((2, 4, 8))
  >>> attn(user_seq, group_seq, jnp.ones((3, 5, 8)), index).shape
  (3, 5, 8)
  """

  def __init__(self, num_heads: int, history_features: int, item_features: int | None = None,
               qkv_features: int | None = None, out_features: int | None = None, *,
               dtype=None, param_dtype=jax.numpy.float32,
               kernel_init: nnx.Initializer = default_kernel_init,
               bias_init: nnx.Initializer = initializers.zeros_init(), use_bias: bool = True,
               implementation: Implementation | None = None, interpret: bool = False,
               rngs: nnx.Rngs):
    item_features = history_features if item_features is None else item_features
    qkv_features = history_features if qkv_features is None else qkv_features
    self.head_dim, to_heads, from_heads = head_projections(
        num_heads, qkv_features, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
        bias_init=bias_init, use_bias=use_bias, rngs=rngs)
    self.num_heads = num_heads
    self.out_features = item_features if out_features is None else out_features
    self.implementation, self.interpret = implementation, interpret
    self.query = to_heads(item_features)
    self.key = to_heads(history_features)
    self.value = to_heads(history_features)
    self.out = from_heads(self.out_features)

  def __call__(self, user_seq: jax.Array, group_seq: jax.Array, item_tokens: jax.Array,
               index: TwoLevelIndex, *, kv_len_user: jax.Array | None = None,
               kv_len_group: jax.Array | None = None, checked: bool = False) -> jax.Array:
    """`user_seq [U, S_user, F]`, `group_seq [G, S_group, F]`, `item_tokens [B, T, F_item]`
    -> `[B, T, out_features]`."""
    q = self.query(item_tokens)
    k_user, v_user = self.key(user_seq), self.value(user_seq)  # once per user
    k_group, v_group = self.key(group_seq), self.value(group_seq)  # once per group
    attended = two_level_target_attention(
        q, k_user, v_user, k_group, v_group, index, kv_len_user=kv_len_user,
        kv_len_group=kv_len_group, implementation=self.implementation, checked=checked,
        interpret=self.interpret)
    return self.out(attended)
