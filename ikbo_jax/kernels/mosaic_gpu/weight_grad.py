"""Weight gradient of the candidate GEMM, Pallas Mosaic GPU backend (Hopper).

Computes `dW_cand^T = sum_b E[b] @ dOut[b]^T` for `E: [B, K, N]` and
`dOut: [B, M, N]`, i.e. one GEMM whose contraction runs over both the candidate
batch and N. The output is small (`[K, M]`) and the contraction long
(`B * N`), so the kernel splits the contraction: CTA `(i, j, s)` owns output
tile `(i, j)` and candidates `[s * C, (s + 1) * C)`, and writes a float32
partial sum; the `splits` partials are added in XLA (a few MB). No atomics, so
the result is deterministic.

The output is computed transposed (`[K, M]`, not `[M, K]`) because it tiles
better at the published shape: `K_cand = 872` and `M = 433` cover 896 x 448
with 128-row by 224-column tiles (94% useful), where `[M, K]` would cover
512 x 896 (82%).

Inside a CTA a producer warpgroup streams `E[b]` rows `[128, tile_k]` and
`dOut[b]` rows `[tile_n, tile_k]` through shared memory with TMA; two consumer
warpgroups each own 64 rows of the `E` tile and run WGMMA against the `dOut`
tile read transposed from shared memory. Loads past the end of `B`, `K` or `M`
read zeros (TMA bounds handling), so the last split and ragged tiles need no
masks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ikbo_jax._padding import round_up
from ikbo_jax.kernels.mosaic_gpu.common import (
    NUM_CONSUMERS, PRODUCER_REGISTERS, compiler_params, interpret_params, num_sms,
    pipeline_result, smem_transforms)

_MAX_WGMMA_N = 256


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiling: each consumer computes `tile_m` rows of `K` by `tile_n` columns of `M`.

  `tile_n=None` splits M into the fewest tiles of at most 256 columns, each a
  multiple of `epi_tile_n`.
  """

  tile_m: int = 64
  tile_n: int | None = None
  tile_k: int = 64
  max_concurrent_steps: int = 4
  epi_tile_n: int = 32

  @property
  def cta_tile_m(self) -> int:
    return NUM_CONSUMERS * self.tile_m

  def for_m(self, m: int) -> Config:
    if self.tile_n is not None:
      return self
    num_tiles = pl.cdiv(m, _MAX_WGMMA_N)
    return dataclasses.replace(self, tile_n=round_up(pl.cdiv(m, num_tiles), self.epi_tile_n))


def _kernel(e_gmem, d_out_gmem, partial_gmem, *, config: Config, cands_per_split: int):
  n = e_gmem.shape[2]
  tile_m, tile_n, tile_k, epi_tile_n = (
      config.tile_m, config.tile_n, config.tile_k, config.epi_tile_n)
  mi, ni, split = lax.axis_index("m"), lax.axis_index("n"), lax.axis_index("split")
  first_cand = split * cands_per_split
  in_transforms = smem_transforms(tile_k, e_gmem.dtype)

  def pipeline(compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        mma_step,
        grid=(cands_per_split, n // tile_k),
        memory_registers=PRODUCER_REGISTERS,
        in_specs=[
            plgpu.BlockSpec((None, config.cta_tile_m, tile_k),
                            lambda b, kk: (first_cand + b, mi, kk), transforms=in_transforms),
            plgpu.BlockSpec((None, tile_n, tile_k),
                            lambda b, kk: (first_cand + b, ni, kk), transforms=in_transforms),
        ],
        wg_axis="wg",
        num_compute_wgs=NUM_CONSUMERS,
        max_concurrent_steps=config.max_concurrent_steps,
        compute_context=compute_context,
    )

  def mma_step(_, e_smem, d_out_smem, acc_ref):
    wg = lax.axis_index("wg")
    plgpu.wgmma(acc_ref, e_smem.at[pl.ds(wg * tile_m, tile_m)],
                d_out_smem.transpose((1, 0)))
    plgpu.wgmma_wait(0)
    return acc_ref

  # Shared memory is allocated by all three warpgroups together (the pipeline's
  # buffers and the consumers' output staging).
  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=pipeline(lambda _: None).get_allocations(e_gmem, d_out_gmem),
      out_smem=plgpu.SMEM((NUM_CONSUMERS, 2, tile_m, epi_tile_n), jnp.float32,
                          transforms=smem_transforms(epi_tile_n, jnp.float32)),
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, out_smem):
    wg = lax.axis_index("wg")

    def compute_context(eval_pipeline):
      acc = pipeline_result(eval_pipeline, (tile_m, tile_n))
      rows = pl.ds(mi * config.cta_tile_m + wg * tile_m, tile_m)
      for epi in range(tile_n // epi_tile_n):
        slot = epi % 2
        # The slot's previous TMA store must have read it before we overwrite.
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        out_smem[wg, slot] = acc[:, epi * epi_tile_n:(epi + 1) * epi_tile_n]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            out_smem.at[wg, slot],
            partial_gmem.at[split, rows, pl.ds(ni * tile_n + epi * epi_tile_n, epi_tile_n)])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pipeline(compute_context)(e_gmem, d_out_gmem, allocations=pipeline_allocs)


def weight_grad(e, d_out, *, config: Config = Config(), interpret: bool = False):
  """`sum_b e[b] @ d_out[b]^T` in float32, shape `[K, M]`.

  Args:
    e: `[B, K, N]`, bfloat16 or float16, K a multiple of 8, N of `config.tile_k`.
    d_out: `[B, M, N]`, same dtype, M a multiple of 8.
    config: tile sizes.
    interpret: run under the Mosaic GPU interpreter (CPU testing).
  """
  num_cands, k, n = e.shape
  m = d_out.shape[1]
  config = config.for_m(m)
  grid_m, grid_n = pl.cdiv(k, config.cta_tile_m), pl.cdiv(m, config.tile_n)
  # Enough splits of the candidate batch to give every SM one CTA.
  splits = max(1, min(num_cands, num_sms(interpret) // (grid_m * grid_n)))
  cands_per_split = pl.cdiv(num_cands, splits)
  splits = pl.cdiv(num_cands, cands_per_split)
  partial = plgpu.kernel(
      functools.partial(_kernel, config=config, cands_per_split=cands_per_split),
      out_type=jax.ShapeDtypeStruct(
          (splits, grid_m * config.cta_tile_m, grid_n * config.tile_n), jnp.float32),
      grid=(grid_m, grid_n, splits),
      grid_names=("m", "n", "split"),
      num_threads=NUM_CONSUMERS + 1,
      thread_name="wg",
      compiler_params=compiler_params(),
      interpret=interpret_params(interpret),
      kernel_name="ikbo_linear_compression_weight_grad_mosaic_gpu",
  )(e, d_out)
  return partial.sum(axis=0)[:k, :m]
