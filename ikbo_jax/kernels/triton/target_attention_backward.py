"""Target attention backward, Pallas Triton backend: dq per candidate, dk/dv per user.

Both kernels recompute the probabilities from the forward's log-sum-exp,
`p = exp(scale * q k^T - lse)`, as in FlashAttention-2, and subtract from
`dp = d_out v^T` the row's `delta = sum_j p_j dp_j - d_lse`:

- dq: program `(b, h, t)` owns `block_t` query rows of candidate `b` and
  streams its user's first `kv_len[u]` keys. It starts from FlashAttention's
  estimate `delta0 = rowsum(out * d_out) - d_lse` (computed in XLA) and
  corrects it on the way (`kernels/exact_delta.py`), so `dq` and the `delta`
  it writes for the dk/dv kernel are exact to float32 rounding.
- dk, dv: program `(u, s, h)` owns `block_s` keys of user `u` and loops over
  that user's candidates (in the index's sort order) and their query blocks
  (at most 128 rows and 32 KB each, so any T fits in shared memory), accumulating
  `dv += p^T d_out` and `dk += scale * ds^T q` in float32 registers. Each user's
  gradient is thus summed over all of its candidates inside one program: no
  copy of K/V per candidate, no atomics, and the result is deterministic.
  Keys past `kv_len[u]` get zero gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ikbo_jax.kernels.exact_delta import delta_error
from ikbo_jax.kernels.triton.target_attention import Config, dot

_F32 = jnp.float32
# Bytes of one query (or output-cotangent) block of the dk/dv kernel: 128 rows of
# bfloat16 at D = 128, the largest that ran on the H200 beside its K/V blocks.
_DKV_MAX_BLOCK_BYTES = 128 * 128 * 2


def _probs_and_dscores(q, k, v, d_out, lse, delta, col_ok, scale):
  """`p` and `ds = p * (d_out v^T - delta)` of one (query block, key block) pair."""
  logits = dot(q, k.T) * scale
  # Rows of a user without keys have lse = -inf; they never reach here with a
  # valid column, and masked columns must give p = 0 rather than exp(nan).
  p = jnp.where(col_ok[None, :], jnp.exp(logits - lse[:, None]), 0.0)
  dp = dot(d_out, v.T)
  return p, p * (dp - delta[:, None])


def _dq_kernel(cand_to_user_ref, kv_len_ref, q_ref, k_ref, v_ref, d_out_ref, lse_ref,
               delta_ref, d_lse_ref, dq_ref, exact_delta_ref, *, scale: float, config: Config):
  num_t, head_dim = q_ref.shape[1], q_ref.shape[3]
  bt, bs = config.block_t, config.block_s
  b, h, ti = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  user = cand_to_user_ref[b]
  kv_len = kv_len_ref[user]
  row_ok = ti * bt + jnp.arange(bt) < num_t
  rows = (b, pl.ds(ti * bt, bt), h)
  q = plt.load(q_ref.at[*rows, :], mask=row_ok[:, None], other=0.0)
  d_out = plt.load(d_out_ref.at[*rows, :], mask=row_ok[:, None], other=0.0)
  lse = plt.load(lse_ref.at[rows], mask=row_ok, other=0.0)
  delta = plt.load(delta_ref.at[rows], mask=row_ok, other=0.0)
  d_lse = plt.load(d_lse_ref.at[rows], mask=row_ok, other=0.0)

  def s_step(j, carry):
    dq, pk, ds_sum = carry
    col_ok = j * bs + jnp.arange(bs) < kv_len
    keys = (user, pl.ds(j * bs, bs), h, slice(None))
    k = plt.load(k_ref.at[keys], mask=col_ok[:, None], other=0.0)
    v = plt.load(v_ref.at[keys], mask=col_ok[:, None], other=0.0)
    p, ds = _probs_and_dscores(q, k, v, d_out, lse, delta, col_ok, scale)
    return (dq + dot(ds.astype(k.dtype), k), pk + dot(p.astype(k.dtype), k),
            ds_sum + jnp.sum(ds, axis=1))

  zeros = jnp.zeros((bt, head_dim), _F32)
  dq, pk, ds_sum = lax.fori_loop(0, pl.cdiv(kv_len, bs), s_step,
                                 (zeros, zeros, jnp.zeros((bt,), _F32)))
  error = delta_error(ds_sum, d_lse)
  dq = dq - error[:, None] * pk
  plt.store(dq_ref.at[*rows, :], (dq * scale).astype(dq_ref.dtype), mask=row_ok[:, None])
  plt.store(exact_delta_ref.at[rows], delta + error, mask=row_ok)


def _dkv_kernel(user_offsets_ref, sort_order_ref, kv_len_ref, q_ref, k_ref, v_ref, d_out_ref,
                lse_ref, delta_ref, dk_ref, dv_ref, *, scale: float, block_t: int,
                config: Config):
  num_t, head_dim = q_ref.shape[1], q_ref.shape[3]
  bs = config.block_s
  t_blocks = pl.cdiv(num_t, block_t)
  u, sj, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  col_ok = sj * bs + jnp.arange(bs) < kv_len_ref[u]
  keys = (u, pl.ds(sj * bs, bs), h, slice(None))
  k = plt.load(k_ref.at[keys], mask=col_ok[:, None], other=0.0)
  v = plt.load(v_ref.at[keys], mask=col_ok[:, None], other=0.0)

  def step(i, carry):
    """Query block `i % t_blocks` of the user's `i // t_blocks`-th candidate."""
    dk, dv = carry
    first_row = lax.rem(i, t_blocks) * block_t
    rows = (sort_order_ref[lax.div(i, t_blocks)], pl.ds(first_row, block_t), h)
    row_ok = first_row + jnp.arange(block_t) < num_t
    q = plt.load(q_ref.at[*rows, :], mask=row_ok[:, None], other=0.0)
    d_out = plt.load(d_out_ref.at[*rows, :], mask=row_ok[:, None], other=0.0)
    # Padded rows: lse = +inf gives p = 0, so they add nothing.
    lse = plt.load(lse_ref.at[rows], mask=row_ok, other=jnp.inf)
    delta = plt.load(delta_ref.at[rows], mask=row_ok, other=0.0)
    p, ds = _probs_and_dscores(q, k, v, d_out, lse, delta, col_ok, scale)
    dv = dv + dot(p.astype(d_out.dtype).T, d_out)
    dk = dk + dot(ds.astype(q.dtype).T, q)
    return dk, dv

  # A key block wholly past kv_len skips the loop and stores zeros.
  first = user_offsets_ref[u]
  last = jnp.where(sj * bs < kv_len_ref[u], user_offsets_ref[u + 1], first)
  zeros = jnp.zeros((bs, head_dim), _F32)
  dk, dv = lax.fori_loop(first * t_blocks, last * t_blocks, step, (zeros, zeros))
  in_seq = sj * bs + jnp.arange(bs) < k_ref.shape[1]
  plt.store(dk_ref.at[keys], (dk * scale).astype(dk_ref.dtype), mask=in_seq[:, None])
  plt.store(dv_ref.at[keys], dv.astype(dv_ref.dtype), mask=in_seq[:, None])


def target_attention_backward(q, k, v, lse, delta, d_lse, d_out, cand_to_user, user_offsets,
                              sort_order, kv_len, *, scale: float, config: Config = Config(),
                              interpret: bool = False):
  """`(dq, dk, dv)` of target attention.

  Args:
    q: `[B, T, H, D]`; `k`, `v`: `[U, S, H, D]`; `d_out`: `[B, T, H, D]`.
    lse: `[B, T, H]` float32, the forward's log-sum-exp (`-inf` where `kv_len == 0`).
    delta: `[B, T, H]` float32, `rowsum(out * d_out) - d_lse`, which the dq kernel corrects.
    d_lse: `[B, T, H]` float32, the lse's cotangent (zeros without one).
    cand_to_user: `int32[B]` in `[0, U)`.
    user_offsets: `int32[U + 1]`, user `u`'s candidates are
      `sort_order[user_offsets[u]:user_offsets[u + 1]]` (they drive the dk/dv loop).
    sort_order: `int32[B]`, the candidates grouped by user.
    kv_len: `int32[U]` with values in `[0, S]`.
    scale: the logit scale.
    config: tile sizes and Triton launch parameters (the forward's `Config`).
    interpret: run under the Pallas interpreter (CPU testing).
  """
  num_cands, num_t, num_heads, _ = q.shape
  num_users, seq_len = k.shape[:2]
  d_out = d_out.astype(q.dtype)
  params = plt.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
  dq, delta = pl.pallas_call(
      functools.partial(_dq_kernel, scale=scale, config=config),
      out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(lse.shape, _F32)),
      grid=(num_cands, num_heads, pl.cdiv(num_t, config.block_t)),
      compiler_params=params,
      interpret=interpret,
      name="ikbo_target_attention_dq_triton",
  )(cand_to_user, kv_len, q, k, v, d_out, lse, delta, d_lse)
  # A candidate's T rows in blocks of a power of two: at least 16 rows, at most
  # 128 and at most 32 KB of queries (64 rows of float32 at D = 128). Larger
  # blocks do not fit in shared memory (bfloat16 T = 256 asked for 330 KB).
  max_block_t = max(16, min(128, _DKV_MAX_BLOCK_BYTES // (q.shape[3] * q.dtype.itemsize)))
  block_t = min(max_block_t, max(16, pl.next_power_of_2(num_t)))
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, scale=scale, block_t=block_t, config=config),
      out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
      grid=(num_users, pl.cdiv(seq_len, config.block_s), num_heads),
      compiler_params=params,
      interpret=interpret,
      name="ikbo_target_attention_dkv_triton",
  )(user_offsets, sort_order, kv_len, q, k, v, d_out, lse, delta)
  return dq, dk, dv
