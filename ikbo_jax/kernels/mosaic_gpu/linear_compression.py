"""Fused candidate GEMM of linear compression, Pallas Mosaic GPU backend (Hopper).

Computes `out[b] = W_cand @ E_cand[b] + user_res[cand_to_user[b]]` in one
persistent, warp-specialized launch: one CTA per SM loops over output tiles
`(b, m, n)`; a producer warpgroup streams `W_cand` and `E_cand[b]` K-tiles
through shared memory with TMA, two consumer warpgroups (one per half of the
tile's N extent) run WGMMA into float32 accumulators. Each consumer prefetches
its float32 tile of `user_res[cand_to_user[b]]` with TMA when the tile starts,
and the epilogue adds it to the accumulator before the single rounding, then
stores through shared memory with TMA. The user rows are addressed by index:
no broadcast of `user_res` to the candidate batch exists.

Ragged M and the K tail rely on TMA bounds handling: loads past the end of a
dimension read zeros and stores past it are dropped, per dimension of the
`[B, M, N]` / `[B, K, N]` tensors, so one candidate's tile never touches its
neighbour's rows. The swizzled TMA tiles need the tiled dimensions of every
global operand to be multiples of the tile (8 rows, 64 bf16 columns), hence the
caller pads `W_cand` (to `tile_k` columns) and `user_res`, and passes `E_cand`
with K a multiple of 8 and N of 64. The output is stored with a row tiling of 1,
so M needs no padding there.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_NUM_CONSUMERS = 2  # consumer warpgroups; the producer is the third.


@dataclasses.dataclass(frozen=True)
class Config:
  """Tile sizes of one CTA: `tile_m x (2 * tile_n)`, each consumer owning `tile_m x tile_n`."""

  tile_m: int = 64
  tile_n: int = 128
  tile_k: int = 64
  max_concurrent_steps: int = 3
  epi_tile_n: int = 64

  @property
  def cta_tile_n(self) -> int:
    return _NUM_CONSUMERS * self.tile_n


def _smem_transforms(minor_elems: int, dtype, rows: int = 8) -> tuple:
  swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
  swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
  return plgpu.TilingTransform((rows, swizzle_elems)), plgpu.SwizzleTransform(swizzle)


def _num_sms(interpret: bool) -> int:
  if interpret:
    return 2  # A few simulated SMs keep the persistent loop honest and the interpreter fast.
  if abstract_device := jax.sharding.get_abstract_mesh().abstract_device:
    return abstract_device.num_cores
  return jax.devices()[0].core_count


def _kernel(cand_to_user_gmem, w_gmem, e_gmem, user_res_gmem, out_gmem, *, config: Config):
  num_cands, k, n = e_gmem.shape
  m = out_gmem.shape[1]
  dtype, out_dtype = e_gmem.dtype, out_gmem.dtype
  tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
  cta_tile_n, epi_tile_n = config.cta_tile_n, config.epi_tile_n
  m_iters, n_iters = pl.cdiv(m, tile_m), pl.cdiv(n, cta_tile_n)
  k_iters = pl.cdiv(k, tile_k)
  in_transforms = _smem_transforms(tile_k, dtype)

  def pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_iters,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((tile_m, tile_k), lambda kk: (0, kk),
                            transforms=in_transforms),
            plgpu.BlockSpec((tile_k, cta_tile_n), lambda kk: (kk, 0),
                            transforms=in_transforms),
        ],
        wg_axis="wg",
        num_compute_wgs=_NUM_CONSUMERS,
        max_concurrent_steps=config.max_concurrent_steps,
        compute_context=compute_context,
    )

  ignore = lambda *_, **__: None

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=pipeline(ignore, ignore).get_allocations(w_gmem, e_gmem.at[0]),
      user_smem=plgpu.SMEM((_NUM_CONSUMERS, tile_m, tile_n), jnp.float32,
                           transforms=_smem_transforms(tile_n, jnp.float32)),
      # Row tiling of 1: a tiling of 8 rows would require M % 8 == 0 in `out`.
      out_smem=plgpu.SMEM((_NUM_CONSUMERS, 2, tile_m, epi_tile_n), out_dtype,
                          transforms=_smem_transforms(epi_tile_n, out_dtype, rows=1)),
      user_barrier=plgpu.Barrier(num_barriers=_NUM_CONSUMERS),
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, user_smem, out_smem, user_barrier):
    wg = lax.axis_index("wg")

    @plgpu.nd_loop((num_cands, m_iters, n_iters), collective_axes="sm")
    def _tile_loop(loop_info: plgpu.NDLoopInfo):
      b, mi, ni = loop_info.index
      user = cand_to_user_gmem[b]
      m_slice = pl.ds(mi * tile_m, tile_m)
      cta_n_slice = pl.ds(ni * cta_tile_n, cta_tile_n)
      wg_n_slice = pl.ds(ni * cta_tile_n + wg * tile_n, tile_n)

      def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
        def _acc_scope(acc_ref):
          # The user tile lands while the K loop runs; only the epilogue waits for it.
          plgpu.copy_gmem_to_smem(
              user_res_gmem.at[user, m_slice, wg_n_slice],
              user_smem.at[wg], user_barrier.at[wg])
          eval_pipeline(acc_ref)
          plgpu.barrier_wait(user_barrier.at[wg])
          acc = acc_ref[...] + user_smem[wg]
          for epi in range(tile_n // epi_tile_n):
            slot = epi % 2
            epi_slice = slice(epi * epi_tile_n, (epi + 1) * epi_tile_n)
            # The slot's previous TMA store must have read it before we overwrite.
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            out_smem[wg, slot] = acc[:, epi_slice].astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                out_smem.at[wg, slot],
                out_gmem.at[b, m_slice,
                            pl.ds(ni * cta_tile_n + wg * tile_n + epi * epi_tile_n,
                                  epi_tile_n)])

      def mma_step(_, w_smem, e_smem, acc_ref):
        plgpu.wgmma(acc_ref, w_smem, e_smem.at[:, pl.ds(wg * tile_n, tile_n)])
        plgpu.wgmma_wait(0)
        return acc_ref

      pipeline(mma_step, compute_context)(
          w_gmem.at[m_slice, :], e_gmem.at[b, :, cta_n_slice],
          allocations=pipeline_allocs)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def fused_candidate_gemm(w_cand, e_cand, user_res, cand_to_user, *, num_rows: int,
                         config: Config = Config(), interpret: bool = False):
  """`out[b] = W_cand @ E_cand[b] + user_res[cand_to_user[b]]`, rounded once.

  Args:
    w_cand: `[M_p, K_w]`, `M_p >= num_rows` and `K_w >= K` multiples of 8, zero past K.
    e_cand: `[B, K, N]`, bfloat16 or float16, K a multiple of 8, N of 64.
    user_res: `[U, M_p, N]` float32.
    cand_to_user: `int32[B]`, values in `[0, U)`.
    config: tile sizes.
    num_rows: M, the rows of the output.
    interpret: run under the Mosaic GPU interpreter (CPU testing).
  """
  num_cands, _, n = e_cand.shape
  m = num_rows
  out = plgpu.kernel(
      functools.partial(_kernel, config=config),
      out_type=jax.ShapeDtypeStruct((num_cands, m, n), e_cand.dtype),
      grid=(_num_sms(interpret),),
      grid_names=("sm",),
      num_threads=_NUM_CONSUMERS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
      kernel_name="ikbo_linear_compression_mosaic_gpu",
  )
  return out(cand_to_user, w_cand, e_cand, user_res)
