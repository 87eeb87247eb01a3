"""Target attention (and self + target attention) on the Mosaic GPU kernel: operand alignment.

The kernel packs whole candidates into 64-row query blocks, so it needs `T`
to divide 64 or be a multiple of it (other `T` are zero-padded up to the next
such size, a copy of `q` only), and `S` a multiple of its K/V block (K/V are
zero-padded, a copy at batch U; the padded keys are masked by `kv_len`). With
self-attention, `S` is padded to whole 128-row user query tiles as well.
"""

from __future__ import annotations

import jax.numpy as jnp

from ikbo_jax import query_tiles
from ikbo_jax._padding import pad_to, round_up
from ikbo_jax.index import CandidateIndex
from ikbo_jax.kernels.mosaic_gpu import target_attention as kernel
from ikbo_jax.ops import target_attention_xla

SUPPORTED_HEAD_DIMS = (64, 128)


def _run(q, k, v, index: CandidateIndex, kv_len, *, scale: float, save_lse: bool,
         q_user, causal: bool, mask_past_length: bool, config: kernel.Config, interpret: bool):
  """Pads, builds the query tiles, runs the kernel and slices the padding off again.

  The kernel reads whole K/V blocks, so a user's last block may include rows
  past `kv_len`: their logits are masked, but `P V` multiplies the zero
  probabilities by those values, and `0 * NaN` is NaN. `mask_past_length`
  zeroes them first (one pass over V at batch U, fused with the padding when
  there is any); callers whose lengths are all `S` skip it.
  """
  num_queries, seq_len = q.shape[1], k.shape[1]
  if mask_past_length:
    v = target_attention_xla.zero_past_length(v, kv_len)
  packed_queries = query_tiles.packed_num_queries(num_queries, kernel.BLOCK_ROWS)
  q = pad_to(q, 1, packed_queries)
  seq_multiple = config.block_kv
  if q_user is not None:
    seq_multiple = max(seq_multiple, kernel.NUM_CONSUMERS * kernel.BLOCK_ROWS)
  padded_len = round_up(seq_len, seq_multiple)
  k, v = pad_to(k, 1, padded_len), pad_to(v, 1, padded_len)
  tiles = query_tiles.build(index, packed_queries, block_rows=kernel.BLOCK_ROWS,
                            blocks_per_tile=kernel.NUM_CONSUMERS)
  tile_kv_len = jnp.where(tiles.live, kv_len[tiles.user], 0)
  user_queries = None
  if q_user is not None:
    user_queries = kernel.SelfAttention(pad_to(q_user, 1, padded_len), kv_len, causal)
  out, lse, out_user = kernel.forward(q, k, v, tiles, tile_kv_len, scale=scale,
                                      save_lse=save_lse, self_attention=user_queries,
                                      config=config, interpret=interpret)
  if lse is not None:
    lse = jnp.transpose(lse, (0, 2, 1))[:, :num_queries]
  if out_user is not None:
    out_user = out_user[:, :seq_len]
  return out[:, :num_queries], lse, out_user


def forward(q, k, v, index: CandidateIndex, kv_len, *, scale: float, save_lse: bool,
            mask_past_length: bool = False, config: kernel.Config = kernel.Config(),
            interpret: bool = False):
  """`(out [B, T, H, D], lse [B, T, H] float32 or None)`; `kv_len` already clamped to `[0, S]`."""
  out, lse, _ = _run(q, k, v, index, kv_len, scale=scale, save_lse=save_lse, q_user=None,
                     causal=False, mask_past_length=mask_past_length, config=config,
                     interpret=interpret)
  return out, lse


def self_target_forward(q_user, q, k, v, index: CandidateIndex, kv_len, *, scale: float,
                        causal: bool, save_lse: bool, mask_past_length: bool = False,
                        config: kernel.Config = kernel.Config(), interpret: bool = False):
  """`(out_user [U, S, H, D], out [B, T, H, D], lse [B, T, H] or None)` in one launch."""
  out, lse, out_user = _run(q, k, v, index, kv_len, scale=scale, save_lse=save_lse,
                            q_user=q_user, causal=causal, mask_past_length=mask_past_length,
                            config=config, interpret=interpret)
  return out_user, out, lse
