"""XLA reference of self + target attention: the semantics the fused kernel is tested against.

Shapes: `q_user, k, v [U, S, H, D]`, `q_cand [B, T, H, D]`, `cand_to_user int32[B]`
(clamped to `[0, U)`), `kv_len int32[U]` (clamped to `[0, S]`).
"""

from __future__ import annotations

from ikbo_jax.ops.target_attention import xla as target_xla


def self_attention(q_user, k, v, kv_len, *, scale: float, causal: bool, precision=None):
  """Each user's queries over its own keys `< kv_len`; padded query rows are zeros (never read)."""
  out, _ = target_xla.attention(target_xla.zero_past_length(q_user, kv_len),
                                          k, v, kv_len, scale=scale, causal=causal,
                                          precision=precision)
  return target_xla.zero_past_length(out, kv_len).astype(q_user.dtype)


def self_target(q_user, q_cand, k, v, cand_to_user, kv_len, *, scale: float, causal: bool,
                precision=None):
  """`(out_user, out_cand)`: self-attention of the users, target attention of the candidates."""
  out_user = self_attention(q_user, k, v, kv_len, scale=scale, causal=causal,
                            precision=precision)
  out_cand, _ = target_xla.chunked(q_cand, k, v, cand_to_user, kv_len, scale=scale,
                                             precision=precision)
  return out_user, out_cand
