"""Fused candidate GEMM of linear compression, Pallas Triton backend.

One program computes one `[block_m, block_n]` tile of `out[b] = W_cand @ E_cand[b]`
in float32 and, in the epilogue, adds the tile of `user_res[cand_to_user[b]]`
before the single rounding to the output dtype. The user rows are looked up by
index inside the kernel: no `[B, M, N]` broadcast of `user_res` ever exists.
Ragged edges of M, N and K are handled with masked loads and stores, so callers
never pad.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


@dataclasses.dataclass(frozen=True)
class Config:
  block_m: int = 64
  block_n: int = 128
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 3


def _kernel(cand_to_user_ref, w_ref, e_ref, user_res_ref, out_ref, *, config: Config):
  m = w_ref.shape[0]
  k, n = e_ref.shape[1:]  # w_ref may carry zero columns past k
  bm, bn, bk = config.block_m, config.block_n, config.block_k
  b, mi, ni = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows = mi * bm + jnp.arange(bm)
  cols = ni * bn + jnp.arange(bn)
  tile_mask = (rows < m)[:, None] & (cols < n)[None, :]

  def k_step(kk, acc):
    ks = kk * bk + jnp.arange(bk)
    k_ok = ks < k
    w = plt.load(
        w_ref.at[pl.ds(mi * bm, bm), pl.ds(kk * bk, bk)],
        mask=(rows < m)[:, None] & k_ok[None, :], other=0.0)
    e = plt.load(
        e_ref.at[b, pl.ds(kk * bk, bk), pl.ds(ni * bn, bn)],
        mask=k_ok[:, None] & (cols < n)[None, :], other=0.0)
    return acc + jnp.dot(w, e, preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(
      0, pl.cdiv(k, bk), k_step, jnp.zeros((bm, bn), jnp.float32))
  user = cand_to_user_ref[b]
  acc += plt.load(
      user_res_ref.at[user, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)],
      mask=tile_mask, other=0.0)
  plt.store(
      out_ref.at[b, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)],
      acc.astype(out_ref.dtype), mask=tile_mask)


def fused_candidate_gemm(w_cand, e_cand, user_res, cand_to_user, *,
                         config: Config = Config(), interpret: bool = False):
  """`out[b] = W_cand @ E_cand[b] + user_res[cand_to_user[b]]`, rounded once.

  Args:
    w_cand: `[M, K]`.
    e_cand: `[B, K, N]`, same dtype as `w_cand`.
    user_res: `[U, M, N]` float32.
    cand_to_user: `int32[B]`, values in `[0, U)`.
    config: tile sizes (powers of two) and Triton launch parameters.
    interpret: run under the Pallas interpreter (CPU testing).
  """
  m = w_cand.shape[0]
  num_cands, _, n = e_cand.shape
  grid = (num_cands, pl.cdiv(m, config.block_m), pl.cdiv(n, config.block_n))
  return pl.pallas_call(
      functools.partial(_kernel, config=config),
      out_shape=jax.ShapeDtypeStruct((num_cands, m, n), e_cand.dtype),
      grid=grid,
      compiler_params=plt.CompilerParams(
          num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name="ikbo_linear_compression_triton",
  )(cand_to_user, w_cand, e_cand, user_res)
