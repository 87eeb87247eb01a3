"""Fused candidate GEMM of linear compression, Pallas Mosaic GPU backend (Hopper).

Computes `out[b] = A @ E[b] + user_res[cand_to_user[b]]` in one persistent,
warp-specialized launch. In the forward pass `A = W_cand` and `E = E_cand`; the
backward reuses the kernel without the user term for `dE_cand[b] = W_cand^T @
dOut[b]`.

One CTA per SM loops over output tiles `(b, m, n)`, `b` outermost so that the
CTAs running at one time share `E[b]` in L2. A producer warpgroup streams `A`
and `E[b]` K-tiles through shared memory with TMA; two consumer warpgroups, one
per half of the tile's M extent, run WGMMA into float32 accumulators. Splitting
M rather than N lets both consumers read the same `E[b]` tile, which is the
operand that dominates traffic. In the epilogue each consumer adds its tile
of `user_res[cand_to_user[b]]` to the float32 accumulator before the single
rounding. The user rows are loaded from global memory straight into the WGMMA
register layout, one chunk ahead (the first during the K loop), so the
epilogue does not stall on them; no shared memory and no broadcast of
`user_res` to the candidate batch is involved.

Ragged M and the K tail rely on TMA bounds handling: loads past the end of a
dimension read zeros and stores past it are dropped, per dimension of the
`[B, M, N]` / `[B, K, N]` tensors, so one candidate's tile never touches its
neighbour's rows. The swizzled TMA tiles need the tiled dimensions of every
operand loaded through them to be multiples of the tile (8 rows, 64 columns),
hence `A` is padded by the caller (to `tile_k` columns), and `E` must have K a
multiple of 8 and N of 64. `user_res` is read with plain loads, so it is padded
to whole CTA tiles. The output is stored with a row tiling of 1, so M needs no
padding there.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ikbo_jax._padding import round_up
from ikbo_jax.kernels.mosaic_gpu.common import (
    NUM_CONSUMERS, PRODUCER_REGISTERS, compiler_params, interpret_params,
    num_sms, smem_transforms)


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiling of one CTA: each consumer computes `tile_m x tile_n`.

  `split` says along which dimension the two consumers' tiles sit side by side
  ("m": they share the `E[b]` tile, "n": they share the `A` tile).
  `delay_release` keeps that many WGMMA groups in flight before a shared
  memory slot is handed back to the producer.
  """

  tile_m: int = 64
  tile_n: int = 256
  tile_k: int = 64
  max_concurrent_steps: int = 4
  epi_tile_n: int = 64
  split: Literal["m", "n"] = "m"
  delay_release: int = 0

  @property
  def cta_tile_m(self) -> int:
    return self.tile_m * (NUM_CONSUMERS if self.split == "m" else 1)

  @property
  def cta_tile_n(self) -> int:
    return self.tile_n * (NUM_CONSUMERS if self.split == "n" else 1)

  def for_n(self, n: int) -> Config:
    """This config with the CTA's N extent shrunk to N rounded up to 64, when N is smaller."""
    cta_tile_n = min(self.cta_tile_n, round_up(n, 64 * NUM_CONSUMERS if self.split == "n" else 64))
    return dataclasses.replace(self, tile_n=cta_tile_n * self.tile_n // self.cta_tile_n)


def _kernel(cand_to_user_gmem, a_gmem, e_gmem, *user_res_and_out, config: Config):
  user_res_gmem, out_gmem = (None, *user_res_and_out) if len(user_res_and_out) == 1 else (
      user_res_and_out)
  num_cands, k, n = e_gmem.shape
  m = out_gmem.shape[1]
  out_dtype = out_gmem.dtype
  tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
  cta_tile_m, cta_tile_n, epi_tile_n = config.cta_tile_m, config.cta_tile_n, config.epi_tile_n
  m_iters, n_iters = pl.cdiv(m, cta_tile_m), pl.cdiv(n, cta_tile_n)
  in_transforms = smem_transforms(tile_k, e_gmem.dtype)

  def pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(pl.cdiv(k, tile_k),),
        memory_registers=PRODUCER_REGISTERS,
        in_specs=[
            plgpu.BlockSpec((cta_tile_m, tile_k), lambda kk: (0, kk),
                            transforms=in_transforms, delay_release=config.delay_release),
            plgpu.BlockSpec((tile_k, cta_tile_n), lambda kk: (kk, 0),
                            transforms=in_transforms, delay_release=config.delay_release),
        ],
        wg_axis="wg",
        num_compute_wgs=NUM_CONSUMERS,
        max_concurrent_steps=config.max_concurrent_steps,
        compute_context=compute_context,
    )

  ignore = lambda *_, **__: None

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=pipeline(ignore, ignore).get_allocations(a_gmem, e_gmem.at[0]),
      # Row tiling of 1: a tiling of 8 rows would require M % 8 == 0 in `out`.
      out_smem=plgpu.SMEM((NUM_CONSUMERS, 2, tile_m, epi_tile_n), out_dtype,
                          transforms=smem_transforms(epi_tile_n, out_dtype, rows=1)),
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, out_smem):
    wg = lax.axis_index("wg")

    @plgpu.nd_loop((num_cands, m_iters, n_iters), collective_axes="sm")
    def _tile_loop(loop_info: plgpu.NDLoopInfo):
      b, mi, ni = loop_info.index

      # This consumer's offsets inside the CTA tile.
      wg_m, wg_n = (wg * tile_m, 0) if config.split == "m" else (0, wg * tile_n)
      wg_m_slice = pl.ds(mi * cta_tile_m + wg_m, tile_m)

      def compute_context(eval_pipeline):
        num_epi = tile_n // epi_tile_n
        user_tile = None if user_res_gmem is None else user_res_gmem.at[
            cand_to_user_gmem[b], wg_m_slice, pl.ds(ni * cta_tile_n + wg_n, tile_n)]

        def load_user_chunk(epi):
          if user_tile is None or epi == num_epi:
            return None
          return plgpu.load(user_tile.at[:, pl.ds(epi * epi_tile_n, epi_tile_n)],
                            layout=plgpu.Layout.WGMMA, optimized=False)

        # Software-pipelined user loads: chunk 0 is in flight during the K loop
        # and each later chunk during the store of the one before, so the
        # epilogue does not wait on global memory latency.
        next_user_chunk = load_user_chunk(0)

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
        def acc(acc_ref):
          eval_pipeline(acc_ref)
          return acc_ref[...]

        for epi in range(num_epi):
          slot = epi % 2
          out_tile = acc[:, epi * epi_tile_n:(epi + 1) * epi_tile_n]
          if user_tile is not None:
            user_chunk, next_user_chunk = next_user_chunk, load_user_chunk(epi + 1)
            out_tile += user_chunk
          # The slot's previous TMA store must have read it before we overwrite.
          plgpu.wait_smem_to_gmem(1, wait_read_only=True)
          out_smem[wg, slot] = out_tile.astype(out_dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(
              out_smem.at[wg, slot],
              out_gmem.at[b, wg_m_slice, pl.ds(ni * cta_tile_n + wg_n + epi * epi_tile_n,
                                              epi_tile_n)])

      def mma_step(_, a_smem, e_smem, acc_ref):
        plgpu.wgmma(acc_ref, a_smem.at[pl.ds(wg_m, tile_m)], e_smem.at[:, pl.ds(wg_n, tile_n)])
        plgpu.wgmma_wait(config.delay_release)
        return acc_ref

      pipeline(mma_step, compute_context)(
          a_gmem.at[pl.ds(mi * cta_tile_m, cta_tile_m), :],
          e_gmem.at[b, :, pl.ds(ni * cta_tile_n, cta_tile_n)],
          allocations=pipeline_allocs)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def batched_gemm(a, e, user_res=None, cand_to_user=None, *, num_rows: int,
                 config: Config = Config(), interpret: bool = False):
  """`out[b] = a @ e[b] + user_res[cand_to_user[b]]` (or without the user term), rounded once.

  Args:
    a: `[M_p, K_a]`, `M_p >= num_rows` and `K_a >= K` multiples of 8, zero past K.
    e: `[B, K, N]`, bfloat16 or float16, K a multiple of 8, N of 64.
    user_res: None or `[U, M_u, N_u]` float32 with `M_u` and `N_u` whole CTA
      tiles (`config.cta_tile_m`, `config.cta_tile_n`).
    cand_to_user: `int32[B]` with values in `[0, U)`; needed with `user_res`.
    num_rows: M, the rows of the output.
    config: tile sizes.
    interpret: run under the Mosaic GPU interpreter (CPU testing).
  """
  num_cands, _, n = e.shape
  if user_res is None:
    cand_to_user = jnp.zeros((1,), jnp.int32)  # unused; keeps one kernel signature
  out = plgpu.kernel(
      functools.partial(_kernel, config=config),
      out_type=jax.ShapeDtypeStruct((num_cands, num_rows, n), e.dtype),
      grid=(num_sms(interpret),),
      grid_names=("sm",),
      num_threads=NUM_CONSUMERS + 1,
      thread_name="wg",
      compiler_params=compiler_params(),
      interpret=interpret_params(interpret),
      kernel_name="ikbo_linear_compression_mosaic_gpu",
  )
  user_operand = () if user_res is None else (user_res,)
  return out(cand_to_user, a, e, *user_operand)
