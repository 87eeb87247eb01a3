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

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from ikbo_jax.ops.target_attention import mosaic_gpu
from ikbo_jax.ops.target_attention.params import Params
from ikbo_jax.two_level_index import TwoLevelIndex


def forward(params: Params, q, k_user, v_user, k_group, v_group, index: TwoLevelIndex,
            kv_len_user, kv_len_group):
  """`(out [B, T, H, D], lse [B, T, H] float32)`; lengths already clamped to each region's S."""
  group = mosaic_gpu.GroupHistory(index.items, index.groups.clamped_cand_to_user, k_group,
                                  v_group, kv_len_group)
  return mosaic_gpu.two_level_forward(q, k_user, v_user, kv_len_user, group,
                                      scale=params.scale, mask_past_length=params.masked,
                                      interpret=params.interpret)


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
