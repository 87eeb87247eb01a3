"""The forward kernel's consumer warpgroups: the attention of 64 query rows per work item.

Each consumer copies its candidates' query rows in by index, one item ahead
(two buffers, so the copy hides behind the current item's first step), runs
the online softmax over the user's K/V blocks with WGMMA for `Q K^T` and
`P V`, and stores output rows (and the lse) back by index, dropping the
slots that only pad the block. The items form one pipeline: an item's last
step issues the next item's first `Q K^T`, and the two consumers alternate
at the tensor cores across items too (`attention_gemms.Turns`).
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

from ikbo_jax.kernels.mosaic_gpu import inline
from ikbo_jax.kernels.mosaic_gpu.attention_gemms import Turns, accumulate_pv
from ikbo_jax.kernels.mosaic_gpu.common import NUM_CONSUMERS
from ikbo_jax.kernels.mosaic_gpu.target_attention_items import (
    BLOCK_ROWS, NO_LIMIT, Item, Refs, WorkItems, loaded_scalars)

LOG2E = math.log2(math.e)
# `lazy_rescale`: how far (log2 units) a block's max may exceed the running one.
RESCALE_THRESHOLD = 8.0


@dataclasses.dataclass(frozen=True)
class Consumer:
  """One consumer warpgroup (`wg`) of the forward kernel, and the constants of its launch."""

  wg: jax.Array
  refs: Refs
  items: WorkItems
  turns: Turns
  scale: float
  slot_rows: int
  causal: bool
  lazy_rescale: bool
  interpret: bool

  @property
  def slots(self):
    return [pl.ds(j * self.slot_rows, self.slot_rows) for j in range(self.refs.cands.shape[-1])]

  def run(self):
    """Every work item of this program, in one pipeline."""
    first_item = self.items.info(0)  # every program has at least one item
    self.load_queries(first_item, 0)
    self.turns.start_kernel()
    lax.fori_loop(0, self.items.count, lambda i, carry: _ItemPass(self, i, carry).run(),
                  (jnp.int32(0), loaded_scalars(first_item), self.zero_logits(),
                   jnp.bool_(False)))
    self.turns.end_kernel()
    plgpu.wait_smem_to_gmem(0)

  def gmem_rows(self, item: Item):
    """This consumer's query (and output) rows in GMEM: per candidate slot, and per user slot."""
    refs, wg, slot_rows = self.refs, self.wg, self.slot_rows
    cands_per_block = refs.cands.shape[-1]
    row_start = refs.piece[item.tile, wg] * BLOCK_ROWS
    cand_rows = [(refs.cands[item.tile, wg, j], pl.ds(row_start, slot_rows), item.head)
                 for j in range(cands_per_block)]
    user_rows = item.user_row + wg * BLOCK_ROWS
    own_rows = [(item.user, pl.ds(user_rows + j * slot_rows, slot_rows), item.head)
                for j in range(cands_per_block)]
    return cand_rows, own_rows, row_start, user_rows

  def queries_ready(self, buf):
    return self.refs.q_ready.at[buf * NUM_CONSUMERS + self.wg]

  def load_queries(self, item: Item, buf):
    """Starts the copy of `item`'s query rows into query buffer `buf`."""
    cand_rows, own_rows, _, _ = self.gmem_rows(item)

    def load(src_ref, rows):
      for slot, at in zip(self.slots, rows):
        plgpu.copy_gmem_to_smem(src_ref.at[at], self.refs.qo_buffers.at[buf, self.wg, slot],
                                self.queries_ready(buf))

    self.items.when_kind(item, lambda: load(self.refs.q, cand_rows),
                         lambda: load(self.refs.q_user, own_rows))

  @functools.cached_property
  def zero_logits(self):
    """`() -> zero logits`, one function object: the branches that use it share one trace."""
    return lambda: plgpu.layout_cast(jnp.zeros((BLOCK_ROWS, self.items.block_kv), jnp.float32),
                                     plgpu.Layout.WGMMA)

  def issue_qk(self, q_buf, slot, while_in_flight=lambda: None):
    """`Q K^T` of query buffer `q_buf` and K slot `slot`; the turn passes on while it runs."""
    refs = self.refs

    def qk(acc_ref):
      plgpu.wgmma(acc_ref, refs.qo_buffers.at[q_buf, self.wg], refs.k_smem.at[slot].T)
      with jax.named_scope("turn"):
        self.turns.pass_on()
      while_in_flight()
      return acc_ref[...]

    with jax.named_scope("qk"):
      logits = pl.run_scoped(qk, plgpu.ACC((BLOCK_ROWS, self.items.block_kv), jnp.float32))
      plgpu.barrier_arrive(refs.k_consumed.at[slot])
    return logits


class _ItemPass:
  """One work item of one consumer: its K/V steps and its epilogue.

  `carry` holds the K/V steps of earlier items (pipeline slots), this item's
  scalars read from global memory during the previous item (the index
  arithmetic is redone: its divisibility is what lets the query copies be
  checked for alignment at compile time), and this item's first logits when
  the previous item issued them.
  """

  def __init__(self, consumer: Consumer, i, carry):
    self.c, self.i = consumer, i
    items, refs = consumer.items, consumer.refs
    self.first_step, loaded, self.first_logits, self.have_first_logits = carry
    self.item = items.info(i)._replace(**loaded)
    self.next_item = items.info(jnp.minimum(i + 1, items.count - 1))
    self.next_has_steps = (i + 1 < items.count) & (self.next_item.kv_steps > 0)
    # This item's last step issues the next item's first Q K^T (and this
    # item's epilogue runs while the other consumer uses the tensor cores).
    self.hands_on = (self.item.kv_steps > 0) & self.next_has_steps
    self.cand_rows, self.own_rows, self.row_start, self.user_rows = consumer.gmem_rows(self.item)
    self.buf = lax.rem(i, 2)
    self.qo_smem = refs.qo_buffers.at[self.buf, consumer.wg]
    self.lse_smem = refs.lse_buffers.at[self.buf, consumer.wg] if refs.lse is not None else None

  def slot_of(self, step):
    return lax.rem(self.first_step + step, self.c.refs.k_smem.shape[0])

  def run(self):
    c, item = self.c, self.item
    with jax.named_scope("item_start"):
      logits = lax.cond(self.have_first_logits, lambda: self.first_logits, self.own_first_qk)
      pl.when(item.kv_steps == 0)(self.prefetch_next_queries)
    rows = (BLOCK_ROWS,)
    m_i = plgpu.layout_cast(jnp.full(rows, -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.full(rows, 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.full((BLOCK_ROWS, c.refs.q.shape[-1]), 0.0, jnp.float32),
                            plgpu.Layout.WGMMA)
    carry = (acc, m_i, l_i, logits)
    carry = lax.fori_loop(0, item.full_steps, functools.partial(self.kv_step, masked=False),
                          carry)
    acc, m_i, l_i, next_logits = lax.fori_loop(
        item.full_steps, item.kv_steps, functools.partial(self.kv_step, masked=True), carry)
    self.epilogue(acc, m_i, l_i)
    return (self.first_step + item.kv_steps, loaded_scalars(self.next_item), next_logits,
            self.hands_on)

  @functools.cached_property
  def prefetch_next_queries(self):
    """`()`: starts the copy of item i + 1's queries; one function object, traced once."""

    def prefetch():
      # Item i + 1 loads while this one computes. Its buffer holds item i - 1's
      # output, whose stores (issued at the end of that item) must be done reading.
      @pl.when(self.i + 1 < self.c.items.count)
      def _():
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        self.c.load_queries(self.next_item, 1 - self.buf)

    return prefetch

  def own_first_qk(self):
    c = self.c
    plgpu.barrier_wait(c.queries_ready(self.buf))

    def issue():
      plgpu.barrier_wait(c.refs.k_ready.at[self.slot_of(0)])
      c.turns.sync()
      return c.issue_qk(self.buf, self.slot_of(0))

    return lax.cond(self.item.kv_steps > 0, issue, c.zero_logits)

  def kv_step(self, step, carry, masked: bool):
    """Block `step`'s softmax, then its `P V` turn."""
    acc, m_i, l_i, logits = carry
    with jax.named_scope("softmax"):
      p, m_new, l_i, alpha = self.online_softmax(logits, m_i, l_i, step, masked)
      acc, p16 = self.rescale(acc, alpha), p.astype(self.c.refs.q.dtype)
      # Keep the softmax ahead of the barriers below (the compiler would
      # otherwise sink it past them and serialize the two consumers).
      acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
    acc, logits = self.pv_turn(step, acc, p16)
    return acc, m_new, l_i, logits

  def online_softmax(self, logits, m_i, l_i, step, masked: bool):
    """Folds K/V block `step`'s logits into the running max and sum: `(p, m, l, alpha)`."""
    c = self.c
    if masked:
      key = plgpu.broadcasted_iota(jnp.int32, logits.shape, 1, layout=plgpu.Layout.WGMMA)
      key += step * c.items.block_kv
      keep = key < self.item.kv_len
      if c.items.has_group:
        keep |= (key >= self.item.group_start) & (key < self.item.group_end)
      if c.causal:
        row = plgpu.broadcasted_iota(jnp.int32, logits.shape, 0, layout=plgpu.Layout.WGMMA)
        keep &= key <= row + jnp.where(self.item.is_user, self.user_rows, NO_LIMIT)
      logits = jnp.where(keep, logits, -jnp.inf)
    # Base-2 online softmax; m_i is kept in units of log2 so `p` is one FMA + exp2.
    block_max = logits.max(axis=1) * (c.scale * LOG2E)
    if c.lazy_rescale:
      m_new = jnp.where(block_max > m_i + RESCALE_THRESHOLD, block_max, m_i)
    else:
      m_new = jnp.maximum(m_i, block_max)
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(logits * (c.scale * LOG2E) - lax.broadcast_in_dim(m_new, logits.shape, [0]))
    # Partial row sums, their lanes exchanged once per item (in the epilogue).
    l_i = l_i * alpha + inline.partial_row_sums(p, c.interpret)
    return p, m_new, l_i, alpha

  def rescale(self, acc, alpha):
    if self.c.lazy_rescale and not self.c.interpret:
      return inline.rescale_rows(acc, alpha)
    return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

  def pv_turn(self, step, acc, p16):
    """The turn of block `step`'s `P V` and the `Q K^T` after it: `(acc + P V, its logits)`.

    The turn goes on with this item's next block, or the next item's first
    (its queries were copied in during this item's first step).
    """
    c, refs, buf = self.c, self.c.refs, self.buf
    slot = self.slot_of(step)
    with jax.named_scope("pv_wait"):
      plgpu.barrier_wait(refs.v_ready.at[slot])
    last = step + 1 == self.item.kv_steps
    issue_next = jnp.logical_not(last) | self.next_has_steps

    def wait_next_k():
      pl.when(issue_next)(lambda: plgpu.barrier_wait(refs.k_ready.at[self.slot_of(step + 1)]))

    with jax.named_scope("pv"):
      acc = accumulate_pv(acc, p16, refs.v_smem.at[slot], before_issue=c.turns.sync,
                          then=wait_next_k, interpret=c.interpret)
      plgpu.barrier_arrive(refs.v_consumed.at[slot])
    # A one-step item must copy the next item's queries in before issuing its Q K^T.
    pl.when((step == 0) & last)(self.prefetch_next_queries)
    pl.when(last & self.next_has_steps)(
        lambda: plgpu.barrier_wait(c.queries_ready(1 - buf)))

    def next_qk():
      # Other items copy them in while the tensor cores work on this Q K^T.
      return c.issue_qk(jnp.where(last, 1 - buf, buf), self.slot_of(step + 1),
                        lambda: pl.when((step == 0) & jnp.logical_not(last))(
                            self.prefetch_next_queries))

    def pass_on():
      c.turns.pass_on()
      return c.zero_logits()

    return acc, lax.cond(issue_next, next_qk, pass_on)

  def epilogue(self, acc, m_i, l_i):
    """Normalizes the finished rows and stores them (and the lse) by index."""
    c, refs, item = self.c, self.c.refs, self.item
    with jax.named_scope("epilogue"):
      l_i = inline.finish_row_sums(l_i, c.interpret)
      # A user with no valid key has l == 0: write zeros rather than 0/0.
      l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
      # One reciprocal per row and a multiply per element: a division per
      # element would cost a special-function instruction each.
      acc *= lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
      if c.items.has_self:
        # User query rows past the user's length are padding: zeros, as in the reference.
        row = plgpu.broadcasted_iota(jnp.int32, acc.shape, 0, layout=plgpu.Layout.WGMMA)
        acc = jnp.where(row + self.user_rows < jnp.where(item.is_user, item.kv_len, NO_LIMIT),
                        acc, 0.0)
      self.qo_smem[...] = acc.astype(refs.q.dtype)
      if refs.lse is not None:
        self.lse_smem[...] = (m_i + jnp.log2(l_i)) / LOG2E
      plgpu.commit_smem()
      c.items.when_kind(item, self.store_cands, self.store_own_rows)

  def store_cands(self):
    refs = self.c.refs
    num_valid = refs.num_valid[self.item.tile, self.c.wg]
    for j, (slot, at) in enumerate(zip(self.c.slots, self.cand_rows)):
      @pl.when(j < num_valid)
      def _store():
        plgpu.copy_smem_to_gmem(self.qo_smem.at[slot], refs.out.at[at])
        if refs.lse is not None:
          plgpu.copy_smem_to_gmem(
              self.lse_smem.at[slot],
              refs.lse.at[at[0], self.item.head, pl.ds(self.row_start, self.c.slot_rows)])

  def store_own_rows(self):
    for slot, at in zip(self.c.slots, self.own_rows):
      plgpu.copy_smem_to_gmem(self.qo_smem.at[slot], self.c.refs.out_user.at[at])
