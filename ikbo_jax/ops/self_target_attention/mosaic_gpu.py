"""Self + target attention on the Mosaic GPU kernel: both query kinds in one Hopper launch.

The forward is the target-attention kernel with the users' own query tiles
dealt out beside the candidate tiles (`ops.target_attention.mosaic_gpu`). The
backward sums the K/V gradients of both query kinds: the candidate side runs
the target-attention backend's backward, the user side cuDNN's fused
attention backward (XLA's autodiff off the GPU).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ikbo_jax.ops.self_target_attention import xla
from ikbo_jax.ops.target_attention import mosaic_gpu as target_mosaic
from ikbo_jax.ops.target_attention.params import Params as TargetParams
from ikbo_jax.ops.target_attention.xla import zero_past_length

_F32 = jnp.float32
# The fused launch runs where the target-attention kernel runs.
SUPPORT = target_mosaic.BACKEND.support


@dataclasses.dataclass(frozen=True)
class Params:
  """The static parameters of one call (see `ops.target_attention.params.Params`)."""

  scale: float
  causal: bool
  masked: bool
  interpret: bool = False


def _self_attention_cudnn(q_user, k, v, kv_len, *, scale: float, causal: bool, masked: bool):
  """`xla.self_attention` on cuDNN's fused attention (GPU only; bfloat16/float16).

  cuDNN's padding mask takes the same lengths for queries and keys. A user with
  `kv_len == 0` is given one key (its row is zeroed below, so its gradient is
  zero) because a fully masked softmax would be 0/0 inside cuDNN. That mask
  applies to the logits only, so with lengths given (`masked`) the padding
  rows are zeroed first: its backward would multiply them by zeros, and
  `0 * NaN` is NaN. cuDNN's masked training path also wants an even sequence
  length: an odd `S` gets one padding position, past every length.
  """
  if masked:
    q_user, k, v = (zero_past_length(x, kv_len) for x in (q_user, k, v))
  seq_len = q_user.shape[1]
  if seq_len % 2:
    pad = ((0, 0), (0, 1), (0, 0), (0, 0))
    q_user, k, v = (jnp.pad(x, pad) for x in (q_user, k, v))
  out = jax.nn.dot_product_attention(
      q_user, k, v, scale=scale, is_causal=causal, query_seq_lengths=jnp.maximum(kv_len, 1),
      key_value_seq_lengths=jnp.maximum(kv_len, 1), implementation="cudnn")
  return zero_past_length(out[:, :seq_len], kv_len).astype(q_user.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fused(params: Params, q_user, q_cand, k, v, index, kv_len):
  """`(out_user, out_cand)` in one launch."""
  out_user, out_cand, _ = target_mosaic.self_target_forward(
      q_user, q_cand, k, v, index, kv_len, scale=params.scale, causal=params.causal,
      save_lse=False, mask_past_length=params.masked, interpret=params.interpret)
  return out_user, out_cand


def _fused_fwd(params: Params, q_user, q_cand, k, v, index, kv_len):
  out_user, out_cand, lse = target_mosaic.self_target_forward(
      q_user, q_cand, k, v, index, kv_len, scale=params.scale, causal=params.causal,
      save_lse=True, mask_past_length=params.masked, interpret=params.interpret)
  return (out_user, out_cand), (q_user, q_cand, k, v, out_cand, lse, index, kv_len)


def _fused_bwd(params: Params, residuals, cotangents):
  """Candidate side on the target-attention backward, user side on cuDNN (XLA off the GPU)."""
  q_user, q_cand, k, v, out_cand, lse, index, kv_len = residuals
  d_out_user, d_out_cand = cotangents
  target_params = TargetParams(scale=params.scale, masked=params.masked, return_lse=False,
                               interpret=params.interpret)
  d_q_cand, d_k_cand, d_v_cand = target_mosaic.BACKEND.backward(
      target_params, q_cand, k, v, out_cand, lse, index, kv_len, d_out_cand, None)
  on_gpu = not params.interpret and jax.default_backend() == "gpu"
  self_attention = (functools.partial(_self_attention_cudnn, masked=params.masked) if on_gpu
                    else xla.self_attention)
  _, self_vjp = jax.vjp(
      lambda q_, k_, v_: self_attention(q_, k_, v_, kv_len, scale=params.scale,
                                        causal=params.causal),
      q_user, k, v)
  d_q_user, d_k_user, d_v_user = self_vjp(d_out_user)
  total = lambda a, b: (a.astype(_F32) + b.astype(_F32)).astype(a.dtype)
  return (d_q_user, d_q_cand, total(d_k_cand, d_k_user), total(d_v_cand, d_v_user), None, None)


fused.defvjp(_fused_fwd, _fused_bwd)
