"""Packed query tiles: the task list attention kernels run, built once from the candidate grouping.

Target attention kernels give each CTA a query tile whose rows all belong to
candidates of one user, so that every K/V tile the CTA loads into shared memory
serves all of them. A tile holds `blocks_per_tile` row blocks of `block_rows`
query rows (one block per consumer warpgroup). With `T` query tokens per
candidate, a block holds `block_rows // T` whole candidates when `T` divides
`block_rows`, or one `block_rows`-row piece of one candidate when `block_rows`
divides `T`.

The list is computed in XLA from the candidates grouped by user (a sort order
and per-user offsets, as `ikbo_jax.CandidateIndex` holds them), so an unsorted mapping
costs nothing in the kernel: it reads candidate ids from the list and copies
their query rows by index. Users with zero candidates get no tile. The number
of tiles depends on the traced counts, so the list has a static length (an
upper bound) and the tail tiles are empty (`num_valid == 0`, `live == False`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QueryTiles:
  """The tiles of one (candidate grouping, T) pair.

  Attributes:
    user: `int32[num_tiles]`, the user whose K/V the tile attends to (a valid
      id also for empty tiles, so that kernels never index out of range).
    live: `bool[num_tiles]`, whether the tile has any candidate.
    cands: `int32[num_tiles, blocks_per_tile, cands_per_block]`, the candidate
      of each `T`-row slot. Slots past `num_valid` repeat a valid id: kernels
      load them like the others (so every block issues the same copies) and
      drop their results.
    num_valid: `int32[num_tiles, blocks_per_tile]`, how many slots of each
      block hold real candidates.
    piece: `int32[num_tiles, blocks_per_tile]`, which `block_rows`-row piece
      of its candidate the block holds: its rows start at `piece * block_rows`
      (non-zero only when `T > block_rows`; kept in blocks so that kernels see
      an offset with known alignment).
    user_tile_start: `int32[U + 1]`, user `u`'s tiles are
      `[user_tile_start[u], user_tile_start[u + 1])` (kernels that iterate
      over one user's queries, like the K/V gradient, use it).
  """

  user: jax.Array
  live: jax.Array
  cands: jax.Array
  num_valid: jax.Array
  piece: jax.Array
  user_tile_start: jax.Array
  num_queries: int = dataclasses.field(metadata=dict(static=True))
  block_rows: int = dataclasses.field(metadata=dict(static=True))

  @property
  def num_tiles(self) -> int:
    return self.user.shape[0]

  @property
  def blocks_per_tile(self) -> int:
    return self.cands.shape[1]

  @property
  def cands_per_block(self) -> int:
    return self.cands.shape[2]

  @property
  def slot_rows(self) -> int:
    """Query rows one slot copies: `T`, or `block_rows` when `T` is larger."""
    return min(self.num_queries, self.block_rows)


def packable(num_queries: int, block_rows: int) -> bool:
  """Whether `T` query rows per candidate pack into blocks of `block_rows` rows."""
  return block_rows % num_queries == 0 or num_queries % block_rows == 0


def packed_num_queries(num_queries: int, block_rows: int, min_rows: int = 8) -> int:
  """The smallest `T' >= T` that packs: a power of two dividing `block_rows`, or a multiple of it.

  `min_rows` keeps each slot a whole number of shared-memory row tiles.
  """
  if num_queries > block_rows:
    return -(-num_queries // block_rows) * block_rows
  rows = min_rows
  while rows < num_queries:
    rows *= 2
  return rows


def max_num_tiles(num_candidates: int, num_users: int, num_queries: int, block_rows: int,
                  blocks_per_tile: int) -> int:
  """An upper bound on the tiles of any mapping of `B` candidates to `U` users.

  With `c` candidates a user needs `ceil(ceil(c / cpb) * bpc / W)` tiles
  (`cpb` candidates per block, `bpc` blocks per candidate, `W` blocks per
  tile), which is at most `((c / cpb + 1) * bpc + W - 1) / W`; summing over at
  most `min(U, B)` users with candidates gives the bound.
  """
  cpb, bpc = max(1, block_rows // num_queries), max(1, num_queries // block_rows)
  live_users = min(num_users, num_candidates)
  numerator = num_candidates * bpc + cpb * live_users * (bpc + blocks_per_tile - 1)
  return max(1, numerator // (cpb * blocks_per_tile))


def build(sort_order, user_offsets, num_queries: int, *, block_rows: int = 64,
          blocks_per_tile: int = 2) -> QueryTiles:
  """The packed query tiles for `num_queries` (T) query rows per candidate.

  Args:
    sort_order: `int32[B]`, the candidates grouped by user (ascending user).
    user_offsets: `int32[U + 1]`, user `u`'s candidates are
      `sort_order[user_offsets[u]:user_offsets[u + 1]]`.
    num_queries: T, which must pack (`packable`).
    block_rows: query rows per block.
    blocks_per_tile: blocks per tile.

  >>> sort_order, user_offsets = jnp.array([1, 0, 2, 3]), jnp.array([0, 1, 4, 4])  # users 1, 0, 1, 1
  >>> tiles = build(sort_order, user_offsets, num_queries=32, block_rows=64, blocks_per_tile=1)
  >>> tiles.user[:3].tolist(), tiles.num_valid[:3, 0].tolist()
  ([0, 1, 1], [1, 2, 1])
  >>> tiles.cands[:3, 0].tolist()
  [[1, 1], [0, 2], [3, 3]]
  """
  if not packable(num_queries, block_rows):
    raise ValueError(f"num_queries={num_queries} must divide or be a multiple of "
                     f"block_rows={block_rows}; see packed_num_queries")
  cpb, bpc = max(1, block_rows // num_queries), max(1, num_queries // block_rows)
  num_cands, num_users = sort_order.shape[0], user_offsets.shape[0] - 1
  counts = jnp.diff(user_offsets)
  user_blocks = -(-counts // cpb) * bpc
  user_tiles = -(-user_blocks // blocks_per_tile)
  user_tile_start = jnp.concatenate(
      [jnp.zeros((1,), jnp.int32), jnp.cumsum(user_tiles, dtype=jnp.int32)])

  num_tiles = max_num_tiles(num_cands, num_users, num_queries, block_rows, blocks_per_tile)
  tile = jnp.arange(num_tiles, dtype=jnp.int32)
  user = jnp.searchsorted(user_tile_start[1:], tile, side="right").astype(jnp.int32)
  live = tile < user_tile_start[-1]
  user = jnp.minimum(user, num_users - 1)
  block = ((tile - user_tile_start[user])[:, None] * blocks_per_tile
           + jnp.arange(blocks_per_tile, dtype=jnp.int32))
  block_live = live[:, None] & (block < user_blocks[user][:, None])
  # Rank of each slot's candidate among its user's candidates.
  rank = (block // bpc)[..., None] * cpb + jnp.arange(cpb, dtype=jnp.int32)
  slot_live = block_live[..., None] & (rank < counts[user][:, None, None])
  position = user_offsets[user][:, None, None] + rank
  cands = sort_order[jnp.clip(position, 0, num_cands - 1)]
  # Dead slots repeat the block's first candidate (or any valid id), so the
  # kernel's extra rows read real, finite data.
  cands = jnp.where(slot_live, cands, cands[..., :1])
  return QueryTiles(
      user=user,
      live=live,
      cands=cands,
      num_valid=jnp.sum(slot_live, axis=-1, dtype=jnp.int32),
      piece=block % bpc,
      user_tile_start=user_tile_start,
      num_queries=num_queries,
      block_rows=block_rows,
  )
