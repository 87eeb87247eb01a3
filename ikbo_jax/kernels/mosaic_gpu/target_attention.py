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
out both kinds alike, so neither leaves SMs idle. Causal user tiles skip the
K/V blocks past their last query and mask only the diagonal block; query rows
past `kv_len` are written as zeros.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ikbo_jax.kernels.mosaic_gpu import inline
from ikbo_jax.kernels.mosaic_gpu.attention_gemms import Turns, accumulate_pv
from ikbo_jax.kernels.mosaic_gpu.common import (
    NUM_CONSUMERS, PRODUCER_REGISTERS, interpret_params, num_sms, smem_transforms)
from ikbo_jax.kernels.mosaic_gpu.query_tiles import QueryTiles

BLOCK_ROWS = 64  # query rows per consumer: one WGMMA M extent
_LOG2E = math.log2(math.e)
_CONSUMER_REGISTERS = 232
# Config.lazy_rescale: how far (log2 units) a block's max may exceed the running one.
_RESCALE_THRESHOLD = 8.0


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


class _Item(NamedTuple):
  """Scalars of one work item (a query tile and a head)."""

  tile: jax.Array  # the candidate tile's index in the `QueryTiles` arrays
  head: jax.Array
  user: jax.Array
  kv_len: jax.Array
  kv_steps: jax.Array  # K/V blocks the tile reads
  full_steps: jax.Array  # leading blocks that need no mask
  is_user: jax.Array | bool  # a tile of a user's own queries
  user_row: jax.Array  # for user tiles, the first query row of the tile


def _loaded_scalars(item: _Item) -> dict:
  return dict(user=item.user, kv_len=item.kv_len, kv_steps=item.kv_steps,
              full_steps=item.full_steps)


# Stands for "no limit" in row/key position comparisons.
_NO_LIMIT = 1 << 30


def _kernel(tile_user_ref, tile_kv_len_ref, cands_ref, num_valid_ref, piece_ref,
            q_ref, k_ref, v_ref, user_kv_len_ref, q_user_ref, out_ref, lse_ref, out_user_ref,
            scoped, *, scale: float, slot_rows: int, causal: bool, config: Config,
            interpret: bool):
  (qo_buffers, k_smem, v_smem, lse_buffers), (k_ready, v_ready, q_ready), consumed, turn_barriers = scoped
  k_consumed, v_consumed = consumed
  wg = lax.axis_index("wg")
  head_dim, dtype = q_ref.shape[-1], q_ref.dtype
  num_heads = q_ref.shape[2]
  block_kv, stages = config.block_kv, k_smem.shape[0]
  cands_per_block = cands_ref.shape[-1]
  tile_rows = NUM_CONSUMERS * BLOCK_ROWS
  # User query tiles (self-attention) first, then candidate tiles.
  num_users, seq_len = k_ref.shape[:2]
  tiles_per_user = seq_len // tile_rows if q_user_ref is not None else 0
  num_user_tiles = num_users * tiles_per_user
  # Work items (tile, head), head fastest so that the CTAs running together
  # share a user's K/V in L2. Program p takes items p, p + P, p + 2P, ...
  num_items = (num_user_tiles + tile_user_ref.shape[0]) * num_heads
  program, num_programs = lax.axis_index("programs"), lax.axis_size("programs")
  my_items = pl.cdiv(num_items - program, num_programs)

  def item_info(i) -> _Item:
    item = program + i * num_programs
    tile, head = lax.div(item, num_heads), lax.rem(item, num_heads)
    if q_user_ref is None:
      kv_len = tile_kv_len_ref[tile]
      return _Item(tile, head, tile_user_ref[tile], kv_len, pl.cdiv(kv_len, block_kv),
                   kv_len // block_kv, False, jnp.int32(0))
    is_user = tile < num_user_tiles
    cand_tile = jnp.maximum(tile - num_user_tiles, 0)
    user = jnp.minimum(lax.div(tile, tiles_per_user), num_users - 1)
    # Heavier (later) causal tiles of a user first, to even out the tail.
    user_row = (tiles_per_user - 1 - lax.rem(tile, tiles_per_user)) * tile_rows
    # A user tile whose rows are all padding reads nothing and writes zeros.
    user_kv_len = user_kv_len_ref[user]
    live_len = jnp.where(user_row < user_kv_len, user_kv_len, 0)
    user_end, user_full = live_len, live_len // block_kv
    if causal:
      user_end = jnp.minimum(live_len, user_row + tile_rows)
      user_full = jnp.minimum(user_full, (user_row + 1) // block_kv)
    cand_kv_len = tile_kv_len_ref[cand_tile]
    return _Item(
        cand_tile, head,
        jnp.where(is_user, user, tile_user_ref[cand_tile]),
        jnp.where(is_user, user_kv_len, cand_kv_len),
        pl.cdiv(jnp.where(is_user, user_end, cand_kv_len), block_kv),
        jnp.where(is_user, user_full, cand_kv_len // block_kv),
        is_user, user_row)

  # On the GPU the turns pass on named hardware barriers and each thread keeps
  # partial softmax row sums (lanes exchanged once per item); the interpreter
  # has neither, so it uses an mbarrier per consumer and sums whole rows.
  turns = Turns(wg, turn_barriers, named=not interpret)

  def when_kind(item: _Item, for_cands, for_users):
    """Runs the candidate or the user variant of a step, by the item's kind."""
    if q_user_ref is None:
      for_cands()
    else:
      pl.when(jnp.logical_not(item.is_user))(for_cands)
      pl.when(item.is_user)(for_users)

  row_sums_in_thread = not interpret
  skip_unit_rescale = config.lazy_rescale and not interpret

  @pl.when(wg < NUM_CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
    slots = [pl.ds(j * slot_rows, slot_rows) for j in range(cands_per_block)]

    def gmem_rows(item: _Item):
      """This consumer's query (and output) rows in GMEM: per candidate slot, and per user slot."""
      row_start = piece_ref[item.tile, wg] * BLOCK_ROWS
      cand_rows = [(cands_ref[item.tile, wg, j], pl.ds(row_start, slot_rows), item.head)
                   for j in range(cands_per_block)]
      user_rows = item.user_row + wg * BLOCK_ROWS
      own_rows = [(item.user, pl.ds(user_rows + j * slot_rows, slot_rows), item.head)
                  for j in range(cands_per_block)]
      return cand_rows, own_rows, row_start, user_rows

    def queries_ready(buf):
      return q_ready.at[buf * NUM_CONSUMERS + wg]

    def load_queries(item: _Item, buf):
      """Starts the copy of `item`'s query rows into query buffer `buf`."""
      cand_rows, own_rows, _, _ = gmem_rows(item)

      def load(src_ref, rows):
        for slot, at in zip(slots, rows):
          plgpu.copy_gmem_to_smem(src_ref.at[at], qo_buffers.at[buf, wg, slot],
                                  queries_ready(buf))

      when_kind(item, lambda: load(q_ref, cand_rows), lambda: load(q_user_ref, own_rows))

    def zero_logits():
      return plgpu.layout_cast(jnp.zeros((BLOCK_ROWS, block_kv), jnp.float32),
                               plgpu.Layout.WGMMA)

    def issue_qk(q_buf, slot, while_in_flight=lambda: None):
      """`Q K^T` of query buffer `q_buf` and K slot `slot`; the turn passes on while it runs."""

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, qo_buffers.at[q_buf, wg], k_smem.at[slot].T)
        with jax.named_scope("turn"):
          turns.pass_on()
        while_in_flight()
        return acc_ref[...]

      with jax.named_scope("qk"):
        logits = pl.run_scoped(qk, plgpu.ACC((BLOCK_ROWS, block_kv), jnp.float32))
        plgpu.barrier_arrive(k_consumed.at[slot])
      return logits

    def item_body(i, carry):
      """One work item.

      The items form one pipeline: an item's last step issues the next item's
      first `Q K^T` (and this item's epilogue runs while the other consumer
      uses the tensor cores), so the turns never restart. `carry` holds the
      K/V steps of earlier items (pipeline slots), this item's scalars read
      from global memory during the previous item (the index arithmetic is
      redone: its divisibility is what lets the query copies be checked for
      alignment at compile time), and this item's first logits when the
      previous item issued them.
      """
      first_step, loaded, first_logits, have_first_logits = carry
      item = item_info(i)._replace(**loaded)
      next_item = item_info(jnp.minimum(i + 1, my_items - 1))
      next_has_steps = (i + 1 < my_items) & (next_item.kv_steps > 0)
      # This item's last step issues the next item's first Q K^T (and this
      # item's epilogue runs while the other consumer uses the tensor cores).
      hands_on = (item.kv_steps > 0) & next_has_steps
      tile, head, kv_len, kv_steps = item.tile, item.head, item.kv_len, item.kv_steps
      cand_rows, own_rows, row_start, user_rows = gmem_rows(item)
      buf = lax.rem(i, 2)
      qo_smem = qo_buffers.at[buf, wg]
      lse_smem = lse_buffers.at[buf, wg] if lse_ref is not None else None
      slot_of = lambda step: lax.rem(first_step + step, stages)

      def prefetch_next_queries():
        # Item i + 1 loads while this one computes. Its buffer holds item i - 1's
        # output, whose stores (issued at the end of that item) must be done reading.
        @pl.when(i + 1 < my_items)
        def _():
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          load_queries(next_item, 1 - buf)

      def own_first_qk():
        plgpu.barrier_wait(queries_ready(buf))

        def issue():
          plgpu.barrier_wait(k_ready.at[slot_of(0)])
          turns.sync()
          return issue_qk(buf, slot_of(0))

        return lax.cond(kv_steps > 0, issue, zero_logits)

      with jax.named_scope("item_start"):
        logits = lax.cond(have_first_logits, lambda: first_logits, own_first_qk)
        pl.when(kv_steps == 0)(prefetch_next_queries)

      rows = (BLOCK_ROWS,)
      m_i = plgpu.layout_cast(jnp.full(rows, -jnp.inf, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
      l_i = plgpu.layout_cast(jnp.full(rows, 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      acc = plgpu.layout_cast(jnp.full((BLOCK_ROWS, head_dim), 0.0, jnp.float32),
                              plgpu.Layout.WGMMA)

      def online_softmax(logits, m_i, l_i, step, masked: bool):
        """Folds K/V block `step`'s logits into the running max and sum: `(p, m, l, alpha)`."""
        if masked:
          key = plgpu.broadcasted_iota(jnp.int32, logits.shape, 1, layout=plgpu.Layout.WGMMA)
          key += step * block_kv
          keep = key < kv_len
          if causal:
            row = plgpu.broadcasted_iota(jnp.int32, logits.shape, 0, layout=plgpu.Layout.WGMMA)
            keep &= key <= row + jnp.where(item.is_user, user_rows, _NO_LIMIT)
          logits = jnp.where(keep, logits, -jnp.inf)
        # Base-2 online softmax; m_i is kept in units of log2 so `p` is one FMA + exp2.
        block_max = logits.max(axis=1) * (scale * _LOG2E)
        if config.lazy_rescale:
          m_new = jnp.where(block_max > m_i + _RESCALE_THRESHOLD, block_max, m_i)
        else:
          m_new = jnp.maximum(m_i, block_max)
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(logits * (scale * _LOG2E) - lax.broadcast_in_dim(m_new, logits.shape, [0]))
        l_i = l_i * alpha + (inline.row_sums_in_thread(p) if row_sums_in_thread else p.sum(axis=1))
        return p, m_new, l_i, alpha

      def rescale(acc, alpha):
        if skip_unit_rescale:
          return inline.rescale_rows(acc, alpha)
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

      def epilogue(acc, m_i, l_i):
        """Normalizes the finished rows and stores them (and the lse) by index."""
        with jax.named_scope("epilogue"):
          if row_sums_in_thread:
            l_i = inline.sum_row_partials(l_i)
          # A user with no valid key has l == 0: write zeros rather than 0/0.
          l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
          # One reciprocal per row and a multiply per element: a division per
          # element would cost a special-function instruction each.
          acc *= lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
          if q_user_ref is not None:
            # User query rows past the user's length are padding: zeros, as in the reference.
            row = plgpu.broadcasted_iota(jnp.int32, acc.shape, 0, layout=plgpu.Layout.WGMMA)
            acc = jnp.where(row + user_rows < jnp.where(item.is_user, kv_len, _NO_LIMIT), acc, 0.0)
          qo_smem[...] = acc.astype(dtype)
          if lse_ref is not None:
            lse_smem[...] = (m_i + jnp.log2(l_i)) / _LOG2E
          plgpu.commit_smem()

          def store_cands():
            num_valid = num_valid_ref[tile, wg]
            for j, (slot, at) in enumerate(zip(slots, cand_rows)):
              @pl.when(j < num_valid)
              def _store():
                plgpu.copy_smem_to_gmem(qo_smem.at[slot], out_ref.at[at])
                if lse_ref is not None:
                  plgpu.copy_smem_to_gmem(lse_smem.at[slot],
                                          lse_ref.at[at[0], head, pl.ds(row_start, slot_rows)])

          def store_own_rows():
            for slot, at in zip(slots, own_rows):
              plgpu.copy_smem_to_gmem(qo_smem.at[slot], out_user_ref.at[at])

          when_kind(item, store_cands, store_own_rows)

      def pv_turn(step, acc, p16):
        """The turn of block `step`'s `P V` and the `Q K^T` after it: `(acc + P V, its logits)`.

        The turn goes on with this item's next block, or the next item's first
        (its queries were copied in during this item's first step).
        """
        slot = slot_of(step)
        with jax.named_scope("pv_wait"):
          plgpu.barrier_wait(v_ready.at[slot])
        last = step + 1 == kv_steps
        issue_next = jnp.logical_not(last) | next_has_steps

        def wait_next_k():
          pl.when(issue_next)(lambda: plgpu.barrier_wait(k_ready.at[slot_of(step + 1)]))

        with jax.named_scope("pv"):
          acc = accumulate_pv(acc, p16, v_smem.at[slot], before_issue=turns.sync,
                               then=wait_next_k, interpret=interpret)
          plgpu.barrier_arrive(v_consumed.at[slot])
        # A one-step item must copy the next item's queries in before issuing its Q K^T.
        pl.when((step == 0) & last)(prefetch_next_queries)
        pl.when(last & next_has_steps)(
            lambda: plgpu.barrier_wait(queries_ready(1 - buf)))

        def next_qk():
          def while_in_flight():
            # Other items copy them in while the tensor cores work on this Q K^T.
            pl.when((step == 0) & jnp.logical_not(last))(prefetch_next_queries)

          return issue_qk(jnp.where(last, 1 - buf, buf), slot_of(step + 1), while_in_flight)

        def pass_on():
          turns.pass_on()
          return zero_logits()

        return acc, lax.cond(issue_next, next_qk, pass_on)

      def kv_step(step, carry, masked: bool):
        """Block `step`'s softmax, then its `P V` turn."""
        acc, m_i, l_i, logits = carry
        with jax.named_scope("softmax"):
          p, m_new, l_i, alpha = online_softmax(logits, m_i, l_i, step, masked)
          acc, p16 = rescale(acc, alpha), p.astype(dtype)
          # Keep the softmax ahead of the barriers below (the compiler would
          # otherwise sink it past them and serialize the two consumers).
          acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
        acc, logits = pv_turn(step, acc, p16)
        return acc, m_new, l_i, logits

      carry = (acc, m_i, l_i, logits)
      carry = lax.fori_loop(0, item.full_steps, functools.partial(kv_step, masked=False), carry)
      acc, m_i, l_i, next_logits = lax.fori_loop(
          item.full_steps, kv_steps, functools.partial(kv_step, masked=True), carry)
      epilogue(acc, m_i, l_i)
      return first_step + kv_steps, _loaded_scalars(next_item), next_logits, hands_on

    first_item = item_info(0)  # every program has at least one item
    load_queries(first_item, 0)
    turns.start_kernel()
    lax.fori_loop(0, my_items, item_body,
                  (jnp.int32(0), _loaded_scalars(first_item), zero_logits(), jnp.bool_(False)))
    turns.end_kernel()
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == NUM_CONSUMERS)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

    def item_body(i, first_step):
      item = item_info(i)
      head, user, kv_steps = item.head, item.user, item.kv_steps

      # Runs ahead of the consumers by up to `stages` blocks, also across
      # items: the next item's first K/V blocks load during this one's epilogue.
      @pl.loop(0, kv_steps)
      def _(step):
        pipeline_step = first_step + step
        slot = lax.rem(pipeline_step, stages)

        kv_block = (user, pl.ds(step * block_kv, block_kv), head)
        # K and V slots free up separately: a block's K is done half a step
        # before its V, so the next K load need not wait for the P V.
        pl.when(pipeline_step >= stages)(lambda: plgpu.barrier_wait(k_consumed.at[slot]))
        plgpu.copy_gmem_to_smem(k_ref.at[kv_block], k_smem.at[slot], k_ready.at[slot])
        pl.when(pipeline_step >= stages)(lambda: plgpu.barrier_wait(v_consumed.at[slot]))
        plgpu.copy_gmem_to_smem(v_ref.at[kv_block], v_smem.at[slot], v_ready.at[slot])

      return first_step + kv_steps

    total_steps = lax.fori_loop(0, my_items, item_body, jnp.int32(0))
    # Observe the consumers' last releases too, so every barrier phase is
    # waited for before the barriers go away (the interpreter checks this).
    for back in range(stages, 0, -1):
      @pl.when(total_steps >= back)
      def _():
        slot = lax.rem(total_steps - back, stages)
        plgpu.barrier_wait(k_consumed.at[slot])
        plgpu.barrier_wait(v_consumed.at[slot])


def forward(q, k, v, tiles: QueryTiles, tile_kv_len, *, scale: float, save_lse: bool,
            self_attention: SelfAttention | None = None, config: Config = Config(),
            interpret: bool = False):
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
  # No more pipeline stages than K/V blocks: the rest would only take shared memory.
  stages = min(config.max_concurrent_steps, seq_len // config.block_kv)
  q_transforms = smem_transforms(head_dim, dtype)
  has_self = self_attention is not None

  def entry(*refs):
    refs = list(refs)
    in_refs = refs[:8]
    user_kv_len_ref, q_user_ref = refs[8:10] if has_self else (None, None)
    outs = refs[10:] if has_self else refs[8:]
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
        lambda *scoped: _kernel(
            *in_refs, user_kv_len_ref, q_user_ref, out_ref, lse_ref, out_user_ref, scoped,
            scale=scale, slot_rows=tiles.slot_rows,
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
                   else "ikbo_target_attention_mosaic_gpu"),
  )(*operands)
  results = list(results)
  out = results.pop(0)
  lse = results.pop(0) if save_lse else None
  return out, lse, (results.pop(0) if has_self else None)
