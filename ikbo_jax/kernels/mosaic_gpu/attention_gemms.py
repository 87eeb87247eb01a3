"""The attention consumers' tensor-core work: their turns, and the WGMMAs issued in one.

Two consumer warpgroups share the tensor cores. FlashAttention-3's ping-pong
has them take turns, so that one's softmax runs while the other's GEMMs do
(`Turns`). Within a turn a consumer issues its `P V` (`accumulate_pv`) and
then the next `Q K^T`. On the GPU the GEMMs are WGMMAs; the Mosaic GPU interpreter takes
WGMMA operands from shared memory only, so there they are plain dots.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ikbo_jax.kernels.mosaic_gpu import inline
from ikbo_jax.kernels.mosaic_gpu.common import NUM_CONSUMERS


def _plain_pv(acc, p, v_smem):
  return acc + jnp.dot(p, v_smem[...], preferred_element_type=jnp.float32)


def accumulate_pv(acc, p, v_smem, *, before_issue, then, interpret: bool):
  """`acc + p @ v` (p in registers, v in shared memory): `before_issue()`, the WGMMA, `then()`.

  On the GPU the WGMMA accumulates into `acc`'s registers in place while
  `then()` runs. `before_issue()` runs after the WGMMA fence: ptxas must
  finish writing `acc` and `p` before the fence, so work that produces them
  (the rescale, the conversion to 16 bits) cannot sink past `before_issue()`
  (a turn's barrier) and delay the issue once the turn has begun.
  """
  if interpret:
    before_issue()
    then()
    return _plain_pv(acc, p, v_smem)

  def issue(acc_ref):
    before_issue()
    plgpu.wgmma(acc_ref, p, v_smem)
    then()

  return pl.run_state(issue)(plgpu.ACC.init(acc))


class Turns:
  """The consumers' turns at the tensor cores, FlashAttention-3's ping-pong.

  A turn is an item's first `Q K^T`, or a `P @ V` with the `Q K^T` after it
  (the next block's, or the next item's first); the two consumers take turns
  alternately, across items too, so each one's softmax runs while the other's
  GEMMs do. A consumer syncs on its own barrier before its turn and arrives
  at the other's after issuing it. A consumer never arrives twice at a
  barrier before the other has synced on it (it must sync on its own in
  between, which needs the other's arrival), as both barrier kinds need.

  On the GPU the barriers are named hardware barriers (one instruction each
  way); the interpreter, which has none, uses one mbarrier per consumer.
  """

  _THREADS = 2 * 128  # one consumer warpgroup syncs, the other arrives

  def __init__(self, wg, mbarriers, named: bool):
    self.wg, self.mbarriers, self.named = wg, mbarriers, named

  def _for_each_consumer(self, op):
    for c in range(NUM_CONSUMERS):
      pl.when(self.wg == c)(lambda c=c: op(c))

  def _sync(self, c):
    if self.named:
      inline.named_barrier_sync(inline.FIRST_FREE_BARRIER_ID + c, self._THREADS)
    else:
      plgpu.barrier_wait(self.mbarriers.at[c])

  def _arrive(self, c):
    if self.named:
      inline.named_barrier_arrive(inline.FIRST_FREE_BARRIER_ID + c, self._THREADS)
    else:
      plgpu.barrier_arrive(self.mbarriers.at[c])

  def sync(self):
    """Waits for this consumer's turn."""
    self._for_each_consumer(self._sync)

  def pass_on(self):
    """Ends this consumer's turn: the other's starts."""
    self._for_each_consumer(lambda c: self._arrive((c + 1) % NUM_CONSUMERS))

  def start_kernel(self):
    pl.when(self.wg == 1)(lambda: self._arrive(0))  # consumer 0 takes the first turn

  def end_kernel(self):
    pl.when(self.wg == 0)(lambda: self._sync(0))  # consumer 1's last pass, so none is pending
