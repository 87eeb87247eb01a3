"""Linear compression with in-kernel broadcast: the public op, dispatch and gradients.

`out[b] = W @ concat(E_user[u(b)], E_cand[b])` computed as
`W_cand @ E_cand[b] + user_res[u(b)]` with `user_res[u] = W_user @ E_user[u]` at
batch U (`docs/design.md`).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax

from ikbo_jax import _dispatch
from ikbo_jax import _validation as v
from ikbo_jax._padding import pad_to_multiple
from ikbo_jax.index import CandidateIndex
from ikbo_jax.kernels.triton import linear_compression as triton_kernel
from ikbo_jax.ops import linear_compression_mosaic as mosaic
from ikbo_jax.ops import linear_compression_xla as xla

Implementation = Literal["xla_materialized", "xla", "triton", "mosaic_gpu"]
# In order of preference for `implementation=None`. Triton runs float32 too, but
# the XLA path is the default there (float32 GEMMs gain nothing from the fusion).
BACKENDS = (
    _dispatch.Backend("mosaic_gpu", is_kernel=True, dtypes=_dispatch.HALF_FLOATS,
                      device="hopper"),
    _dispatch.Backend("triton", is_kernel=True, device="gpu",
                      default_dtypes=_dispatch.HALF_FLOATS),
    _dispatch.Backend("xla", is_kernel=False),
    _dispatch.Backend("xla_materialized", is_kernel=False, default_dtypes=()),
)
IMPLEMENTATIONS = _dispatch.names(BACKENDS)


def triton_residual_forward(w_cand, e_cand, res, cand_to_row, *, interpret):
  """`W_cand @ e_cand[b] + res[cand_to_row[b]]` on the Triton kernel, `res` float32."""
  # 16-byte rows for the (small, L2-resident) weight; the masked K loop ignores the zeros.
  return triton_kernel.fused_candidate_gemm(
      pad_to_multiple(w_cand, 1, 8), e_cand, res, cand_to_row, interpret=interpret)


def _triton_forward(w_user, w_cand, e_user, e_cand, cand_to_user, *, interpret):
  return triton_residual_forward(w_cand, e_cand, xla.user_result(w_user, e_user), cand_to_user,
                                 interpret=interpret)


def _forward(implementation: str, interpret: bool, *args):
  match implementation:
    case "xla":
      return xla.decomposed(*args)
    case "triton":
      return _triton_forward(*args, interpret=interpret)
    case "mosaic_gpu":
      return mosaic.forward(*args, interpret=interpret)[0]
  raise AssertionError(implementation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _lce(implementation, interpret, num_users, w_user, w_cand, e_user, e_cand, cand_to_user):
  return _forward(implementation, interpret, w_user, w_cand, e_user, e_cand, cand_to_user)


def _lce_fwd(implementation, interpret, num_users, *args):
  if implementation == "mosaic_gpu":
    # The backward kernels reuse the aligned copy of e_cand the forward made.
    w_user, w_cand, e_user, _, cand_to_user = args
    out, e_cand_aligned = mosaic.forward(*args, interpret=interpret)
    return out, (w_user, w_cand, e_user, e_cand_aligned, cand_to_user)
  return _forward(implementation, interpret, *args), args


def _lce_bwd(implementation, interpret, num_users, residuals, d_out):
  if implementation == "mosaic_gpu":
    grads = mosaic.backward(*residuals, d_out, num_users=num_users, interpret=interpret)
  else:
    grads = xla.backward(*residuals, d_out, num_users=num_users)
  return (*grads, None)


_lce.defvjp(_lce_fwd, _lce_bwd)


def default_implementation(dtype) -> str:
  """The implementation `implementation=None` runs for these inputs on the default device."""
  return _dispatch.resolve(BACKENDS, None, dtype, interpret=False).name


def linear_compression(w_user, w_cand, e_user, e_cand, index: CandidateIndex, *,
                       implementation: Implementation | None = None,
                       checked: bool = False, interpret: bool = False) -> jax.Array:
  """Shared projection of user and candidate embeddings without broadcasting the user side.

  Computes `out[b] = W_user @ e_user[u(b)] + W_cand @ e_cand[b]` with
  `u = index.cand_to_user`, i.e. `W @ concat(e_user[u(b)], e_cand[b])` along K.

  Args:
    w_user: `[M, K_user]` weight applied to user embeddings.
    w_cand: `[M, K_cand]` weight applied to candidate embeddings.
    e_user: `[U, K_user, N]` user embeddings, stored once per user.
    e_cand: `[B, K_cand, N]` candidate embeddings.
    index: the `CandidateIndex` mapping candidates to users (`num_users == U`).
    implementation: `"xla_materialized"` (baseline that copies user rows;
      its gradient is plain autodiff through the copy), `"xla"` (decomposed), `"triton"` or `"mosaic_gpu"` (fused kernels), or
      None for the fastest available on the default device. A named
      implementation runs or raises; it never falls back.
    checked: also check that every id lies in `[0, U)` with `checkify.check`
      (eagerly this raises; under `jit` wrap the caller in `checkify.checkify`).
      Without it, out-of-range ids are clamped to `[0, U)` in every
      implementation, forward and backward.
    interpret: run a kernel implementation under the Pallas interpreter.

  Returns:
    `[B, M, N]` in the input dtype (float32 accumulation).

  >>> import jax, jax.numpy as jnp
  >>> from ikbo_jax import CandidateIndex, linear_compression
  >>> index = CandidateIndex.from_mapping(jnp.array([1, 0, 1]), num_users=2)
  >>> ks = jax.random.split(jax.random.key(0), 4)
  >>> out = linear_compression(
  ...     jax.random.normal(ks[0], (4, 6)), jax.random.normal(ks[1], (4, 5)),
  ...     jax.random.normal(ks[2], (2, 6, 3)), jax.random.normal(ks[3], (3, 5, 3)), index)
  >>> out.shape
  (3, 4, 3)
  """
  _check_args(w_user, w_cand, e_user, e_cand, index)
  dtype = v.check_float_dtypes(w_user=w_user, w_cand=w_cand, e_user=e_user, e_cand=e_cand)
  interpret = v.check_flag("interpret", interpret)
  implementation = _dispatch.resolve(BACKENDS, implementation, dtype, interpret=interpret).name
  if v.check_flag("checked", checked):
    index.check()
  if implementation == "xla_materialized":
    # The baseline in both directions: plain autodiff through the broadcast.
    return xla.materialized(w_user, w_cand, e_user, e_cand, index.clamped_cand_to_user)
  _dispatch.reverse_mode_only("ikbo_jax.linear_compression", w_user, w_cand, e_user, e_cand)
  return _lce(implementation, interpret, index.num_users, *_dispatch.common_varying_axes(
      w_user, w_cand, e_user, e_cand, index.clamped_cand_to_user))


def _check_args(w_user, w_cand, e_user, e_cand, index) -> None:
  v.check_index(index)
  v.check_operands(w_user=(w_user, ("M", "K_user")), w_cand=(w_cand, ("M", "K_cand")),
                   e_user=(e_user, ("U", "K_user", "N")), e_cand=(e_cand, ("B", "K_cand", "N")))
  m, k_user = w_user.shape
  v.check_dim("w_cand", w_cand, 0, m, "M, from w_user")
  v.check_dim("e_user", e_user, 0, index.num_users, "U, from index.num_users")
  v.check_dim("e_user", e_user, 1, k_user, "K_user, from w_user")
  n = e_user.shape[2]
  v.check_dim("e_cand", e_cand, 0, index.num_candidates, "B, from index.cand_to_user")
  v.check_dim("e_cand", e_cand, 1, w_cand.shape[1], "K_cand, from w_cand")
  v.check_dim("e_cand", e_cand, 2, n, "N, from e_user")
