"""`TwoLevelLinearCompression`: linear compression of user, group and item embeddings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from ikbo_jax.nn._projections import default_kernel_init
from ikbo_jax.ops.linear_compression import Implementation
from ikbo_jax.ops.two_level_linear_compression import two_level_linear_compression
from ikbo_jax.two_level_index import TwoLevelIndex


class TwoLevelLinearCompression(nnx.Module):
  """Compresses user, group and item embedding stacks with one shared weight.

  Equivalent to `W @ concat(e_user[user(i)], e_group[group(i)], e_item[i])` along
  the stacking axis, with `W = concat(w_user, w_group, w_item)`, but the user part
  runs once per user and the group part once per group: neither is copied to the
  items (`ikbo_jax.two_level_linear_compression`).

  Args:
    user_features: K_user, the user embeddings stacked per request.
    group_features: K_group, the embeddings stacked per group (ad group, campaign).
    item_features: K_item, the embeddings stacked per item.
    out_features: M, the number of compressed embeddings.
    dtype: computation dtype (default: inferred from the inputs).
    param_dtype: parameter dtype.
    kernel_init: initializer of the joint weight, called with `nnx.Linear`'s shape
      `[K_user + K_group + K_item, M]`; stored transposed and split in three.
    implementation: passed to `ikbo_jax.two_level_linear_compression`.
    interpret: run a kernel implementation under the Pallas interpreter.
    rngs: random number generators.

  Example:

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from ikbo_jax import TwoLevelIndex
  >>> from ikbo_jax.nn import TwoLevelLinearCompression
  >>> layer = TwoLevelLinearCompression(6, 3, 5, 4, rngs=nnx.Rngs(0))
  >>> index = TwoLevelIndex.from_mappings([0, 0, 1], group_to_user=[0, 0], num_users=1)
  >>> out = layer(jnp.ones((1, 6, 8)), jnp.ones((2, 3, 8)), jnp.ones((3, 5, 8)), index)
  >>> out.shape                                # [B, M, N]
  (3, 4, 8)
  """

  def __init__(self, user_features: int, group_features: int, item_features: int,
               out_features: int, *, dtype=None, param_dtype=jnp.float32,
               kernel_init: nnx.Initializer = default_kernel_init,
               implementation: Implementation | None = None, interpret: bool = False,
               rngs: nnx.Rngs):
    # One init over the joint weight, as `LinearCompression` does: the scale of
    # `nnx.Linear(K_user + K_group + K_item -> M)` over the concatenated stack.
    fan_in = user_features + group_features + item_features
    w = kernel_init(rngs.params(), (fan_in, out_features), param_dtype).T
    ends = (user_features, user_features + group_features)
    self.w_user = nnx.Param(w[:, :ends[0]])
    self.w_group = nnx.Param(w[:, ends[0]:ends[1]])
    self.w_item = nnx.Param(w[:, ends[1]:])
    self.out_features = out_features
    self.dtype, self.param_dtype = dtype, param_dtype
    self.implementation, self.interpret = implementation, interpret

  def __call__(self, e_user: jax.Array, e_group: jax.Array, e_item: jax.Array,
               index: TwoLevelIndex, *, checked: bool = False) -> jax.Array:
    """`e_user [U, K_user, N]`, `e_group [G, K_group, N]`, `e_item [B, K_item, N]` ->
    `[B, out_features, N]`."""
    args = dtypes.promote_dtype((self.w_user[...], self.w_group[...], self.w_item[...],
                                 e_user, e_group, e_item), dtype=self.dtype)
    return two_level_linear_compression(*args, index, implementation=self.implementation,
                                        checked=checked, interpret=self.interpret)
