"""Two-level target attention on the Mosaic GPU kernel: both regions in one launch.

The query tiles are built per group (all of a tile's items share a group, so a
user), and each tile streams its user's K/V blocks and then its group's through
one online softmax (`kernels.mosaic_gpu.target_attention.GroupRegion`): no
partial outputs are written and merged, which is what two launches cost.

The backward recomputes each region's output and log-sum-exp with the one-level
kernels and differentiates their exact merge: the one-level backward kernels
correct the softmax's `delta` under the assumption that a row's probabilities
over their keys sum to one, which holds per region only against the region's own
log-sum-exp.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from ikbo_jax._padding import pad_to, round_up
from ikbo_jax.kernels.mosaic_gpu import query_tiles
from ikbo_jax.kernels.mosaic_gpu import target_attention as kernel
from ikbo_jax.ops.target_attention import xla
from ikbo_jax.ops.target_attention.params import Params
from ikbo_jax.two_level_index import TwoLevelIndex


def forward(params: Params, q, k_user, v_user, k_group, v_group, index: TwoLevelIndex,
            kv_len_user, kv_len_group, config: kernel.Config = kernel.Config()):
  """`(out [B, T, H, D], lse [B, T, H] float32)`; lengths already clamped to each region's S."""
  num_queries = q.shape[1]
  if params.masked:  # `0 * NaN` is NaN: V rows past the lengths must be zeros, not padding
    v_user = xla.zero_past_length(v_user, kv_len_user)
    v_group = xla.zero_past_length(v_group, kv_len_group)
  packed_queries = query_tiles.packed_num_queries(num_queries, kernel.BLOCK_ROWS)
  pad_keys = lambda x: pad_to(x, 1, round_up(x.shape[1], config.block_kv))
  items = index.items  # items -> groups: the tiles are per group
  tiles = query_tiles.build(items.sort_order, items.user_offsets, packed_queries,
                            block_rows=kernel.BLOCK_ROWS, blocks_per_tile=kernel.NUM_CONSUMERS)
  group = tiles.user
  user = index.groups.clamped_cand_to_user[group]
  group_region = kernel.GroupRegion(pad_keys(k_group), pad_keys(v_group), group,
                                    jnp.where(tiles.live, kv_len_group[group], 0))
  out, lse, _ = kernel.forward(
      pad_to(q, 1, packed_queries), pad_keys(k_user), pad_keys(v_user),
      dataclasses.replace(tiles, user=user), jnp.where(tiles.live, kv_len_user[user], 0),
      scale=params.scale, save_lse=True, group=group_region, config=config,
      interpret=params.interpret)
  return out[:, :num_queries], jnp.transpose(lse, (0, 2, 1))[:, :num_queries]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def attention(params: Params, two_launches: Callable, q, k_user, v_user, k_group, v_group,
              index, kv_len_user, kv_len_group):
  """`out`, or `(out, lse)` with `params.return_lse`.

  `two_launches(params, q, k_user, v_user, k_group, v_group, index, kv_len_user,
  kv_len_group) -> (out, lse)` is the same attention as two one-level launches and a
  merge, which the backward differentiates.
  """
  out, lse = forward(params, q, k_user, v_user, k_group, v_group, index, kv_len_user,
                     kv_len_group)
  return (out, lse) if params.return_lse else out


def _forward(params, two_launches, q, k_user, v_user, k_group, v_group, index, kv_len_user,
             kv_len_group):
  result = attention(params, two_launches, q, k_user, v_user, k_group, v_group, index,
                     kv_len_user, kv_len_group)
  return result, (q, k_user, v_user, k_group, v_group, index, kv_len_user, kv_len_group)


def _backward(params, two_launches, residuals, cotangents):
  *arrays, index, kv_len_user, kv_len_group = residuals
  regions = lambda *x: two_launches(params, *x, index, kv_len_user, kv_len_group)
  (out, lse), vjp = jax.vjp(regions, *arrays)
  d_out, d_lse = cotangents if params.return_lse else (cotangents, jnp.zeros_like(lse))
  return (*vjp((d_out.astype(out.dtype), d_lse)), None, None, None)


attention.defvjp(_forward, _backward)
