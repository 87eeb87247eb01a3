"""Target attention forward, Pallas Triton backend (flash attention with an in-kernel user lookup).

Program `(b, h, t)` owns `block_t` query rows of candidate `b`, head `h`. It
reads `u = cand_to_user[b]` and streams only that user's first `kv_len[u]`
keys and values, `block_s` at a time, with the online softmax in float32. No
K/V is ever copied to the candidate batch: candidates of one user read the same
rows, and the grid runs `b` outermost so that programs of a user with adjacent
candidates hit those rows in L2. Ragged T, S and the length mask are handled
with masked loads, so callers never pad and nothing past `kv_len` is read.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

_F32 = jnp.float32


def dot(a, b):
  """`a @ b` accumulated in float32; float32 operands multiply in full float32, not TF32.

  The backward takes `delta = rowsum(out * d_out)` from the forward's output
  and `dp = d_out v^T` from its own GEMM; with a one-key history `dp - delta`
  cancels exactly, so TF32 rounding in either GEMM stays in `ds` (H200:
  float32 dq and dk 3.2-3.5x the same-precision reference's error).
  """
  precision = jax.lax.Precision.HIGHEST if a.dtype == _F32 else None
  return jnp.dot(a, b, precision=precision, preferred_element_type=_F32)


@dataclasses.dataclass(frozen=True)
class Config:
  block_t: int = 64
  block_s: int = 64
  num_warps: int = 4
  num_stages: int = 2


def _kernel(cand_to_user_ref, kv_len_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, *,
            scale: float, config: Config):
  num_t, head_dim = q_ref.shape[1], q_ref.shape[3]
  bt, bs = config.block_t, config.block_s
  b, h, ti = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  user = cand_to_user_ref[b]
  kv_len = kv_len_ref[user]
  rows = ti * bt + jnp.arange(bt)
  row_ok = rows < num_t
  q = plt.load(q_ref.at[b, pl.ds(ti * bt, bt), h, :], mask=row_ok[:, None], other=0.0)

  def s_step(j, carry):
    acc, row_max, row_sum = carry
    cols = j * bs + jnp.arange(bs)
    col_ok = cols < kv_len
    k = plt.load(k_ref.at[user, pl.ds(j * bs, bs), h, :], mask=col_ok[:, None], other=0.0)
    v = plt.load(v_ref.at[user, pl.ds(j * bs, bs), h, :], mask=col_ok[:, None], other=0.0)
    logits = dot(q, k.T) * scale
    logits = jnp.where(col_ok[None, :], logits, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))
    probs = jnp.exp(logits - new_max[:, None])
    rescale = jnp.exp(row_max - new_max)
    acc = acc * rescale[:, None] + dot(probs.astype(v.dtype), v)
    return acc, new_max, row_sum * rescale + jnp.sum(probs, axis=1)

  # Start from a finite row max: exp(-inf - (-inf)) would be NaN on the first block.
  init = (jnp.zeros((bt, head_dim), _F32), jnp.full((bt,), -1e30, _F32), jnp.zeros((bt,), _F32))
  acc, row_max, row_sum = jax.lax.fori_loop(0, pl.cdiv(kv_len, bs), s_step, init)
  # Decided by the length, not by the sums: a NaN read from q or k must reach
  # the output (as in `jax.nn.dot_product_attention`), not turn it into zeros.
  has_keys = kv_len > 0
  out = jnp.where(has_keys, acc / jnp.where(has_keys, row_sum, 1.0)[:, None], 0.0)
  lse = jnp.where(has_keys, row_max + jnp.log(jnp.where(has_keys, row_sum, 1.0)), -jnp.inf)
  plt.store(out_ref.at[b, pl.ds(ti * bt, bt), h, :], out.astype(out_ref.dtype),
            mask=row_ok[:, None])
  plt.store(lse_ref.at[b, pl.ds(ti * bt, bt), h], lse, mask=row_ok)


def target_attention_forward(q, k, v, cand_to_user, kv_len, *, scale: float,
                             config: Config = Config(), interpret: bool = False):
  """`(out [B, T, H, D], lse [B, T, H] float32)` of target attention.

  Args:
    q: `[B, T, H, D]`; `k`, `v`: `[U, S, H, D]`, all one dtype, D a power of two >= 16.
    cand_to_user: `int32[B]` with values in `[0, U)`.
    kv_len: `int32[U]` with values in `[0, S]`.
    scale: the logit scale.
    config: tile sizes (powers of two) and Triton launch parameters.
    interpret: run under the Pallas interpreter (CPU testing).
  """
  num_cands, num_t, num_heads, _ = q.shape
  grid = (num_cands, num_heads, pl.cdiv(num_t, config.block_t))
  return pl.pallas_call(
      functools.partial(_kernel, scale=scale, config=config),
      out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct(q.shape[:3], _F32)),
      grid=grid,
      compiler_params=plt.CompilerParams(
          num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name="ikbo_target_attention_triton",
  )(cand_to_user, kv_len, q, k, v)
