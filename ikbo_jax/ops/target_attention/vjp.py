"""The kernel paths' `custom_vjp`, wired once: a backend brings its forward and its backward.

A `KernelBackend` declares what it supports (`_dispatch.Backend`) and owns
two functions over arrays and `Params`:

- `forward(params, q, k, v, index, kv_len, save_lse) -> (out, lse or None)`;
- `backward(params, q, k, v, out, lse, index, kv_len, d_out, d_lse) -> (dq, dk, dv)`,
  where `lse` is the forward's float32 log-sum-exp and `d_lse` is None when
  the caller did not ask for the lse.

The residuals are the inputs, the output and the lse: every backward
recomputes the probabilities from the lse (FlashAttention-2).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from ikbo_jax import _dispatch
from ikbo_jax.ops.target_attention.params import Params


@dataclasses.dataclass(frozen=True)
class KernelBackend:
  support: _dispatch.Backend
  forward: Callable
  backward: Callable

  @property
  def name(self) -> str:
    return self.support.name


def output_cotangent_dot(out, d_out, d_lse):
  """`(delta0, d_lse)`, float32 `[B, T, H]`: FlashAttention's estimate of what backwards subtract.

  The softmax backward subtracts `delta = sum_j p_j dp_j - d_lse` from
  `dp = d_out v^T` (`d lse / d logits = p`, so the lse's cotangent enters as
  a shift). `delta0 = rowsum(out * d_out) - d_lse` is that value up to the
  rounding of `out` to its 16 bits, which the kernels' dq pass corrects; they
  take `d_lse` (zeros where the caller had no lse cotangent) for it.
  """
  delta = jnp.einsum("bthd,bthd->bth", out.astype(jnp.float32), d_out.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
  d_lse = jnp.zeros_like(delta) if d_lse is None else d_lse.astype(jnp.float32)
  return delta - d_lse, d_lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def kernel_attention(backend: KernelBackend, params: Params, q, k, v, index, kv_len):
  """`out`, or `(out, lse)` with `params.return_lse`, on `backend`'s kernels."""
  out, lse = backend.forward(params, q, k, v, index, kv_len, save_lse=params.return_lse)
  return (out, lse) if params.return_lse else out


def _forward(backend, params, q, k, v, index, kv_len):
  out, lse = backend.forward(params, q, k, v, index, kv_len, save_lse=True)
  return ((out, lse) if params.return_lse else out), (q, k, v, out, lse, index, kv_len)


def _backward(backend, params, residuals, cotangents):
  d_out, d_lse = cotangents if params.return_lse else (cotangents, None)
  dq, dk, dv = backend.backward(params, *residuals, d_out, d_lse)
  return dq, dk, dv, None, None


kernel_attention.defvjp(_forward, _backward)
