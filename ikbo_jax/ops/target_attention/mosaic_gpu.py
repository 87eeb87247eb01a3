"""Target attention (and self + target attention) on the Mosaic GPU kernel (Hopper).

The kernel packs whole candidates into 64-row query blocks, so it needs `T`
to divide 64 or be a multiple of it (other `T` are zero-padded up to the next
such size, a copy of `q` only), and `S` a multiple of its K/V block (K/V are
zero-padded, a copy at batch U; the padded keys are masked by `kv_len`). With
self-attention, `S` is padded to whole 128-row user query tiles as well.

The backward (`backward`) runs the Mosaic GPU backward kernels on the
forward's query tiles: dq per tile, dk/dv summed per user inside one CTA. On
an H100 at the published shape it takes 0.74-0.83x of the Triton backward's
time (S = 512 to 4096, docs/results.md); the Triton backend keeps its own for
GPUs without Hopper instructions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ikbo_jax import _dispatch
from ikbo_jax._padding import pad_to, round_up
from ikbo_jax.index import CandidateIndex
from ikbo_jax.kernels.mosaic_gpu import query_tiles
from ikbo_jax.kernels.mosaic_gpu import target_attention as kernel
from ikbo_jax.kernels.mosaic_gpu import target_attention_backward as backward_kernel
from ikbo_jax.ops.target_attention import xla
from ikbo_jax.ops.target_attention.params import Params
from ikbo_jax.ops.target_attention.vjp import KernelBackend, output_cotangent_dot

SUPPORTED_HEAD_DIMS = (64, 128)


def head_dim_limit(head_dim: int) -> str | None:
  if head_dim not in SUPPORTED_HEAD_DIMS:
    return f"supports head dims D in {SUPPORTED_HEAD_DIMS}, got D={head_dim}"
  return None


@dataclasses.dataclass(frozen=True)
class GroupHistory:
  """The second key region of two-level attention: each group's own history.

  `index` maps items to groups (`[B] -> [G]`, so the query tiles are per group),
  `group_to_user` each group to its user (clamped into `[0, U)`), and `k`, `v`,
  `kv_len` are the groups' keys, values and valid lengths (`[G, S_group, H, D]`,
  `int32[G]` clamped to `[0, S_group]`).
  """

  index: CandidateIndex
  group_to_user: jax.Array
  k: jax.Array
  v: jax.Array
  kv_len: jax.Array


def _run(q, k, v, index: CandidateIndex, kv_len, *, scale: float, save_lse: bool,
         q_user, causal: bool, mask_past_length: bool, config: kernel.Config, interpret: bool,
         group: GroupHistory | None = None):
  """Pads, builds the query tiles, runs the kernel and slices the padding off again.

  The kernel reads whole K/V blocks, so a user's last block may include rows
  past `kv_len`: their logits are masked, but `P V` multiplies the zero
  probabilities by those values, and `0 * NaN` is NaN. `mask_past_length`
  zeroes them first (one pass over V at batch U, fused with the padding when
  there is any); callers whose lengths are all `S` skip it. With `group`, the
  tiles are per group and stream the group's keys after their user's.
  """
  num_queries, seq_len = q.shape[1], k.shape[1]
  if mask_past_length:
    v = xla.zero_past_length(v, kv_len)
  packed_queries = query_tiles.packed_num_queries(num_queries, kernel.BLOCK_ROWS)
  q = pad_to(q, 1, packed_queries)
  seq_multiple = config.block_kv
  if q_user is not None:
    seq_multiple = max(seq_multiple, kernel.NUM_CONSUMERS * kernel.BLOCK_ROWS)
  padded_len = round_up(seq_len, seq_multiple)
  k, v = pad_to(k, 1, padded_len), pad_to(v, 1, padded_len)
  if group is None:
    tiles, tile_kv_len = _tiles(index, kv_len, packed_queries)
    group_region = None
  else:
    tiles, group_region = _group_tiles(group, packed_queries, mask_past_length, config)
    tiles = dataclasses.replace(tiles, user=group.group_to_user[tiles.user])
    tile_kv_len = jnp.where(tiles.live, kv_len[tiles.user], 0)
  user_queries = None
  if q_user is not None:
    user_queries = kernel.SelfAttention(pad_to(q_user, 1, padded_len), kv_len, causal)
  out, lse, out_user = kernel.forward(q, k, v, tiles, tile_kv_len, scale=scale,
                                      save_lse=save_lse, self_attention=user_queries,
                                      group=group_region, config=config, interpret=interpret)
  if lse is not None:
    lse = jnp.transpose(lse, (0, 2, 1))[:, :num_queries]
  if out_user is not None:
    out_user = out_user[:, :seq_len]
  return out[:, :num_queries], lse, out_user


def _tiles(index: CandidateIndex, kv_len, packed_queries: int):
  """The packed query tiles, and each tile's user's length (0 for dead tiles)."""
  tiles = query_tiles.build(index.sort_order, index.user_offsets, packed_queries,
                            block_rows=kernel.BLOCK_ROWS, blocks_per_tile=kernel.NUM_CONSUMERS)
  return tiles, jnp.where(tiles.live, kv_len[tiles.user], 0)


def _group_tiles(group: GroupHistory, packed_queries: int, mask_past_length: bool,
                 config: kernel.Config):
  """The per-group query tiles (`tiles.user` is a group) and the kernel's group region."""
  tiles, tile_kv_len = _tiles(group.index, group.kv_len, packed_queries)
  v = xla.zero_past_length(group.v, group.kv_len) if mask_past_length else group.v
  padded_len = round_up(group.k.shape[1], config.block_kv)
  region = kernel.GroupRegion(pad_to(group.k, 1, padded_len), pad_to(v, 1, padded_len),
                              tiles.user, tile_kv_len)
  return tiles, region


def aligned_forward(q, k, v, index: CandidateIndex, kv_len, *, scale: float, save_lse: bool,
                    mask_past_length: bool = False, config: kernel.Config = kernel.Config(),
                    interpret: bool = False):
  """`(out [B, T, H, D], lse [B, T, H] float32 or None)`; `kv_len` already clamped to `[0, S]`."""
  out, lse, _ = _run(q, k, v, index, kv_len, scale=scale, save_lse=save_lse, q_user=None,
                     causal=False, mask_past_length=mask_past_length, config=config,
                     interpret=interpret)
  return out, lse


def two_level_forward(q, k_user, v_user, kv_len_user, group: GroupHistory, *, scale: float,
                      mask_past_length: bool = False, config: kernel.Config = kernel.Config(),
                      interpret: bool = False):
  """`(out [B, T, H, D], lse [B, T, H] float32)`: one softmax over the user's and group's keys."""
  out, lse, _ = _run(q, k_user, v_user, group.index, kv_len_user, scale=scale, save_lse=True,
                     q_user=None, causal=False, mask_past_length=mask_past_length,
                     config=config, interpret=interpret, group=group)
  return out, lse


def forward(params: Params, q, k, v, index, kv_len, save_lse: bool):
  return aligned_forward(q, k, v, index, kv_len, scale=params.scale, save_lse=save_lse,
                         mask_past_length=params.masked, interpret=params.interpret)


def self_target_forward(q_user, q, k, v, index: CandidateIndex, kv_len, *, scale: float,
                        causal: bool, save_lse: bool, mask_past_length: bool = False,
                        config: kernel.Config = kernel.Config(), interpret: bool = False):
  """`(out_user [U, S, H, D], out [B, T, H, D], lse [B, T, H] or None)` in one launch."""
  out, lse, out_user = _run(q, k, v, index, kv_len, scale=scale, save_lse=save_lse,
                            q_user=q_user, causal=causal, mask_past_length=mask_past_length,
                            config=config, interpret=interpret)
  return out_user, out, lse


def backward(params: Params, q, k, v, out, lse, index, kv_len, d_out, d_lse,
             config: backward_kernel.Config = backward_kernel.Config()):
  """`(dq, dk, dv)` on the Mosaic GPU backward kernels, over the forward's packed query tiles.

  Padding is arranged so that it adds nothing: query rows that pad T get
  `lse = +inf` (zero probabilities), K/V rows past the lengths are zeroed
  (with lengths given they may hold NaN, and `0 * NaN` is NaN), and `S` is
  padded to whole 128-key blocks.
  """
  num_queries, seq_len = q.shape[1], k.shape[1]
  if params.masked:
    k, v = xla.zero_past_length(k, kv_len), xla.zero_past_length(v, kv_len)
  delta, d_lse = (jnp.transpose(x, (0, 2, 1)) for x in output_cotangent_dot(out, d_out, d_lse))
  d_out = d_out.astype(q.dtype)
  lse2 = jnp.transpose(lse, (0, 2, 1)) * backward_kernel.LOG2E
  packed_queries = query_tiles.packed_num_queries(num_queries, kernel.BLOCK_ROWS)
  pad_rows = lambda x, value=0.0: jnp.pad(
      x, [(0, 0)] * (x.ndim - 1) + [(0, packed_queries - num_queries)], constant_values=value)
  padded_len = round_up(seq_len, max(config.block_kv, kernel.NUM_CONSUMERS * kernel.BLOCK_ROWS))
  tiles, tile_kv_len = _tiles(index, kv_len, packed_queries)
  dq, dk, dv = backward_kernel.backward(
      pad_to(q, 1, packed_queries), pad_to(k, 1, padded_len), pad_to(v, 1, padded_len),
      pad_to(d_out, 1, packed_queries), pad_rows(lse2, jnp.inf), pad_rows(delta),
      pad_rows(d_lse), tiles,
      tile_kv_len, kv_len, scale=params.scale, config=config, interpret=params.interpret)
  return dq[:, :num_queries], dk[:, :seq_len], dv[:, :seq_len]


BACKEND = KernelBackend(
    _dispatch.Backend("mosaic_gpu", is_kernel=True, dtypes=_dispatch.HALF_FLOATS,
                      device="hopper", limits=head_dim_limit),
    forward, backward)
