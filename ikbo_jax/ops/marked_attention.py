"""`attention`: dot-product attention that `ikbo_jax.rewrite` recognizes (a marker, not a pattern).

`jax.nn.dot_product_attention` is inlined into primitives whose shape changes
with dtype, masks and options, so matching it structurally would be brittle.
Models that want their attention rewritten call `attention` instead (directly,
or through `flax_attention_fn` as `nnx.MultiHeadAttention`'s `attention_fn`):
it computes the same thing with `jax.nn.dot_product_attention`, inside a named
`jit` that the rewrite finds in the jaxpr (`marked_options`). The rewrite's
rule for it lives in `ikbo_jax/rewrite/marker.py`; this module, which models
import, knows nothing of the rewrite.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ikbo_jax.ops.target_attention.xla import in_history

_PREFIX = "ikbo_marked_attention_"
_OPTIONS: dict[str, tuple[bool, float | None, str | None]] = {}


def attention(q, k, v, kv_len=None, *, scale: float | None = None, causal: bool = False,
              implementation: str | None = None):
  """`jax.nn.dot_product_attention(q, k, v)` over keys `< kv_len[b]`, rows without keys zero.

  Keys at or past `kv_len[b]` are never read: they do not reach the output whatever they
  hold, and their gradients are exactly zero.

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
  fn = marked(bool(causal), None if scale is None else float(scale), implementation)
  return fn(q, k, v) if kv_len is None else fn(q, k, v, kv_len)


@functools.cache
def marked(causal: bool, scale: float | None, implementation: str | None):
  """The marked attention function for these options: a named `jit` of `jax.nn.dot_product_attention`."""
  def impl(q, k, v, kv_len=None):
    lengths = None if kv_len is None else jnp.maximum(kv_len, 1)
    if kv_len is not None:
      # Keys past a row's length are never read, in either direction: zeroed by a select,
      # whatever they hold (a padding NaN or Inf) and whatever the output's cotangent is
      # (a NaN one would otherwise reach them as 0 * NaN), as IKBO's kernels skip them.
      valid = in_history(kv_len, k.shape[1])
      k, v = (jnp.where(valid, x, jnp.zeros((), x.dtype)) for x in (k, v))
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
  plain = (bias is None and mask is None and module is None and query.ndim == 4
           and (deterministic or dropout_rate == 0.0))
  if plain:
    return attention(query, key, value, causal=is_causal).astype(dtype or query.dtype)
  return nnx.dot_product_attention(query, key, value, bias, mask, dropout_rate=dropout_rate,
                                   deterministic=deterministic, is_causal=is_causal,
                                   module=module, dtype=dtype, **kwargs)


def marked_options(eqn) -> tuple[bool, float | None, str | None] | None:
  """`(causal, scale, implementation)` of a marked attention call, or None for any other equation."""
  return _OPTIONS.get(str(eqn.params.get("name", "")))
