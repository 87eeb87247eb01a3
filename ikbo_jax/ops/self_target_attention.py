"""Self + target attention over one per-user K/V: the users' sequence and their candidates.

`out_user[u] = attention(q_user[u], k[u], v[u])` (non-causal by default, or
causal) and `out_cand[b] = attention(q_cand[b], k[u(b)], v[u(b)])`, both over
keys `< kv_len[u]`; user query rows at positions `>= kv_len[u]` are padding and
come out as zeros (`docs/design.md`). The Mosaic GPU path computes both in one
launch; its backward sums the K/V gradients of both query kinds.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

from ikbo_jax import _dispatch
from ikbo_jax import _validation as checks
from ikbo_jax.index import CandidateIndex
from ikbo_jax.kernels.triton import target_attention_backward as triton_backward
from ikbo_jax.ops import self_target_attention_xla as xla
from ikbo_jax.ops import target_attention as target
from ikbo_jax.ops import target_attention_mosaic as mosaic
from ikbo_jax.ops.target_attention_xla import zero_past_length

Implementation = Literal["xla", "mosaic_gpu"]
# In order of preference for `implementation=None`.
BACKENDS = (
    _dispatch.Backend("mosaic_gpu", is_kernel=True, dtypes=_dispatch.HALF_FLOATS,
                      device="hopper", limits=target.mosaic_head_dim_limit),
    _dispatch.Backend("xla", is_kernel=False),
)
IMPLEMENTATIONS = _dispatch.names(BACKENDS)
_F32 = jnp.float32


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fused(scale, causal, interpret, masked, q_user, q_cand, k, v, index, kv_len):
  """`masked`: the caller gave lengths, so rows past them may be padding (any value)."""
  out_user, out_cand, _ = mosaic.self_target_forward(
      q_user, q_cand, k, v, index, kv_len, scale=scale, causal=causal, save_lse=False,
      mask_past_length=masked, interpret=interpret)
  return out_user, out_cand


def _fused_fwd(scale, causal, interpret, masked, q_user, q_cand, k, v, index, kv_len):
  out_user, out_cand, lse = mosaic.self_target_forward(
      q_user, q_cand, k, v, index, kv_len, scale=scale, causal=causal, save_lse=True,
      mask_past_length=masked, interpret=interpret)
  return (out_user, out_cand), (q_user, q_cand, k, v, out_cand, lse, index, kv_len)


def _fused_bwd(scale, causal, interpret, masked, residuals, cotangents):
  """Candidate side on the Triton backward kernels, user side on cuDNN (XLA off the GPU)."""
  q_user, q_cand, k, v, out_cand, lse, index, kv_len = residuals
  d_out_user, d_out_cand = cotangents
  d_q_cand, d_k_cand, d_v_cand = triton_backward.target_attention_backward(
      q_cand, k, v, out_cand, lse, d_out_cand, None, index, kv_len, scale=scale,
      interpret=interpret)
  on_gpu = not interpret and jax.default_backend() == "gpu"
  self_attention = (functools.partial(_self_attention_cudnn, masked=masked) if on_gpu
                    else xla.self_attention)
  _, self_vjp = jax.vjp(
      lambda q_, k_, v_: self_attention(q_, k_, v_, kv_len, scale=scale, causal=causal),
      q_user, k, v)
  d_q_user, d_k_user, d_v_user = self_vjp(d_out_user)
  total = lambda a, b: (a.astype(_F32) + b.astype(_F32)).astype(a.dtype)
  return (d_q_user, d_q_cand, total(d_k_cand, d_k_user), total(d_v_cand, d_v_user), None, None)


_fused.defvjp(_fused_fwd, _fused_bwd)


def default_implementation(dtype, head_dim: int) -> str:
  """The implementation `implementation=None` runs for these inputs on the default device."""
  return _dispatch.resolve(BACKENDS, None, dtype, interpret=False, head_dim=head_dim).name


def self_target_attention(q_user, q_cand, k, v, index: CandidateIndex, *, kv_len=None,
                          scale: float | None = None, causal: bool = False,
                          implementation: Implementation | None = None, checked: bool = False,
                          interpret: bool = False):
  """Self-attention of each user's sequence and target attention of its candidates, one K/V.

  Args:
    q_user: `[U, S, H, D]` queries from the user sequence.
    q_cand: `[B, T, H, D]` candidate queries (`T` query tokens per candidate).
    k: `[U, S, H, D]` keys, shared by both query kinds, stored once per user.
    v: `[U, S, H, D]` values, likewise.
    index: the `CandidateIndex` mapping candidates to users (`num_users == U`).
    kv_len: optional `int[U]`, each user's valid sequence length (default `S`):
      keys `>= kv_len[u]` are masked for both query kinds, and user query rows
      `>= kv_len[u]` are padding and come out as zeros.
    scale: the logit scale; default `1 / sqrt(D)`.
    causal: user query `s` sees keys `<= s` only (candidates always see the
      whole valid history).
    implementation: `"xla"` (reference, any device) or `"mosaic_gpu"` (one
      Hopper launch for both kinds, bfloat16/float16, D in {64, 128}); None
      picks `"mosaic_gpu"` where it applies, else `"xla"`. A named
      implementation runs or raises.
    checked: also check with `checkify.check` that ids lie in `[0, U)` and
      lengths in `[0, S]`; without it they are clamped.
    interpret: run the kernel under the Pallas interpreter (CPU tests).

  Returns:
    `(out_user [U, S, H, D], out_cand [B, T, H, D])` in the input dtype.

  >>> import jax, jax.numpy as jnp
  >>> from ikbo_jax import CandidateIndex, self_target_attention
  >>> index = CandidateIndex.from_mapping(jnp.array([1, 0, 1]), num_users=2)
  >>> ks = jax.random.split(jax.random.key(0), 4)
  >>> q_user = jax.random.normal(ks[0], (2, 16, 2, 8))   # 2 users, 16 history items
  >>> q_cand = jax.random.normal(ks[1], (3, 4, 2, 8))    # 3 candidates, 4 query tokens
  >>> k = jax.random.normal(ks[2], (2, 16, 2, 8))
  >>> v = jax.random.normal(ks[3], (2, 16, 2, 8))
  >>> out_user, out_cand = self_target_attention(
  ...     q_user, q_cand, k, v, index, kv_len=jnp.array([16, 5]), causal=True)
  >>> out_user.shape, out_cand.shape
  ((2, 16, 2, 8), (3, 4, 2, 8))
  >>> bool(jnp.all(out_user[1, 5:] == 0))  # user 1's rows past its length are padding
  True
  """
  target.check_args(q_cand, k, v, index, kv_len, q_name="q_cand")
  checks.check_operands(q_user=(q_user, ("U", "S", "H", "D")))
  for axis, meaning in enumerate(("U, from k", "S, from k", "H, from k", "D, from k")):
    checks.check_dim("q_user", q_user, axis, k.shape[axis], meaning)
  q_user, q_cand, k, v = (jnp.asarray(x) for x in (q_user, q_cand, k, v))  # NumPy inputs too
  dtype = checks.check_float_dtypes(q_user=q_user, q_cand=q_cand, k=k, v=v)
  interpret = checks.check_flag("interpret", interpret)
  implementation = _dispatch.resolve(BACKENDS, implementation, dtype, interpret=interpret,
                                     head_dim=k.shape[-1]).name
  masked = kv_len is not None
  kv_len = target.prepare_kv_len(kv_len, index, k.shape[1], checks.check_flag("checked", checked))
  scale = checks.resolve_scale(scale, k.shape[-1])
  causal = checks.check_flag("causal", causal)
  _dispatch.reverse_mode_only("ikbo_jax.self_target_attention", q_user, q_cand, k, v)
  if implementation == "mosaic_gpu":
    return _fused(scale, causal, interpret, masked,
                  *_dispatch.common_varying_axes(q_user, q_cand, k, v, index, kv_len))
  return xla.self_target(q_user, q_cand, k, v, index.clamped_cand_to_user, kv_len, scale=scale,
                         causal=causal)
