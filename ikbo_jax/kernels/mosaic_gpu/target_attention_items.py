"""The forward kernel's refs and work items: what each pass of its persistent loop serves.

A work item is a (query tile, head) pair: the users' own query tiles first
(self + target attention), then the candidate tiles of `QueryTiles`. With a
second key region (two-level attention), a candidate tile's key sequence is its
user's keys, then its group's. Items
are numbered head fastest, so that CTAs running together share a user's K/V
in L2, and program `p` of `P` takes items `p, p + P, p + 2P, ...`. Both the
consumers and the producer walk the same items, so both derive them here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ikbo_jax.kernels.mosaic_gpu.common import NUM_CONSUMERS

BLOCK_ROWS = 64  # query rows per consumer: one WGMMA M extent
# Stands for "no limit" in row/key position comparisons.
NO_LIMIT = 1 << 30


@dataclasses.dataclass(frozen=True)
class Refs:
  """The forward kernel's global-memory refs and its shared-memory scratch.

  The self-attention refs (`user_kv_len`, `q_user`, `out_user`), the second key
  region's (`group_k`, `group_v`, `tile_group`, `tile_group_kv_len`) and `lse`
  are None when the launch has no user tiles, no second region or saves no lse.
  """

  tile_user: Any
  tile_kv_len: Any
  cands: Any
  num_valid: Any
  piece: Any
  q: Any
  k: Any
  v: Any
  group_k: Any
  group_v: Any
  tile_group: Any
  tile_group_kv_len: Any
  user_kv_len: Any
  q_user: Any
  out: Any
  lse: Any
  out_user: Any
  # Shared memory: two query/output buffers per consumer, the K and V pipeline
  # slots, two lse buffers per consumer; barriers for each of them, and the
  # consumers' turns.
  qo_buffers: Any
  k_smem: Any
  v_smem: Any
  lse_buffers: Any
  k_ready: Any
  v_ready: Any
  q_ready: Any
  k_consumed: Any
  v_consumed: Any
  turn_barriers: Any


class Item(NamedTuple):
  """Scalars of one work item (a query tile and a head)."""

  tile: jax.Array  # the candidate tile's index in the `QueryTiles` arrays
  head: jax.Array
  user: jax.Array
  kv_len: jax.Array
  kv_steps: jax.Array  # K/V blocks the tile reads
  full_steps: jax.Array  # leading blocks that need no mask
  is_user: jax.Array | bool  # a tile of a user's own queries
  user_row: jax.Array  # for user tiles, the first query row of the tile
  # The second key region (a group's history), after the user's blocks: keys
  # `[group_start, group_end)` of the item's key sequence are the group's first
  # `group_end - group_start` keys. Both 0 without one.
  group: jax.Array | int = 0
  group_start: jax.Array | int = 0
  group_end: jax.Array | int = 0


def loaded_scalars(item: Item) -> dict:
  """The scalars an item reads from global memory (the consumers load them one item ahead)."""
  return dict(user=item.user, kv_len=item.kv_len, kv_steps=item.kv_steps,
              full_steps=item.full_steps, group=item.group, group_start=item.group_start,
              group_end=item.group_end)


@dataclasses.dataclass(frozen=True)
class WorkItems:
  """This program's items, `program + i * num_programs` for `i < count`."""

  refs: Refs
  num_heads: int
  num_users: int
  tiles_per_user: int  # user query tiles per user (0 without self-attention)
  block_kv: int
  causal: bool
  program: jax.Array
  num_programs: jax.Array
  count: jax.Array

  @classmethod
  def create(cls, refs: Refs, *, block_kv: int, causal: bool) -> WorkItems:
    num_heads = refs.q.shape[2]
    num_users, seq_len = refs.k.shape[:2]
    tiles_per_user = seq_len // (NUM_CONSUMERS * BLOCK_ROWS) if refs.q_user is not None else 0
    num_items = (num_users * tiles_per_user + refs.tile_user.shape[0]) * num_heads
    program, num_programs = lax.axis_index("programs"), lax.axis_size("programs")
    return cls(refs, num_heads, num_users, tiles_per_user, block_kv, causal, program,
               num_programs, pl.cdiv(num_items - program, num_programs))

  @property
  def has_self(self) -> bool:
    return self.refs.q_user is not None

  @property
  def has_group(self) -> bool:
    return self.refs.group_k is not None

  def info(self, i) -> Item:
    """Item `i` of this program."""
    refs, block_kv = self.refs, self.block_kv
    item = self.program + i * self.num_programs
    tile, head = lax.div(item, self.num_heads), lax.rem(item, self.num_heads)
    if not self.has_self:
      kv_len = refs.tile_kv_len[tile]
      item = Item(tile, head, refs.tile_user[tile], kv_len, pl.cdiv(kv_len, block_kv),
                  kv_len // block_kv, False, jnp.int32(0))
      if not self.has_group:
        return item
      # The group's blocks follow the user's last (partial) block; every step from the
      # user's first partial block on is masked.
      group_start = item.kv_steps * block_kv
      group_len = refs.tile_group_kv_len[tile]
      return item._replace(kv_steps=item.kv_steps + pl.cdiv(group_len, block_kv),
                           group=refs.tile_group[tile], group_start=group_start,
                           group_end=group_start + group_len)
    num_user_tiles = self.num_users * self.tiles_per_user
    tile_rows = NUM_CONSUMERS * BLOCK_ROWS
    is_user = tile < num_user_tiles
    cand_tile = jnp.maximum(tile - num_user_tiles, 0)
    user = jnp.minimum(lax.div(tile, self.tiles_per_user), self.num_users - 1)
    # Heavier (later) causal tiles of a user first, to even out the tail.
    user_row = (self.tiles_per_user - 1 - lax.rem(tile, self.tiles_per_user)) * tile_rows
    # A user tile whose rows are all padding reads nothing and writes zeros.
    user_kv_len = refs.user_kv_len[user]
    live_len = jnp.where(user_row < user_kv_len, user_kv_len, 0)
    user_end, user_full = live_len, live_len // block_kv
    if self.causal:
      user_end = jnp.minimum(live_len, user_row + tile_rows)
      user_full = jnp.minimum(user_full, (user_row + 1) // block_kv)
    cand_kv_len = refs.tile_kv_len[cand_tile]
    return Item(
        cand_tile, head,
        jnp.where(is_user, user, refs.tile_user[cand_tile]),
        jnp.where(is_user, user_kv_len, cand_kv_len),
        pl.cdiv(jnp.where(is_user, user_end, cand_kv_len), block_kv),
        jnp.where(is_user, user_full, cand_kv_len // block_kv),
        is_user, user_row)

  def when_kind(self, item: Item, for_cands, for_users):
    """Runs the candidate or the user variant of a step, by the item's kind."""
    if not self.has_self:
      for_cands()
    else:
      pl.when(jnp.logical_not(item.is_user))(for_cands)
      pl.when(item.is_user)(for_users)
