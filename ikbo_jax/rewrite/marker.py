"""`attention`: dot-product attention the rewrite recognizes (a marker, not a pattern match).

`jax.nn.dot_product_attention` is inlined into primitives whose shape changes
with dtype, masks and options, so matching it structurally would be brittle.
Models that want their attention rewritten call `ikbo_jax.rewrite.attention`
instead (directly, or as `nnx.MultiHeadAttention(attention_fn=...)`-style
hooks): it computes the same thing with `jax.nn.dot_product_attention`, inside
a named `jit` that the rewrite finds in the jaxpr. When its keys and values are
broadcasts of user rows by the mapping, it becomes `ikbo_jax.target_attention`;
when its queries are too, it runs at batch U as written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ikbo_jax import _dispatch
from ikbo_jax.rewrite.report import FORWARD_MODE, Decline
from ikbo_jax.rewrite.values import Broadcast, Plain, RowConstant

_PREFIX = "ikbo_marked_attention_"
_OPTIONS: dict[str, tuple[bool, float | None, str | None]] = {}


def attention(q, k, v, kv_len=None, *, scale: float | None = None, causal: bool = False,
              implementation: str | None = None):
  """`jax.nn.dot_product_attention(q, k, v)` over keys `< kv_len[b]`, rows without keys zero.

  Args:
    q: `[B, T, H, D]` queries.
    k: `[B, S, H, D]` keys.
    v: `[B, S, H, D]` values.
    kv_len: optional `int[B]` valid key counts (default `S`).
    scale: logit scale (default `1 / sqrt(D)`).
    causal: query `t` sees keys `<= t` only.
    implementation: passed to `jax.nn.dot_product_attention` (`"xla"`, `"cudnn"`, None).
  """
  if implementation not in (None, "xla", "cudnn"):
    raise ValueError(f"implementation must be None, 'xla' or 'cudnn', got {implementation!r}")
  marked = _marked(bool(causal), None if scale is None else float(scale), implementation)
  return marked(q, k, v) if kv_len is None else marked(q, k, v, kv_len)


@functools.cache
def _marked(causal: bool, scale: float | None, implementation: str | None):
  def impl(q, k, v, kv_len=None):
    lengths = None if kv_len is None else jnp.maximum(kv_len, 1)
    q_lengths = None if lengths is None else jnp.full(lengths.shape, q.shape[1], jnp.int32)
    out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                       query_seq_lengths=q_lengths,
                                       key_value_seq_lengths=lengths,
                                       implementation=implementation)
    if kv_len is not None:
      out = jnp.where((kv_len > 0)[:, None, None, None], out, 0).astype(out.dtype)
    return out

  impl.__name__ = f"{_PREFIX}{len(_OPTIONS)}"
  _OPTIONS[impl.__name__] = (causal, scale, implementation)
  return jax.jit(impl)


def flax_attention_fn(query, key, value, bias=None, mask=None, *, dropout_rate: float = 0.0,
                      deterministic: bool = True, is_causal: bool = False, module=None,
                      dtype=None, **kwargs):
  """An `attention_fn` for `nnx.MultiHeadAttention` that the rewrite recognizes.

  Without bias, mask, dropout or sown weights it is `attention(query, key,
  value, causal=is_causal)`; with any of them it is `nnx.dot_product_attention`
  unchanged (and runs as written).

  >>> from flax import nnx
  >>> from ikbo_jax import rewrite
  >>> mha = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False,
  ...                              attention_fn=rewrite.flax_attention_fn, rngs=nnx.Rngs(0))
  """
  from flax import nnx

  plain = (bias is None and mask is None and module is None and query.ndim == 4
           and (deterministic or dropout_rate == 0.0))
  if plain:
    return attention(query, key, value, causal=is_causal).astype(dtype or query.dtype)
  return nnx.dot_product_attention(query, key, value, bias, mask, dropout_rate=dropout_rate,
                                   deterministic=deterministic, is_causal=is_causal,
                                   module=module, dtype=dtype, **kwargs)


def is_marker(eqn) -> bool:
  return str(eqn.params.get("name", "")).startswith(_PREFIX)


def rule(rw, eqn, operands):
  from ikbo_jax.index import CandidateIndex
  from ikbo_jax.ops.target_attention import target_attention

  causal, scale, implementation = _OPTIONS[eqn.params["name"]]
  q, k, v, *kv_len = operands
  if not (isinstance(k, Broadcast) and isinstance(v, Broadcast) and k.ids is v.ids
          and k.axis == v.axis == 0):
    raise Decline("its keys and values are not broadcasts by one index")
  if kv_len and not (isinstance(kv_len[0], Broadcast) and kv_len[0].ids is k.ids):
    raise Decline("its key lengths are not a broadcast by the keys' index")
  lengths = [kv_len[0].user] if kv_len else []
  if isinstance(q, Broadcast) and q.ids is k.ids and q.axis == 0:  # all user rows: run at U
    out = _marked(causal, scale, implementation)(q.user, k.user, v.user, *lengths)
    rw.report.add("at_users", eqn)
    return [q.like(out)]
  if causal:
    raise Decline("causal attention of candidate queries over user keys")
  if _dispatch.forward_mode(q, k, v):
    raise Decline(FORWARD_MODE)
  if not isinstance(q, (Plain, RowConstant)):
    raise Decline("its queries are neither candidate values nor user rows of the keys' index")
  q = q.value if isinstance(q, Plain) else q.materialize()
  k_user, v_user = k.user, v.user
  if q.shape[2] != k_user.shape[2]:  # grouped queries: each key head serves a group, as in jax.nn
    group = q.shape[2] // k_user.shape[2]
    k_user, v_user = (jnp.repeat(x, group, axis=2) for x in (k_user, v_user))
  out = target_attention(q, k_user, v_user, CandidateIndex.from_mapping(k.ids, k.num_users),
                         kv_len=lengths[0] if lengths else None, scale=scale)
  rw.report.add("target_attention", eqn)
  return [Plain(out.astype(eqn.outvars[0].aval.dtype), True)]
