"""Mosaic GPU operations that Pallas does not expose, written with `plgpu.inline_mgpu`.

- Row sums of a WGMMA-layout array kept per thread: each of the 4 lanes that
  share a row holds the sum of its own columns only, so an online softmax can
  accumulate them step after step and exchange lanes once at the end instead
  of twice per step (as FlashAttention does).
- `rescale_rows`: the online softmax's `acc *= alpha`, skipped by each warp
  whose rows all have `alpha == 1` (multiplying by 1 is exact, so the bits
  do not change).
- Named hardware barriers (`bar.sync` / `bar.arrive`) for the consumers'
  schedule: one instruction each way, where an mbarrier in shared memory costs
  an atomic and a polling loop.

None of these runs under the Mosaic GPU interpreter; the kernel keeps the
plain `jnp` and mbarrier versions for it.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, scf, vector

# Barrier 0 is the CTA-wide barrier and 1-4 are Mosaic GPU's per-warpgroup ones.
FIRST_FREE_BARRIER_ID = 8
_LANES_PER_ROW = 4  # WGMMA layout: 4 consecutive lanes hold one row's columns


def _add(a, b):
  return arith.addf(a, b)


def _row_layout():
  return plgpu.Layout.WGMMA.reduce(1)


def row_sums_in_thread(x: jnp.ndarray) -> jnp.ndarray:
  """`x [64, N]` float32, WGMMA layout: per-thread partial row sums, `[64]` in the row layout.

  The result is not replicated across the 4 lanes of a row, as the row layout
  claims: only elementwise operations with row values may follow, then
  `sum_row_partials`.
  """

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                     return_type=plgpu.ShapeDtypeStruct((x.shape[0],), jnp.float32,
                                                        layout=_row_layout()))
  def partial_sums(_, x: mgpu.FragmentedArray):
    layout = x.layout
    reduced = layout.tiling.tile_dimension(1)
    regs = x.registers
    remaining = tuple(1 if r else d for r, d in zip(reduced, regs.shape))
    reduced_shape = tuple(d if r else 1 for r, d in zip(reduced, regs.shape))
    out = np.empty(remaining, dtype=object)
    f32 = ir.F32Type.get()
    for out_idx in np.ndindex(remaining):
      # Four interleaved chains: the adds need not wait for each other.
      chains = [None] * 4
      for i, red_idx in enumerate(np.ndindex(reduced_shape)):
        reg = regs[tuple(o + r for o, r in zip(out_idx, red_idx))]
        chains[i % 4] = reg if chains[i % 4] is None else _add(chains[i % 4], reg)
      total = functools.reduce(_add, [c for c in chains if c is not None])
      [vec_len] = ir.VectorType(total.type).shape
      elems = [vector.extract(total, dynamic_position=[],
                              static_position=ir.DenseI64ArrayAttr.get([j]))
               for j in range(vec_len)]
      out[out_idx] = vector.broadcast(ir.VectorType.get((1,), f32),
                                      functools.reduce(_add, elems))
    out_layout = layout.reduce((1,))
    return mgpu.FragmentedArray(_registers=out.reshape(out_layout.registers_shape((x.shape[0],))),
                                _layout=out_layout, _is_signed=None)

  return partial_sums(x)


def partial_row_sums(x: jnp.ndarray, interpret: bool) -> jnp.ndarray:
  """Row sums of `x [64, N]` to accumulate across blocks, `finish_row_sums` once at the end.

  On the GPU each thread keeps partial sums (`row_sums_in_thread`), its lanes
  exchanged once; the interpreter sums whole rows.
  """
  return x.sum(axis=1) if interpret else row_sums_in_thread(x)


def finish_row_sums(partials: jnp.ndarray, interpret: bool) -> jnp.ndarray:
  """The whole row sums from accumulated `partial_row_sums`."""
  return partials if interpret else sum_row_partials(partials)


def sum_row_partials(partials: jnp.ndarray) -> jnp.ndarray:
  """Adds up `row_sums_in_thread` partials across the lanes of each row (replicated again)."""

  @plgpu.inline_mgpu(arg_types=(_row_layout(),),
                     return_type=plgpu.ShapeDtypeStruct(partials.shape, jnp.float32,
                                                        layout=_row_layout()))
  def exchange(_, partials: mgpu.FragmentedArray):
    regs = np.empty_like(partials.registers)
    for idx, reg in np.ndenumerate(partials.registers):
      stride = 1
      while stride < _LANES_PER_ROW:
        reg = _add(reg, mgpu_utils.shfl_bfly(reg, stride))
        stride *= 2
      regs[idx] = reg
    return mgpu.FragmentedArray(_registers=regs, _layout=partials.layout, _is_signed=None)

  return exchange(partials)


def _warp_any(pred):
  """Whether `pred` (i1) holds in any lane of the warp."""
  i32 = ir.IntegerType.get_signless(32)
  flag = llvm.inline_asm(
      i32, [arith.extui(i32, pred)],
      "{ .reg .pred p; setp.ne.u32 p, $1, 0; vote.sync.any.pred p, p, 0xffffffff;"
      " selp.u32 $0, 1, 0, p; }", "=r,r", convergent=True)
  return arith.cmpi(arith.CmpIPredicate.ne, flag, arith.constant(i32, 0))


def rescale_rows(acc: jnp.ndarray, alpha: jnp.ndarray) -> jnp.ndarray:
  """`acc * alpha[:, None]` for `acc [64, N]` in the WGMMA layout.

  A warp whose `alpha` is 1 in every lane branches past the multiplies.
  """

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, _row_layout()),
                     return_type=plgpu.ShapeDtypeStruct(acc.shape, jnp.float32,
                                                        layout=plgpu.Layout.WGMMA))
  def rescale(_, acc: mgpu.FragmentedArray, alpha: mgpu.FragmentedArray):
    one = arith.constant(ir.F32Type.get(), 1.0)
    changed = None
    for reg in alpha.registers.flat:
      for j in range(ir.VectorType(reg.type).shape[0]):
        elem = vector.extract(reg, dynamic_position=[],
                              static_position=ir.DenseI64ArrayAttr.get([j]))
        ne = arith.cmpf(arith.CmpFPredicate.UNE, elem, one)
        changed = ne if changed is None else arith.ori(changed, ne)
    flat = list(acc.registers.flat)
    if_op = scf.IfOp(_warp_any(changed), [r.type for r in flat], has_else=True)
    with ir.InsertionPoint(if_op.then_block):
      scaled = acc * alpha.broadcast_in_dim(acc.shape, (0,), acc.layout)
      scf.yield_(list(scaled.registers.flat))
    with ir.InsertionPoint(if_op.else_block):
      scf.yield_(flat)
    regs = np.array(list(if_op.results), dtype=object).reshape(acc.registers.shape)
    return mgpu.FragmentedArray(_registers=regs, _layout=acc.layout, _is_signed=None)

  return rescale(acc, alpha)


def _barrier_instruction(instruction: str, barrier_id: int, num_threads: int):
  @plgpu.inline_mgpu()
  def emit(_):
    mgpu_utils.inline_ptx(f"{instruction} {barrier_id}, {num_threads};",
                          has_side_effects=True, convergent=True)

  emit()


def named_barrier_sync(barrier_id: int, num_threads: int):
  """`bar.sync`: waits until `num_threads` threads reached barrier `barrier_id` (this warp too)."""
  _barrier_instruction("bar.sync", barrier_id, num_threads)


def named_barrier_arrive(barrier_id: int, num_threads: int):
  """`bar.arrive`: counts this warp's threads at barrier `barrier_id` and goes on."""
  _barrier_instruction("bar.arrive", barrier_id, num_threads)
