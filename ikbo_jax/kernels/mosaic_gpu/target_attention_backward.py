"""Target attention backward, Pallas Mosaic GPU backend (Hopper): dq per query tile, dk/dv per user.

Both kernels recompute the probabilities from the forward's log-sum-exp,
`p = exp2(c * q k^T - lse2)` with `c = scale * log2(e)` and `lse2 = lse * log2(e)`,
as in FlashAttention-2, and subtract `delta = sum_j p_j dp_j - d_lse` from
`dp = dO V^T`; every GEMM is a WGMMA with a float32 accumulator.

- dq: one CTA per (packed query tile, head) of the forward (`query_tiles`).
  Each consumer warpgroup copies its 64 query rows and their output
  cotangents in by candidate index, and their lse, FlashAttention's estimate
  `delta0 = rowsum(out * d_out) - d_lse` and `d_lse` (gathered into the
  tiles' row order beforehand); a producer streams the user's K/V blocks
  through shared memory with TMA; per block the consumer computes `s = Q K^T`,
  `dp = dO V^T`, `ds0 = p * (dp - delta0)`, `dq0 += ds0 K`, `pk += P K` and
  the row sums of `ds0`. Those sums give the error of `delta0` (the rounding
  of `out` to 16 bits, which would dominate `ds` where the softmax is nearly
  one-hot; `kernels/exact_delta.py`), so
  `dq = dq0 - error * pk` is exact to float32 rounding. The consumer stores
  `scale * dq` back by candidate index and the exact `delta` in tile order
  for the dk/dv kernel.
- dk, dv: one CTA per (user, 128 keys, head); each consumer owns 64 keys in
  shared memory and walks every query block of the user's tiles (the
  producer copies them in by candidate index, the same rows the forward
  read), accumulating `dv += p^T dO` and `dk += ds^T Q` in float32 registers.
  A user's K/V gradient is thus summed over all of its candidates and query
  tokens inside one CTA, in a fixed order: deterministic, no atomics, no copy
  of K/V per candidate. Slots that only pad a block are masked out of the
  sums; keys at or past `kv_len` get zero gradients.

The interpreter takes WGMMA operands from shared memory only, so the GEMMs
with a register operand (`ds K`, `p^T dO`, `ds^T Q`) are plain dots there.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ikbo_jax.kernels.exact_delta import delta_error
from ikbo_jax.kernels.mosaic_gpu import inline
from ikbo_jax.kernels.mosaic_gpu.attention_gemms import accumulate_pv
from ikbo_jax.kernels.mosaic_gpu.common import (
    NUM_CONSUMERS, PRODUCER_REGISTERS, interpret_params, smem_transforms)
from ikbo_jax.kernels.mosaic_gpu.query_tiles import QueryTiles

BLOCK_ROWS = 64  # query rows (dq) or keys (dk/dv) per consumer: one WGMMA M extent
LOG2E = math.log2(math.e)
CONSUMER_REGISTERS = 232
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
  block_kv: int = 64  # keys per K/V block of the dq kernel (128 spills: 1.5x slower, H100)
  stages: int = 2  # K/V blocks (dq) or query blocks (dk/dv) in flight

  def __post_init__(self):
    if self.block_kv % 64:
      raise ValueError(f"block_kv must be a multiple of 64, got {self.block_kv}")
    if self.stages < 1:
      raise ValueError(f"stages must be >= 1, got {self.stages}")


def _gemm(acc_shape, a, b):
  """`a @ b` of two shared-memory operands (`b` may be a transposed view), as a WGMMA.

  The interpreter runs shared-memory WGMMAs too, so this is the same everywhere.
  """

  def run(acc_ref):
    plgpu.wgmma(acc_ref, a, b)
    return acc_ref[...]

  return pl.run_scoped(run, plgpu.ACC(acc_shape, _F32))


def _accumulate(acc, a, b_smem, interpret: bool):
  """`acc + a @ b` with `a` in registers."""
  return accumulate_pv(acc, a, b_smem, before_issue=lambda: None, then=lambda: None,
                       interpret=interpret)


def _accumulate_both(accs, lhs, b_smem, interpret: bool):
  """`tuple(acc + a @ b)` for two register operands `a` of one shared `b`, issued together."""
  if interpret:
    return tuple(_accumulate(acc, a, b_smem, interpret) for acc, a in zip(accs, lhs))

  def issue(acc_refs):
    for acc_ref, a in zip(acc_refs, lhs):
      plgpu.wgmma(acc_ref, a, b_smem)

  return pl.run_state(issue)(tuple(plgpu.ACC.init(acc) for acc in accs))


def _row_vector(ref, axis: int):
  """A `[64]` float32 vector from shared memory, laid out along `axis` of a WGMMA tile."""
  return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1 - axis))


def _iota(shape, axis: int):
  return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA)


def _await_last_releases(consumed, num_steps, stages: int):
  """Waits for the consumers' releases of the last `stages` steps, which no load waited for.

  Every barrier phase is then observed before the barriers go away (the
  interpreter checks this).
  """
  for back in range(stages, 0, -1):
    pl.when(num_steps >= back)(
        lambda back=back: plgpu.barrier_wait(consumed.at[lax.rem(num_steps - back, stages)]))


def _copy_rows_in(tiles_refs, tile, block, head, rows, vectors, barrier, slot_rows: int):
  """Copies block `block` of tile `tile` into shared memory; every copy arrives on `barrier`.

  `rows` pairs each `[B, T, H, D]` source with its shared-memory block, copied
  slot by slot from the slots' candidates; `vectors` pairs each
  `[num_tiles, H, blocks_per_tile, 64]` source (already in the tiles' row
  order) with its `[64]` buffer, copied whole.
  """
  cands_ref, piece_ref = tiles_refs
  row_start = piece_ref[tile, block] * BLOCK_ROWS
  for j in range(cands_ref.shape[-1]):
    cand = cands_ref[tile, block, j]
    for src, dst in rows:
      plgpu.copy_gmem_to_smem(src.at[cand, pl.ds(row_start, slot_rows), head],
                              dst.at[pl.ds(j * slot_rows, slot_rows)], barrier)
  for src, dst in vectors:
    plgpu.copy_gmem_to_smem(src.at[tile, head, block], dst, barrier)


def _dq_kernel(tile_user_ref, tile_kv_len_ref, cands_ref, num_valid_ref, piece_ref, q_ref, k_ref,
               v_ref, d_out_ref, lse2_ref, delta_ref, d_lse_ref, dq_ref, exact_delta_ref, scoped,
               *, scale: float, slot_rows: int, config: Config, interpret: bool):
  (q_smem, do_smem, lse_smem, delta_smem, d_lse_smem, k_smem, v_smem), barriers = scoped
  rows_ready, k_ready, v_ready, kv_consumed = barriers
  wg = lax.axis_index("wg")
  tile, head = lax.axis_index("tiles"), lax.axis_index("heads")
  block_kv, stages = config.block_kv, k_smem.shape[0]
  kv_len = tile_kv_len_ref[tile]
  kv_steps = pl.cdiv(kv_len, block_kv)
  cands_per_block = cands_ref.shape[-1]

  @pl.when(wg < NUM_CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    _copy_rows_in((cands_ref, piece_ref), tile, wg, head,
                  ((q_ref, q_smem.at[wg]), (d_out_ref, do_smem.at[wg])),
                  ((lse2_ref, lse_smem.at[wg]), (delta_ref, delta_smem.at[wg]),
                   (d_lse_ref, d_lse_smem.at[wg])),
                  rows_ready.at[wg], slot_rows)
    plgpu.barrier_wait(rows_ready.at[wg])
    lse2 = _row_vector(lse_smem.at[wg], 0)
    delta = _row_vector(delta_smem.at[wg], 0)
    head_dim = q_smem.shape[-1]
    tile_shape = (BLOCK_ROWS, block_kv)

    def step(i, carry, masked: bool):
      dq, pk, ds_sums = carry
      slot = lax.rem(i, stages)
      plgpu.barrier_wait(k_ready.at[slot])
      s = _gemm(tile_shape, q_smem.at[wg], k_smem.at[slot].T)
      p = jnp.exp2(s * (scale * LOG2E) - lax.broadcast_in_dim(lse2, tile_shape, [0]))
      if masked:
        p = jnp.where(_iota(tile_shape, 1) + i * block_kv < kv_len, p, 0.0)
      plgpu.barrier_wait(v_ready.at[slot])
      dp = _gemm(tile_shape, do_smem.at[wg], v_smem.at[slot].T)
      ds = p * (dp - lax.broadcast_in_dim(delta, tile_shape, [0]))
      dq, pk = _accumulate_both((dq, pk), (ds.astype(k_smem.dtype), p.astype(k_smem.dtype)),
                                k_smem.at[slot], interpret)
      plgpu.barrier_arrive(kv_consumed.at[slot])
      return dq, pk, ds_sums + inline.partial_row_sums(ds, interpret)

    zeros = plgpu.layout_cast(jnp.zeros((BLOCK_ROWS, head_dim), _F32), plgpu.Layout.WGMMA)
    no_sums = plgpu.layout_cast(jnp.zeros((BLOCK_ROWS,), _F32), plgpu.Layout.WGMMA.reduce(1))
    full_steps = kv_len // block_kv
    carry = lax.fori_loop(0, full_steps, functools.partial(step, masked=False),
                          (zeros, zeros, no_sums))
    dq, pk, ds_sums = lax.fori_loop(full_steps, kv_steps, functools.partial(step, masked=True),
                                    carry)
    error = delta_error(inline.finish_row_sums(ds_sums, interpret),
                        _row_vector(d_lse_smem.at[wg], 0))
    dq = dq - lax.broadcast_in_dim(error, dq.shape, [0]) * pk
    # The queries and delta0 are no longer read: their buffers take the results.
    q_smem.at[wg][...] = (dq * scale).astype(q_smem.dtype)
    delta_smem.at[wg][...] = delta + error
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(delta_smem.at[wg], exact_delta_ref.at[tile, head, wg])
    row_start = piece_ref[tile, wg] * BLOCK_ROWS
    num_valid = num_valid_ref[tile, wg]
    for j in range(cands_per_block):
      @pl.when(j < num_valid)
      def _store():
        plgpu.copy_smem_to_gmem(q_smem.at[wg, pl.ds(j * slot_rows, slot_rows)],
                                dq_ref.at[cands_ref[tile, wg, j], pl.ds(row_start, slot_rows),
                                          head])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == NUM_CONSUMERS)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
    user = tile_user_ref[tile]

    @pl.loop(0, kv_steps)
    def _(i):
      slot = lax.rem(i, stages)
      block = (user, pl.ds(i * block_kv, block_kv), head)
      pl.when(i >= stages)(lambda: plgpu.barrier_wait(kv_consumed.at[slot]))
      plgpu.copy_gmem_to_smem(k_ref.at[block], k_smem.at[slot], k_ready.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[block], v_smem.at[slot], v_ready.at[slot])

    _await_last_releases(kv_consumed, kv_steps, stages)


def _dkv_kernel(user_tile_start_ref, kv_len_ref, cands_ref, num_valid_ref, piece_ref, q_ref,
                k_ref, v_ref, d_out_ref, lse2_ref, delta_ref, dk_ref, dv_ref, scoped, *,
                scale: float, slot_rows: int, interpret: bool):
  (k_own, v_own, q_smem, do_smem, lse_smem, delta_smem), barriers = scoped
  own_ready, rows_ready, rows_consumed = barriers
  wg = lax.axis_index("wg")
  user, key_block, head = (lax.axis_index(a) for a in ("users", "keys", "heads"))
  stages = q_smem.shape[0]
  kv_len = kv_len_ref[user]
  first_key = key_block * (NUM_CONSUMERS * BLOCK_ROWS)
  # Query blocks of the user's tiles; none when the CTA's keys are all past kv_len.
  first_tile = user_tile_start_ref[user]
  num_blocks = jnp.where(first_key < kv_len,
                         (user_tile_start_ref[user + 1] - first_tile) * NUM_CONSUMERS, 0)

  def tile_and_block(i):
    return first_tile + lax.div(i, NUM_CONSUMERS), lax.rem(i, NUM_CONSUMERS)

  @pl.when(wg < NUM_CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    keys = pl.ds(first_key + wg * BLOCK_ROWS, BLOCK_ROWS)
    plgpu.copy_gmem_to_smem(k_ref.at[user, keys, head], k_own.at[wg], own_ready.at[wg])
    plgpu.copy_gmem_to_smem(v_ref.at[user, keys, head], v_own.at[wg], own_ready.at[wg])
    plgpu.barrier_wait(own_ready.at[wg])
    head_dim = k_own.shape[-1]
    tile_shape = (BLOCK_ROWS, BLOCK_ROWS)  # keys x query rows

    def step(i, carry):
      dk, dv = carry
      slot = lax.rem(i, stages)
      tile, block = tile_and_block(i)
      plgpu.barrier_wait(rows_ready.at[slot])
      s_t = _gemm(tile_shape, k_own.at[wg], q_smem.at[slot].T)
      lse2 = _row_vector(lse_smem.at[slot], 1)
      p_t = jnp.exp2(s_t * (scale * LOG2E) - lax.broadcast_in_dim(lse2, tile_shape, [1]))
      # Slots past num_valid repeat a real candidate: they must not add to the sums.
      live = _iota(tile_shape, 1) < num_valid_ref[tile, block] * slot_rows
      p_t = jnp.where(live, p_t, 0.0)
      dv = _accumulate(dv, p_t.astype(v_own.dtype), do_smem.at[slot], interpret)
      dp_t = _gemm(tile_shape, v_own.at[wg], do_smem.at[slot].T)
      delta = _row_vector(delta_smem.at[slot], 1)
      ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta, tile_shape, [1]))
      dk = _accumulate(dk, ds_t.astype(k_own.dtype), q_smem.at[slot], interpret)
      plgpu.barrier_arrive(rows_consumed.at[slot])
      return dk, dv

    zeros = plgpu.layout_cast(jnp.zeros((BLOCK_ROWS, head_dim), _F32), plgpu.Layout.WGMMA)
    dk, dv = lax.fori_loop(0, num_blocks, step, (zeros, zeros))
    in_history = _iota(dk.shape, 0) + first_key + wg * BLOCK_ROWS < kv_len
    k_own.at[wg][...] = jnp.where(in_history, dk * scale, 0.0).astype(k_own.dtype)
    v_own.at[wg][...] = jnp.where(in_history, dv, 0.0).astype(v_own.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_own.at[wg], dk_ref.at[user, keys, head])
    plgpu.copy_smem_to_gmem(v_own.at[wg], dv_ref.at[user, keys, head])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == NUM_CONSUMERS)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

    @pl.loop(0, num_blocks)
    def _(i):
      slot = lax.rem(i, stages)
      tile, block = tile_and_block(i)
      pl.when(i >= stages)(lambda: plgpu.barrier_wait(rows_consumed.at[slot]))
      _copy_rows_in((cands_ref, piece_ref), tile, block, head,
                    ((q_ref, q_smem.at[slot]), (d_out_ref, do_smem.at[slot])),
                    ((lse2_ref, lse_smem.at[slot]), (delta_ref, delta_smem.at[slot])),
                    rows_ready.at[slot], slot_rows)

    _await_last_releases(rows_consumed, num_blocks, stages)


def _in_tile_order(x, tiles: QueryTiles):
  """`[B, H, T]` rows gathered as the tiles' blocks hold them: `[num_tiles, H, blocks_per_tile, 64]`."""
  slot_rows = tiles.slot_rows
  rows = tiles.piece[:, :, None, None] * BLOCK_ROWS + jnp.arange(slot_rows)
  gathered = x[tiles.cands[..., None], :, rows]  # [num_tiles, blocks, cands_per_block, rows, H]
  num_tiles, blocks = tiles.cands.shape[:2]
  return jnp.transpose(gathered.reshape(num_tiles, blocks, BLOCK_ROWS, -1), (0, 3, 1, 2))


def backward(q, k, v, d_out, lse2, delta, d_lse, tiles: QueryTiles, tile_kv_len, kv_len, *,
             scale: float, config: Config = Config(), interpret: bool = False):
  """`(dq, dk, dv)` of target attention on the forward's packed query tiles.

  Args:
    q, d_out: `[B, T, H, D]` bfloat16/float16, `T == tiles.num_queries`, D in {64, 128}.
    k, v: `[U, S, H, D]`, S a multiple of 128 and of `config.block_kv`; rows at
      or past `kv_len` must be finite (zeros).
    lse2: `[B, H, T]` float32, the forward's lse times log2(e); `+inf` on query
      rows that only pad T (so they add nothing).
    delta: `[B, H, T]` float32, `rowsum(out * d_out) - d_lse` (the dq kernel corrects it).
    d_lse: `[B, H, T]` float32, the lse's cotangent (zeros without one).
    tiles: the forward's packed query tiles (`block_rows == 64`, `NUM_CONSUMERS` blocks each).
    tile_kv_len: `int32[num_tiles]`, each tile's user's length (0 for dead tiles).
    kv_len: `int32[U]` in `[0, S]`.
    scale: the logit scale.
    config: K/V block size and pipeline depth.
    interpret: run under the Mosaic GPU interpreter.
  """
  num_users, seq_len, num_heads, head_dim = k.shape
  key_tile = NUM_CONSUMERS * BLOCK_ROWS
  if seq_len % key_tile or seq_len % config.block_kv:
    raise ValueError(f"S={seq_len} must be a multiple of {key_tile} and of "
                     f"block_kv={config.block_kv}")
  dtype = q.dtype
  transforms = smem_transforms(head_dim, dtype)
  rows = lambda *lead: plgpu.SMEM((*lead, BLOCK_ROWS, head_dim), dtype, transforms=transforms)
  vector = lambda *lead: plgpu.SMEM((*lead, BLOCK_ROWS), _F32)
  # Each block's q and d_out arrive slot by slot, its vectors whole: lse and delta
  # (and, for dq, d_lse).
  slot_copies = 2 * tiles.cands_per_block
  # A TMA copy into shared memory must start 128-byte aligned, and a slot's
  # lse (T' float32s) may not: the vectors are gathered into the tiles' row
  # order here (B * T * H floats), so that a block takes each in one copy.
  lse2, delta, d_lse = (_in_tile_order(x, tiles) for x in (lse2, delta, d_lse))
  # Rows of slots past num_valid repeat some candidate, maybe one without keys
  # (lse = -inf, so p = inf): lse = +inf gives them p = 0, and the dq kernel
  # a finite delta to write for them.
  live = jnp.arange(BLOCK_ROWS) < tiles.num_valid[:, None, :, None] * tiles.slot_rows
  lse2 = jnp.where(live, lse2, jnp.inf)
  common = dict(num_threads=NUM_CONSUMERS + 1, thread_name="wg",
                compiler_params=plgpu.CompilerParams(approx_math=True),
                interpret=interpret_params(interpret))

  dq_stages = max(1, min(config.stages, seq_len // config.block_kv))
  kv_block = lambda: plgpu.SMEM((dq_stages, config.block_kv, head_dim), dtype,
                                transforms=transforms)

  def dq_entry(*refs):
    pl.run_scoped(
        lambda *scoped: _dq_kernel(*refs, scoped, scale=scale, slot_rows=tiles.slot_rows,
                                   config=config, interpret=interpret),
        (rows(NUM_CONSUMERS), rows(NUM_CONSUMERS), vector(NUM_CONSUMERS), vector(NUM_CONSUMERS),
         vector(NUM_CONSUMERS), kv_block(), kv_block()),
        (plgpu.Barrier(num_arrivals=slot_copies + 3, num_barriers=NUM_CONSUMERS),
         plgpu.Barrier(num_barriers=dq_stages), plgpu.Barrier(num_barriers=dq_stages),
         plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=dq_stages)),
        collective_axes="wg")

  dq, delta = plgpu.kernel(
      dq_entry, out_type=(jax.ShapeDtypeStruct(q.shape, dtype),
                          jax.ShapeDtypeStruct(delta.shape, _F32)),
      grid=(tiles.num_tiles, num_heads), grid_names=("tiles", "heads"),
      kernel_name="ikbo_target_attention_dq_mosaic_gpu", **common,
  )(tiles.user, tile_kv_len, tiles.cands, tiles.num_valid, tiles.piece, q, k, v, d_out, lse2,
    delta, d_lse)

  dkv_stages = max(1, config.stages)

  def dkv_entry(*refs):
    pl.run_scoped(
        lambda *scoped: _dkv_kernel(*refs, scoped, scale=scale, slot_rows=tiles.slot_rows,
                                    interpret=interpret),
        (rows(NUM_CONSUMERS), rows(NUM_CONSUMERS), rows(dkv_stages), rows(dkv_stages),
         vector(dkv_stages), vector(dkv_stages)),
        (plgpu.Barrier(num_arrivals=2, num_barriers=NUM_CONSUMERS),
         plgpu.Barrier(num_arrivals=slot_copies + 2, num_barriers=dkv_stages),
         plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=dkv_stages)),
        collective_axes="wg")

  grad_type = jax.ShapeDtypeStruct(k.shape, dtype)
  dk, dv = plgpu.kernel(
      dkv_entry, out_type=(grad_type, grad_type),
      grid=(num_users, seq_len // key_tile, num_heads), grid_names=("users", "keys", "heads"),
      kernel_name="ikbo_target_attention_dkv_mosaic_gpu", **common,
  )(tiles.user_tile_start, kv_len, tiles.cands, tiles.num_valid, tiles.piece, q, k, v, d_out,
    lse2, delta)
  return dq, dk, dv
