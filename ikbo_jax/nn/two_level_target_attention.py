"""`TwoLevelTargetAttention`: items attend to their user's and their group's histories."""

from __future__ import annotations

import jax

from ikbo_jax.nn.target_attention import TargetAttention
from ikbo_jax.ops.two_level_target_attention import two_level_target_attention
from ikbo_jax.two_level_index import TwoLevelIndex


class TwoLevelTargetAttention(TargetAttention):
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
    **kwargs: `TargetAttention`'s keywords (`dtype`, `param_dtype`, `kernel_init`,
      `bias_init`, `use_bias`, `implementation` (here passed to
      `ikbo_jax.two_level_target_attention`), `interpret`, `rngs`).

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
               qkv_features: int | None = None, out_features: int | None = None, **kwargs):
    # `TargetAttention`'s projections: its user side projects both histories.
    super().__init__(num_heads, history_features, item_features, qkv_features, out_features,
                     **kwargs)

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
