"""XLA references of the three ops for the error rule: materialized, differentiable, any precision.

Each reference copies the user side to the candidate batch (the computation
models do today) through `gather_rows`, whose backward sums each user's
candidate cotangents in float32. Called with float32 inputs and
`precision=HIGHEST` they give the rule's `f32` reference; with the inputs'
own dtype and the default precision, its `same` reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ikbo_jax.ops import linear_compression_xla
from ikbo_jax.ops import two_level_linear_compression as two_level_op
from ikbo_jax.ops.self_target_attention import xla as self_target_attention_xla
from ikbo_jax.ops.target_attention import xla as target_attention_xla

_F32 = jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather_rows(x, ids, num_rows: int):
  del num_rows
  return x[ids]


def _gather_fwd(x, ids, num_rows):
  return x[ids], ids


def _gather_bwd(num_rows, ids, g):
  summed = jax.ops.segment_sum(g.astype(_F32), ids, num_segments=num_rows)
  return summed.astype(g.dtype), None


_gather_rows.defvjp(_gather_fwd, _gather_bwd)


def gather_rows(x, ids):
  """`x[ids]`, whose cotangent is summed per row in float32 before the final rounding."""
  return _gather_rows(x, ids, x.shape[0])


def linear_compression(w_user, w_cand, e_user, e_cand, cand_to_user, *, precision=None):
  """`out[b] = concat(W_user, W_cand) @ concat(E_user[u(b)], E_cand[b])`, one rounding."""
  return linear_compression_xla.materialized(w_user, w_cand, e_user, e_cand, cand_to_user,
                                             precision=precision, gather=gather_rows)


def target_attention(q, k, v, cand_to_user, kv_len, *, scale: float, precision=None):
  """`(out, lse)` of each candidate's queries over its user's copied K/V."""
  return target_attention_xla.materialized(q, k, v, cand_to_user, kv_len, scale=scale,
                                           precision=precision, gather=gather_rows)


def self_target_attention(q_user, q_cand, k, v, cand_to_user, kv_len, *, scale: float,
                          causal: bool, precision=None):
  """`(out_user, out_cand)`: the users' self-attention and the candidates' target attention."""
  out_user = self_target_attention_xla.self_attention(
      q_user, k, v, kv_len, scale=scale, causal=causal, precision=precision)
  out_cand, _ = target_attention(q_cand, k, v, cand_to_user, kv_len, scale=scale,
                                 precision=precision)
  return out_user, out_cand



def two_level_linear_compression(w_user, w_group, w_item, e_user, e_group, e_item, item_to_group,
                                 item_to_user, *, precision=None):
  """Both levels copied to the items (cotangents summed in float32), one GEMM, one rounding."""
  return two_level_op.materialized(w_user, w_group, w_item, e_user, e_group, e_item,
                                    item_to_group, item_to_user, precision=precision,
                                    gather=gather_rows)


def two_level_target_attention(q, k_user, v_user, k_group, v_group, item_to_user, item_to_group,
                               kv_len_user, kv_len_group, *, scale: float, precision=None):
  """`(out, lse)`: each item's queries over its user's and its group's copied keys, one softmax.

  The two regions' valid keys are packed into one prefix per item (the user's, then the
  group's), so the one-level `attention` with the summed length is the definition.
  """
  s_user = k_user.shape[1]
  len_user, len_group = kv_len_user[item_to_user], kv_len_group[item_to_group]
  pos = jnp.arange(s_user + k_group.shape[1])[None, :]
  source = jnp.minimum(jnp.where(pos < len_user[:, None], pos, s_user + pos - len_user[:, None]),
                       pos.shape[1] - 1)

  def packed(user_rows, group_rows):
    both = jnp.concatenate([gather_rows(user_rows, item_to_user),
                            gather_rows(group_rows, item_to_group)], axis=1)
    return jnp.take_along_axis(both, source[:, :, None, None], axis=1)

  return target_attention_xla.attention(q, packed(k_user, k_group), packed(v_user, v_group),
                                        len_user + len_group, scale=scale, precision=precision)
