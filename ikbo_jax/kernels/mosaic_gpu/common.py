"""Helpers shared by the Mosaic GPU kernels: shared-memory layouts and the SM count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# Consumer warpgroups per CTA; a producer warpgroup streams their operands.
NUM_CONSUMERS = 2
# Registers left to the producer warpgroup, which only issues TMA copies.
PRODUCER_REGISTERS = 40


def smem_transforms(minor_elems: int, dtype, rows: int = 8) -> tuple:
  """TMA/WGMMA shared-memory transforms: `rows`-row tiles, the widest swizzle that fits."""
  swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
  swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
  return plgpu.TilingTransform((rows, swizzle_elems)), plgpu.SwizzleTransform(swizzle)


def num_sms(interpret: bool) -> int:
  """SMs of the target GPU (an abstract device's when lowering without one)."""
  if interpret:
    return 2  # A few simulated SMs keep the persistent loops honest and the interpreter fast.
  if abstract_device := jax.sharding.get_abstract_mesh().abstract_device:
    return abstract_device.num_cores
  return jax.devices()[0].core_count


def compiler_params() -> plgpu.CompilerParams:
  return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def interpret_params(interpret: bool):
  return plgpu.InterpretGPUParams() if interpret else None


def pipeline_result(eval_pipeline, shape: tuple[int, int]):
  """Runs a K pipeline (`eval_pipeline(acc_ref)`) into a float32 WGMMA accumulator; its value."""

  def run(acc_ref):
    eval_pipeline(acc_ref)
    return acc_ref[...]

  return pl.run_scoped(run, acc_ref=plgpu.ACC(shape, jnp.float32))
