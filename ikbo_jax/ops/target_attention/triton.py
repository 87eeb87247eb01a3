"""Target attention on the Pallas Triton kernels: any CUDA GPU, any float dtype.

The forward reads K/V by index with masked loads (no padding). The backward
pads K/V at batch U to whole key blocks first, so that no load or store of
its kernels reaches past the end of the sequence axis and the masks guard
nothing but `kv_len`. It was added for a defect seen on the H200: with a
history of one position (S = 1) the gradients came out of order 1e29 although
every access past S was masked (`test_gpu_backward_with_a_single_position_history`
checks it). The padding costs a copy of K/V at batch U, only when S is not a
multiple of the key block.
"""

from __future__ import annotations

from ikbo_jax import _dispatch
from ikbo_jax._padding import pad_to, round_up
from ikbo_jax.kernels.triton import target_attention as kernel
from ikbo_jax.kernels.triton import target_attention_backward as backward_kernel
from ikbo_jax.ops.target_attention.params import Params
from ikbo_jax.ops.target_attention.vjp import KernelBackend, output_cotangent_dot


def _head_dim_limit(head_dim: int) -> str | None:
  # Triton's block shapes are powers of two and its dot needs at least 16.
  if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
    return f"supports head dims D that are powers of two in [16, 256], got D={head_dim}"
  return None


def forward(params: Params, q, k, v, index, kv_len, save_lse: bool):
  del save_lse  # the lse comes with the output at no extra cost
  return kernel.target_attention_forward(q, k, v, index.clamped_cand_to_user, kv_len,
                                         scale=params.scale, interpret=params.interpret)


def backward(params: Params, q, k, v, out, lse, index, kv_len, d_out, d_lse,
             config: kernel.Config = kernel.Config()):
  """`(dq, dk, dv)`; the kernels load only rows before `kv_len`, so padding is never read."""
  seq_len = k.shape[1]
  padded_len = round_up(seq_len, config.block_s)
  dq, dk, dv = backward_kernel.target_attention_backward(
      q, pad_to(k, 1, padded_len), pad_to(v, 1, padded_len), lse,
      *output_cotangent_dot(out, d_out, d_lse), d_out,
      index.clamped_cand_to_user, index.user_offsets, index.sort_order, kv_len,
      scale=params.scale, config=config, interpret=params.interpret)
  return dq, dk[:, :seq_len], dv[:, :seq_len]


BACKEND = KernelBackend(
    _dispatch.Backend("triton", is_kernel=True, device="gpu", limits=_head_dim_limit),
    forward, backward)
