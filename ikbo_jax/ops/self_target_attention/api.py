"""Self + target attention over one per-user K/V: the users' sequence and their candidates.

`out_user[u] = attention(q_user[u], k[u], v[u])` (non-causal by default, or
causal) and `out_cand[b] = attention(q_cand[b], k[u(b)], v[u(b)])`, both over
keys `< kv_len[u]`; user query rows at positions `>= kv_len[u]` are padding and
come out as zeros (`docs/design.md`). This module holds the public op, its
validation and dispatch; `xla.py` the XLA implementation; `mosaic_gpu.py` the
one-launch Hopper kernel path and its backward.
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp

from ikbo_jax import _dispatch
from ikbo_jax import _validation as checks
from ikbo_jax.index import CandidateIndex
from ikbo_jax.ops import target_attention as target
from ikbo_jax.ops.self_target_attention import mosaic_gpu, xla

Implementation = Literal["xla", "mosaic_gpu"]
# In order of preference for `implementation=None`.
BACKENDS = (
    mosaic_gpu.SUPPORT,
    _dispatch.Backend("xla", is_kernel=False),
)
IMPLEMENTATIONS = _dispatch.names(BACKENDS)


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
    params = mosaic_gpu.Params(scale=scale, causal=causal, masked=masked, interpret=interpret)
    return mosaic_gpu.fused(params,
                            *_dispatch.common_varying_axes(q_user, q_cand, k, v, index, kv_len))
  return xla.self_target(q_user, q_cand, k, v, index.clamped_cand_to_user, kv_len, scale=scale,
                         causal=causal)
