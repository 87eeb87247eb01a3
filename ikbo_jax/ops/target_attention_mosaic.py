"""Target attention on the Mosaic GPU kernel: operand alignment around the packed-query kernel.

The kernel packs whole candidates into 64-row query blocks, so it needs `T`
to divide 64 or be a multiple of it (other `T` are zero-padded up to the next
such size, a copy of `q` only), and `S` a multiple of its K/V block (K/V are
zero-padded, a copy at batch U; the padded keys are masked by `kv_len`).
"""

from __future__ import annotations

import jax.numpy as jnp

from ikbo_jax import query_tiles
from ikbo_jax._padding import pad_to, round_up
from ikbo_jax.index import CandidateIndex
from ikbo_jax.kernels.mosaic_gpu import target_attention as kernel

SUPPORTED_HEAD_DIMS = (64, 128)


def forward(q, k, v, index: CandidateIndex, kv_len, *, scale: float, save_lse: bool,
            config: kernel.Config = kernel.Config(), interpret: bool = False):
  """`(out [B, T, H, D], lse [B, T, H] float32 or None)`; `kv_len` already clamped to `[0, S]`."""
  num_queries, seq_len = q.shape[1], k.shape[1]
  packed_queries = query_tiles.packed_num_queries(num_queries, kernel.BLOCK_ROWS)
  q = pad_to(q, 1, packed_queries)
  padded_len = round_up(seq_len, config.block_kv)
  k, v = pad_to(k, 1, padded_len), pad_to(v, 1, padded_len)
  tiles = query_tiles.build(index, packed_queries, block_rows=kernel.BLOCK_ROWS,
                            blocks_per_tile=kernel.NUM_CONSUMERS)
  tile_kv_len = jnp.where(tiles.live, kv_len[tiles.user], 0)
  out, lse = kernel.forward(q, k, v, tiles, tile_kv_len, scale=scale, save_lse=save_lse,
                            config=config, interpret=interpret)
  if lse is not None:
    lse = jnp.transpose(lse, (0, 2, 1))[:, :num_queries]
  return out[:, :num_queries], lse
