"""Target attention with in-kernel broadcast: candidates attend to their user's shared K/V.

`out[b, i, h] = softmax_{j < kv_len[u(b)]}(scale * q[b, i, h] . k[u(b), j, h]) @ v[u(b), :, h]`
with `u = cand_to_user` (`docs/design.md`). This module holds the public op, its
validation and its dispatch. The XLA implementations (`xla.py`) differentiate
by autodiff; the kernel backends (`triton.py`, `mosaic_gpu.py`) each bring a
forward and a backward, run under the one `custom_vjp` in `vjp.py`.
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp
from jax.experimental import checkify

from ikbo_jax import _dispatch
from ikbo_jax import _validation as checks
from ikbo_jax.index import CandidateIndex, as_int32
from ikbo_jax.ops.target_attention import mosaic_gpu, triton, xla
from ikbo_jax.ops.target_attention.params import Params
from ikbo_jax.ops.target_attention.vjp import kernel_attention

Implementation = Literal["xla_materialized", "xla", "triton", "mosaic_gpu"]

KERNEL_BACKENDS = {b.name: b for b in (mosaic_gpu.BACKEND, triton.BACKEND)}
# In order of preference for `implementation=None`.
BACKENDS = (
    mosaic_gpu.BACKEND.support,
    triton.BACKEND.support,
    _dispatch.Backend("xla", is_kernel=False),
    _dispatch.Backend("xla_materialized", is_kernel=False, default_dtypes=()),
)
IMPLEMENTATIONS = _dispatch.names(BACKENDS)


def default_implementation(dtype, head_dim: int) -> str:
  """The implementation `implementation=None` runs for these inputs on the default device."""
  return _dispatch.resolve(BACKENDS, None, dtype, interpret=False, head_dim=head_dim).name


def target_attention(q, k, v, index: CandidateIndex, *, kv_len=None, scale: float | None = None,
                     return_lse: bool = False, implementation: Implementation | None = None,
                     checked: bool = False, interpret: bool = False):
  """Each candidate's queries attend to its user's keys and values, stored once per user.

  Args:
    q: `[B, T, H, D]` candidate queries (`T` query tokens per candidate, n_seed).
    k: `[U, S, H, D]` user keys (each user's behaviour sequence, padded to `S`).
    v: `[U, S, H, D]` user values.
    index: the `CandidateIndex` mapping candidates to users (`num_users == U`).
    kv_len: optional `int[U]`, the valid history length of each user (keys
      `j >= kv_len[u]` are masked); default `S` for every user. A user with
      `kv_len == 0` gets zero outputs and `lse = -inf`.
    scale: the logit scale; default `1 / sqrt(D)`.
    return_lse: also return the float32 log-sum-exp of the scaled, masked
      logits, `[B, T, H]`.
    implementation: `"xla_materialized"` (baseline: copies K/V to every
      candidate), `"xla"` (candidates a chunk at a time, never a full copy),
      `"triton"` (flash-attention kernel reading K/V by index, one program per
      candidate block), `"mosaic_gpu"` (Hopper kernel packing several
      candidates of one user into each query tile, bfloat16/float16, D in
      {64, 128}), or None: `"mosaic_gpu"` on a Hopper GPU where it applies,
      `"triton"` on other GPUs, `"xla"` elsewhere. A named implementation runs
      or raises.
    checked: also check with `checkify.check` that ids lie in `[0, U)` and
      lengths in `[0, S]`. Without it, out-of-range ids are clamped to
      `[0, U)` and lengths to `[0, S]`.
    interpret: run a kernel implementation under the Pallas interpreter (CPU tests).

  Returns:
    `[B, T, H, D]` in the input dtype, and the lse when `return_lse`.

  >>> import jax, jax.numpy as jnp
  >>> from ikbo_jax import CandidateIndex, target_attention
  >>> index = CandidateIndex.from_mapping(jnp.array([1, 0, 1]), num_users=2)
  >>> ks = jax.random.split(jax.random.key(0), 3)
  >>> q = jax.random.normal(ks[0], (3, 4, 2, 8))         # 3 candidates, 4 query tokens
  >>> k = jax.random.normal(ks[1], (2, 16, 2, 8))        # 2 users, 16 history items
  >>> v = jax.random.normal(ks[2], (2, 16, 2, 8))
  >>> target_attention(q, k, v, index, kv_len=jnp.array([16, 5])).shape
  (3, 4, 2, 8)
  """
  check_args(q, k, v, index, kv_len)
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)  # NumPy inputs index like arrays
  dtype = checks.check_float_dtypes(q=q, k=k, v=v)
  interpret = checks.check_flag("interpret", interpret)
  implementation = _dispatch.resolve(BACKENDS, implementation, dtype, interpret=interpret,
                                     head_dim=q.shape[-1]).name
  params = Params(scale=checks.resolve_scale(scale, q.shape[-1]), masked=kv_len is not None,
                  return_lse=checks.check_flag("return_lse", return_lse), interpret=interpret)
  kv_len = prepare_kv_len(kv_len, index, k.shape[1], checks.check_flag("checked", checked))
  if implementation != "xla_materialized":
    _dispatch.reverse_mode_only("ikbo_jax.target_attention", q, k, v)
  if implementation in KERNEL_BACKENDS:
    return kernel_attention(KERNEL_BACKENDS[implementation], params,
                            *_dispatch.common_varying_axes(q, k, v, index, kv_len))
  impl = xla.materialized if implementation == "xla_materialized" else xla.chunked
  out, lse = impl(q, k, v, index.clamped_cand_to_user, kv_len, scale=params.scale)
  return (out, lse) if params.return_lse else out


def prepare_kv_len(kv_len, index: CandidateIndex, seq_len: int, checked: bool):
  """`kv_len` as `int32[U]` clamped to `[0, S]` (default `S`), checked first when `checked`.

  A length past int32's range saturates instead of wrapping around, so the
  check and the clamp see it as out of range.
  """
  if checked:
    index.check()
  if kv_len is None:
    return jnp.full((index.num_users,), seq_len, jnp.int32)
  kv_len = as_int32(kv_len, "kv_len")
  if checked:
    checkify.check(jnp.all((kv_len >= 0) & (kv_len <= seq_len)),
                   f"kv_len values must lie in [0, S={seq_len}]; got min {{lo}}, max {{hi}}",
                   lo=jnp.min(kv_len), hi=jnp.max(kv_len))
  return jnp.clip(kv_len, 0, seq_len)


def check_args(q, k, v, index, kv_len, *, q_name: str = "q") -> None:
  """Shapes, ranks and dtypes of the attention operands; `q_name` is what the caller calls `q`."""
  checks.check_index(index)
  layout = ("U", "S", "H", "D")
  checks.check_operands(**{q_name: (q, ("B", "T", "H", "D"))}, k=(k, layout), v=(v, layout))
  checks.check_dim(q_name, q, 0, index.num_candidates, "B, from index.cand_to_user")
  checks.check_dim("v", v, 1, k.shape[1], "S, from k")
  for name, x in (("k", k), ("v", v)):
    checks.check_dim(name, x, 0, index.num_users, "U, from index.num_users")
    checks.check_dim(name, x, 2, q.shape[2], f"H, from {q_name}")
    checks.check_dim(name, x, 3, q.shape[3], f"D, from {q_name}")
  if kv_len is not None:
    kv_len = jnp.asarray(kv_len)
    checks.check_rank("kv_len", kv_len, 1, "[U]")
    checks.check_dim("kv_len", kv_len, 0, index.num_users, "U, from index.num_users")
    if not jnp.issubdtype(kv_len.dtype, jnp.integer):
      raise TypeError(f"kv_len must be an integer array, got dtype {kv_len.dtype}")
