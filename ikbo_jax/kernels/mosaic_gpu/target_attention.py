"""Target attention forward, Pallas Mosaic GPU backend (Hopper): packed candidate queries.

One CTA owns one packed query tile (see `query_tiles`) and one head:
`NUM_CONSUMERS` row blocks of 64 query rows, all from candidates of one user.
A producer warpgroup streams that user's K/V blocks through shared memory with
TMA, and each K/V block serves every candidate of the tile, which is what
makes the kernel cheaper than attention over a broadcast copy (and, unlike
cuDNN on a packed layout, it needs no sorted or contiguous candidates).

The consumers follow the FlashAttention-3 schedule: WGMMA for `Q K^T` and
`P V` with float32 accumulators, the online softmax in base 2 with the logit
scale folded into the exponent, and turn barriers that alternate the
two consumers between tensor-core work and softmax (`attention_gemms.Turns`).
Each consumer copies its
candidates' query rows in by index, one item ahead (two buffers, so the copy
hides behind the current item's first step), and stores output rows (and the
lse) back by index, dropping the slots that only pad the block.

Per-user lengths: the tile runs `ceil(kv_len / block_kv)` K/V steps, and only
the last step masks keys past `kv_len`. A tile whose user has `kv_len == 0`
writes zeros and `lse = -inf`.

Self + target attention in one launch (`SelfAttention`): the first work items
are tiles of 128 rows of each user's own query sequence, attending to the
same per-user K/V, and the candidate tiles follow; the persistent loop deals
out both kinds alike, so neither leaves SMs idle.

Two-level attention in one launch (`GroupRegion`): each candidate tile (all
its candidates of one group, so of one user) streams its user's K/V blocks and
then its group's through the same pipeline, under one online softmax; keys past
either region's length are masked. Causal user tiles skip the
K/V blocks past their last query and mask only the diagonal block; query rows
past `kv_len` are written as zeros.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ikbo_jax.kernels.mosaic_gpu.attention_gemms import Turns
from ikbo_jax.kernels.mosaic_gpu.common import (
    NUM_CONSUMERS, PRODUCER_REGISTERS, interpret_params, num_sms, smem_transforms)
from ikbo_jax.kernels.mosaic_gpu.query_tiles import QueryTiles
from ikbo_jax.kernels.mosaic_gpu.target_attention_consumer import Consumer
from ikbo_jax.kernels.mosaic_gpu.target_attention_items import BLOCK_ROWS, Refs, WorkItems

__all__ = ["BLOCK_ROWS", "NUM_CONSUMERS", "Config", "GroupRegion", "SelfAttention", "forward"]

_CONSUMER_REGISTERS = 232


@dataclasses.dataclass(frozen=True)
class Config:
  block_kv: int = 128
  max_concurrent_steps: int = 2
  # One CTA per SM looping over the work items (the producer then prefetches
  # the next item's K/V during this item's epilogue), or one CTA per item.
  # Persistent measured faster at every S on the H200 (0.269 vs 0.287 ms at S=1024).
  persistent: bool = True
  # FlashAttention-4's lazy rescale: a row keeps its running max until a block's
  # exceeds it by more than 2**8 (so P <= 256), and a warp whose rows all keep
  # theirs skips `acc *= alpha` (`inline.rescale_rows`, GPU only). H200 at the
  # published shape: target 1.5-3.0% faster at S=512/1024/4096, self + target 2.2-3.6%.
  lazy_rescale: bool = True

  def __post_init__(self):
    if self.block_kv % 64:
      raise ValueError(f"block_kv must be a multiple of 64, got {self.block_kv}")
    if self.max_concurrent_steps < 2:
      raise ValueError(f"max_concurrent_steps must be >= 2, got {self.max_concurrent_steps}")


@dataclasses.dataclass(frozen=True)
class SelfAttention:
  """User query tiles run in the same launch: `q [U, S, H, D]`, `kv_len int32[U]` in `[0, S]`."""

  q: jax.Array
  kv_len: jax.Array
  causal: bool = False


def _kernel(*refs, scale: float, slot_rows: int, causal: bool, config: Config, interpret: bool):
  refs = Refs(*refs)
  wg = lax.axis_index("wg")
  items = WorkItems.create(refs, block_kv=config.block_kv, causal=causal)
  # On the GPU the turns pass on named hardware barriers; the interpreter has
  # none, so it uses an mbarrier per consumer.
  turns = Turns(wg, refs.turn_barriers, named=not interpret)

  @pl.when(wg < NUM_CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
    Consumer(wg, refs, items, turns, scale, slot_rows, causal, config.lazy_rescale,
             interpret).run()

  @pl.when(wg == NUM_CONSUMERS)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
    _produce(refs, items)


def _produce(refs: Refs, items: WorkItems):
  """Streams each item's K/V blocks into the pipeline slots, up to `stages` ahead of the consumers.

  It runs ahead across items too: the next item's first K/V blocks load
  during this one's epilogue.
  """
  stages = refs.k_smem.shape[0]

  def item_body(i, first_step):
    item = items.info(i)

    @pl.loop(0, item.kv_steps)
    def _(step):
      pipeline_step = first_step + step
      slot = lax.rem(pipeline_step, stages)
      # K and V slots free up separately: a block's K is done half a step
      # before its V, so the next K load need not wait for the P V.
      pl.when(pipeline_step >= stages)(lambda: plgpu.barrier_wait(refs.k_consumed.at[slot]))
      _load_block(items, item, step, refs.k, refs.group_k, refs.k_smem.at[slot],
                  refs.k_ready.at[slot])
      pl.when(pipeline_step >= stages)(lambda: plgpu.barrier_wait(refs.v_consumed.at[slot]))
      _load_block(items, item, step, refs.v, refs.group_v, refs.v_smem.at[slot],
                  refs.v_ready.at[slot])

    return first_step + item.kv_steps

  total_steps = lax.fori_loop(0, items.count, item_body, jnp.int32(0))
  # Observe the consumers' last releases too, so every barrier phase is
  # waited for before the barriers go away (the interpreter checks this).
  for back in range(stages, 0, -1):
    @pl.when(total_steps >= back)
    def _():
      slot = lax.rem(total_steps - back, stages)
      plgpu.barrier_wait(refs.k_consumed.at[slot])
      plgpu.barrier_wait(refs.v_consumed.at[slot])


def _load_block(items: WorkItems, item, step, user_ref, group_ref, smem, ready):
  """Copies the item's K/V block `step` into `smem`: the user's, or past them the group's."""
  block_kv = items.block_kv
  user_block = (item.user, pl.ds(step * block_kv, block_kv), item.head)
  if not items.has_group:
    plgpu.copy_gmem_to_smem(user_ref.at[user_block], smem, ready)
    return
  start = step * block_kv
  in_group = start >= item.group_start
  group_block = (item.group, pl.ds(jnp.maximum(start - item.group_start, 0), block_kv), item.head)
  pl.when(jnp.logical_not(in_group))(
      lambda: plgpu.copy_gmem_to_smem(user_ref.at[user_block], smem, ready))
  pl.when(in_group)(lambda: plgpu.copy_gmem_to_smem(group_ref.at[group_block], smem, ready))


@dataclasses.dataclass(frozen=True)
class GroupRegion:
  """A second key region per candidate tile, after its user's keys (two-level attention).

  `k`, `v`: `[G, S_group, H, D]`, S_group a multiple of the K/V block; `tile_group`:
  `int32[num_tiles]`, each tile's group (a valid id also for dead tiles);
  `tile_kv_len`: `int32[num_tiles]`, that group's valid keys (0 for dead tiles).
  """

  k: jax.Array
  v: jax.Array
  tile_group: jax.Array
  tile_kv_len: jax.Array


def forward(q, k, v, tiles: QueryTiles, tile_kv_len, *, scale: float, save_lse: bool,
            self_attention: SelfAttention | None = None, group: GroupRegion | None = None,
            config: Config = Config(), interpret: bool = False):
  """Packed-query target attention, and optionally the users' self-attention in the same launch.

  Args:
    q: `[B, T, H, D]` bfloat16/float16, `T == tiles.num_queries`, D a multiple of 64.
    k, v: `[U, S, H, D]`, same dtype, S a multiple of `config.block_kv` (TMA
      would zero-fill a ragged tail, but the interpreter clamps the slice).
    tiles: the packed query tiles (`block_rows == 64`, `NUM_CONSUMERS` blocks each).
    tile_kv_len: `int32[num_tiles]`, the valid keys of each tile's user (0 for
      dead tiles), in `[0, S]`.
    scale: the logit scale.
    save_lse: also return the float32 lse of the candidate queries, `[B, H, T]`.
    self_attention: the users' own queries (`q [U, S, H, D]`, S a multiple of
      128) to run in the same launch, or None.
    group: a second key region for every candidate tile, one softmax over both
      (not with `self_attention`), or None.
    config: K/V block size and pipeline depth.
    interpret: run under the Mosaic GPU interpreter.

  Returns:
    `out [B, T, H, D]`, `lse [B, H, T]` (natural log) or None, and the users'
    self-attention output `[U, S, H, D]` or None.
  """
  num_cands, num_queries, num_heads, head_dim = q.shape
  num_users, seq_len = k.shape[:2]
  if seq_len % config.block_kv:
    raise ValueError(f"S={seq_len} must be a multiple of block_kv={config.block_kv}")
  tile_rows = NUM_CONSUMERS * BLOCK_ROWS
  if self_attention is not None and seq_len % tile_rows:
    raise ValueError(f"S={seq_len} must be a multiple of {tile_rows} with self-attention")
  dtype = q.dtype
  has_self, has_group = self_attention is not None, group is not None
  if has_self and has_group:
    raise ValueError("a launch runs self-attention or a second key region, not both")
  max_steps = (seq_len + (group.k.shape[1] if has_group else 0)) // config.block_kv
  if has_group and group.k.shape[1] % config.block_kv:
    raise ValueError(f"S_group={group.k.shape[1]} must be a multiple of "
                     f"block_kv={config.block_kv}")
  # No more pipeline stages than K/V blocks: the rest would only take shared memory.
  stages = min(config.max_concurrent_steps, max_steps)
  q_transforms = smem_transforms(head_dim, dtype)

  def entry(*refs):
    refs = list(refs)
    in_refs = refs[:8]
    del refs[:8]
    group_refs = [refs.pop(0) for _ in range(4)] if has_group else [None] * 4
    user_kv_len_ref, q_user_ref = (refs.pop(0), refs.pop(0)) if has_self else (None, None)
    outs = refs
    out_ref = outs.pop(0)
    lse_ref = outs.pop(0) if save_lse else None
    out_user_ref = outs.pop(0) if has_self else None
    scratch = (
        # Two buffers per consumer: the next item's queries load during this item.
        plgpu.SMEM((2, NUM_CONSUMERS, BLOCK_ROWS, head_dim), dtype, transforms=q_transforms),
        plgpu.SMEM((stages, config.block_kv, head_dim), dtype, transforms=q_transforms),
        plgpu.SMEM((stages, config.block_kv, head_dim), dtype, transforms=q_transforms),
        plgpu.SMEM((2, NUM_CONSUMERS, BLOCK_ROWS), jnp.float32) if save_lse else None,
    )
    pl.run_scoped(
        lambda smem, ready, consumed, turn_barriers: _kernel(
            *in_refs, *group_refs, user_kv_len_ref, q_user_ref, out_ref, lse_ref, out_user_ref,
            *smem, *ready,
            *consumed, turn_barriers, scale=scale, slot_rows=tiles.slot_rows,
            causal=has_self and self_attention.causal, config=config, interpret=interpret),
        scratch,
        (plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_barriers=stages),
         plgpu.Barrier(num_arrivals=tiles.cands_per_block, num_barriers=2 * NUM_CONSUMERS)),
        (plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),) * 2,
        plgpu.Barrier(num_barriers=NUM_CONSUMERS),  # the consumers' turns
        collective_axes="wg",
    )

  out_type = [jax.ShapeDtypeStruct(q.shape, dtype)]
  if save_lse:
    out_type.append(jax.ShapeDtypeStruct((num_cands, num_heads, num_queries), jnp.float32))
  operands = [tiles.user, tile_kv_len, tiles.cands, tiles.num_valid, tiles.piece, q, k, v]
  if has_group:
    operands += [group.k, group.v, group.tile_group, group.tile_kv_len]
  num_tiles = tiles.num_tiles
  if has_self:
    out_type.append(jax.ShapeDtypeStruct(k.shape, dtype))
    operands += [self_attention.kv_len, self_attention.q]
    num_tiles += num_users * (seq_len // tile_rows)
  num_items = num_tiles * num_heads
  results = plgpu.kernel(
      entry,
      out_type=out_type,
      grid=(min(num_items, num_sms(interpret)) if config.persistent else num_items,),
      grid_names=("programs",),
      num_threads=NUM_CONSUMERS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret_params(interpret),
      kernel_name=("ikbo_self_target_attention_mosaic_gpu" if has_self
                   else "ikbo_two_level_target_attention_mosaic_gpu" if has_group
                   else "ikbo_target_attention_mosaic_gpu"),
  )(*operands)
  results = list(results)
  out = results.pop(0)
  lse = results.pop(0) if save_lse else None
  return out, lse, (results.pop(0) if has_self else None)
