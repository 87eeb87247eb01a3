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

from ikbo_jax.ops import linear_compression_xla, self_target_attention_xla, target_attention_xla

_F32 = jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def gather_rows(x, ids, num_rows: int):
  """`x[ids]`, whose cotangent is summed per row in float32 before the final rounding."""
  del num_rows
  return x[ids]


def _gather_fwd(x, ids, num_rows):
  return x[ids], ids


def _gather_bwd(num_rows, ids, g):
  summed = jax.ops.segment_sum(g.astype(_F32), ids, num_segments=num_rows)
  return summed.astype(g.dtype), None


gather_rows.defvjp(_gather_fwd, _gather_bwd)


def linear_compression(w_user, w_cand, e_user, e_cand, cand_to_user, *, precision=None):
  """`out[b] = concat(W_user, W_cand) @ concat(E_user[u(b)], E_cand[b])`, one rounding."""
  e_user_rows = gather_rows(e_user, cand_to_user, e_user.shape[0])
  return linear_compression_xla.materialized(w_user, w_cand, e_user_rows, e_cand,
                                             jnp.arange(e_cand.shape[0]), precision=precision)


def target_attention(q, k, v, cand_to_user, kv_len, *, scale: float, precision=None):
  """`(out, lse)` of each candidate's queries over its user's copied K/V."""
  num_users = k.shape[0]
  return target_attention_xla.attention(
      q, gather_rows(k, cand_to_user, num_users), gather_rows(v, cand_to_user, num_users),
      kv_len[cand_to_user], scale=scale, precision=precision)


def self_target_attention(q_user, q_cand, k, v, cand_to_user, kv_len, *, scale: float,
                          causal: bool, precision=None):
  """`(out_user, out_cand)`: the users' self-attention and the candidates' target attention."""
  out_user = self_target_attention_xla.self_attention(
      q_user, k, v, kv_len, scale=scale, causal=causal, precision=precision)
  out_cand, _ = target_attention(q_cand, k, v, cand_to_user, kv_len, scale=scale,
                                 precision=precision)
  return out_user, out_cand
