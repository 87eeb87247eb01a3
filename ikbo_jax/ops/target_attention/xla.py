"""XLA implementations of target attention: the semantics every kernel is tested against.

Shapes: `q [B, T, H, D]` (T = n_seed query tokens per candidate), `k, v [U, S, H, D]`,
`cand_to_user int32[B]` (already clamped to `[0, U)`), `kv_len int32[U]` (already
clamped to `[0, S]`). Outputs: `out [B, T, H, D]` in the input dtype and the
log-sum-exp of the scaled logits `lse [B, T, H]` in float32 (`-inf` for a user
with `kv_len == 0`, whose output rows are zero).

NaN and Inf follow `jax.nn.dot_product_attention` over the valid keys: a
non-finite value at a position that is read reaches exactly the rows that read
it, and nothing at or past `kv_len` is read, so padding may hold anything
(its keys and values are replaced by zeros before any product, which also
keeps it out of the gradients).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ikbo_jax import _dispatch
from ikbo_jax.ops.linear_compression_xla import take_rows
from ikbo_jax.ops.user_sums import add_sorted_chunk, in_chunks

_F32 = jnp.float32


def in_history(kv_len, seq_len: int):
  """`bool[U, S, 1, 1]`: which positions of each user's sequence are real (`< kv_len`)."""
  return (jnp.arange(seq_len)[None, :] < kv_len[:, None])[:, :, None, None]


def zero_past_length(x, kv_len):
  """`x [U, S, H, D]` with the rows at or past each user's length replaced by zeros.

  What keeps padding unread: `0 * NaN` is NaN, so masking logits alone leaves
  padded values (and, in a backward, padded keys and queries) in the products.
  """
  return jnp.where(in_history(kv_len, x.shape[1]), x, 0)


def attention(q, k, v, kv_len, *, scale: float, causal: bool = False, precision=None):
  """Plain softmax attention of `q [N, T, H, D]` over `k, v [N, S, H, D]`, keys `< kv_len[n]`.

  `causal` also masks keys after the query's position (query `t` sees keys `<= t`).
  """
  k, v = zero_past_length(k, kv_len), zero_past_length(v, kv_len)
  logits = jnp.einsum("nthd,nshd->nhts", q, k, precision=precision,
                      preferred_element_type=_F32) * scale
  valid = jnp.transpose(in_history(kv_len, k.shape[1]), (0, 2, 3, 1))
  if causal:
    key = jnp.arange(k.shape[1])
    valid &= key[None, :] <= jnp.arange(q.shape[1])[:, None]
  logits = jnp.where(valid, logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  # A query with no valid key gets zero weights (and output) and lse = -inf.
  # Any other row keeps its NaN or Inf: decided by comparison, since XLA's max
  # may skip NaN, and logsumexp would drop a NaN logit.
  no_keys = jnp.all(logits == -jnp.inf, axis=-1, keepdims=True)
  shifted = jnp.exp(logits - jnp.where(no_keys, 0.0, jax.lax.stop_gradient(row_max)))
  total = jnp.sum(shifted, axis=-1, keepdims=True)
  probs = jnp.where(no_keys, 0.0, shifted / jnp.where(no_keys, 1.0, total))
  lse = jnp.where(no_keys, -jnp.inf, jax.lax.stop_gradient(row_max) + jnp.log(total))[..., 0]
  out = jnp.einsum("nhts,nshd->nthd", probs.astype(v.dtype), v, precision=precision,
                   preferred_element_type=_F32)
  return out.astype(q.dtype), jnp.transpose(lse, (0, 2, 1))


def materialized(q, k, v, cand_to_user, kv_len, *, scale: float, precision=None,
                 gather=take_rows):
  """The baseline: copy each user's K/V (and length) to its candidates, then attention.

  `gather(x, ids)` makes the copy (as in `linear_compression_xla.materialized`).
  """
  return attention(q, gather(k, cand_to_user), gather(v, cand_to_user), kv_len[cand_to_user],
                   scale=scale, precision=precision)


def chunked(q, k, v, cand_to_user, kv_len, *, scale: float, chunk: int = 32, precision=None):
  """IKBO semantics in XLA with bounded memory: `chunk` candidates at a time.

  Each step gathers the K/V of only `chunk` candidates, so the live copy is
  `chunk * S * H * D` elements instead of `B * S * H * D`. The FLOPs are those
  of the materialized form; sharing K/V reads across a user's candidates is the
  kernels' job. The backward runs chunk by chunk too, over the candidates in
  user order, and sums each user's K/V gradients over its candidates in
  float32 in a fixed order (`user_sums.add_sorted_chunk`): plain autodiff
  would accumulate them in the input dtype, several times less accurately for
  16-bit inputs, and with a scatter-add whose GPU atomics change the last bits
  from call to call.
  """
  return _chunked(scale, chunk, precision,
                  *_dispatch.common_varying_axes(q, k, v, cand_to_user, kv_len))


def _candidate_attention(scale, precision, kv_len, q_b, k_b, v_b, user):
  """One candidate's `(out, lse)`: `q_b [T, H, D]` over its user's `k_b, v_b [S, H, D]`."""
  out, lse = attention(q_b[None], k_b[None], v_b[None], kv_len[user][None], scale=scale,
                       precision=precision)
  return out[0], lse[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _chunked(scale, chunk, precision, q, k, v, cand_to_user, kv_len):
  def one_candidate(args):
    q_b, user = args
    return _candidate_attention(scale, precision, kv_len, q_b, k[user], v[user], user)

  return jax.lax.map(one_candidate, (q, cand_to_user), batch_size=chunk)


def _chunked_fwd(scale, chunk, precision, q, k, v, cand_to_user, kv_len):
  return (_chunked(scale, chunk, precision, q, k, v, cand_to_user, kv_len),
          (q, k, v, cand_to_user, kv_len))


def _chunked_bwd(scale, chunk, precision, residuals, cotangents):
  q, k, v, cand_to_user, kv_len = residuals
  d_out, d_lse = cotangents

  def candidate_grads(q_b, user, d_out_b, d_lse_b):
    _, vjp = jax.vjp(functools.partial(_candidate_attention, scale, precision, kv_len),
                     q_b, k[user], v[user], user)
    return vjp((d_out_b, d_lse_b))[:3]

  def chunk_step(sums, xs):
    # Padding candidates carry zero cotangents and an id past U: they add nothing.
    dq, dk_rows, dv_rows = jax.vmap(candidate_grads)(*xs)
    users = xs[1]
    dk_sum, dv_sum = sums
    return (add_sorted_chunk(dk_sum, dk_rows, users), add_sorted_chunk(dv_sum, dv_rows, users)), dq

  num_users = k.shape[0]
  order = jnp.argsort(cand_to_user, stable=True)
  xs = (in_chunks(q[order], chunk), in_chunks(cand_to_user[order], chunk, fill=num_users),
        in_chunks(d_out[order], chunk), in_chunks(d_lse[order], chunk))
  zeros = jnp.zeros_like(k, _F32)  # typed like k: inside shard_map, varying as k does
  (dk, dv), dq = jax.lax.scan(chunk_step, (zeros, zeros), xs)
  dq_sorted = dq.reshape(-1, *q.shape[1:])[: q.shape[0]]
  dq = jnp.zeros_like(dq_sorted).at[order].set(dq_sorted, unique_indices=True)
  return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
