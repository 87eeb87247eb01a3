"""XLA implementations of linear compression: the semantics every kernel is tested against.

Shapes: `w_user [M, K_user]`, `w_cand [M, K_cand]`, `e_user [U, K_user, N]`,
`e_cand [B, K_cand, N]`, `cand_to_user int32[B]` (already clamped to `[0, U)`),
output `[B, M, N]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ikbo_jax.ops.user_sums import sum_per_user

_F32 = jnp.float32


def take_rows(x, ids):
  """`x[ids]`: how the baselines copy user rows to the candidate batch."""
  return x[ids]


def materialized(w_user, w_cand, e_user, e_cand, cand_to_user, *, precision=None,
                 gather=take_rows):
  """The baseline: copy user rows to the candidate batch, concat along K, one batched GEMM.

  `gather(x, ids)` makes the copy (the test references swap in one whose
  backward sums in float32).
  """
  w = jnp.concatenate([w_user, w_cand], axis=1)
  e = jnp.concatenate([gather(e_user, cand_to_user), e_cand], axis=1)
  out = jnp.einsum("mk,bkn->bmn", w, e, precision=precision, preferred_element_type=_F32)
  return out.astype(e_cand.dtype)


def user_result(w_user, e_user, *, precision=None):
  """`user_res[u] = W_user @ E_user[u]` in float32, computed once per user."""
  return jnp.einsum(
      "mk,ukn->umn", w_user, e_user, precision=precision, preferred_element_type=_F32)


def decomposed(w_user, w_cand, e_user, e_cand, cand_to_user, *, precision=None):
  """IKBO in XLA: user GEMM at batch U, candidate GEMM at batch B, gather + add.

  The candidate GEMM is rounded to the output dtype before the add (as cuBLAS
  would return it), so this path adds two rounded partials; the fused kernels
  add `user_res` to the float32 accumulator instead.
  """
  return residual_decomposed(w_cand, e_cand, user_result(w_user, e_user, precision=precision),
                             cand_to_user, precision=precision)


def residual_decomposed(w_cand, e_cand, res, cand_to_row, *, precision=None):
  """`W_cand @ e_cand[b] + res[cand_to_row[b]]`, the candidate GEMM rounded before the add
  (as `decomposed`), for a float32 `res [R, M, N]` computed elsewhere."""
  cand_res = jnp.einsum("mk,bkn->bmn", w_cand, e_cand, precision=precision)
  return (cand_res.astype(_F32) + res[cand_to_row]).astype(e_cand.dtype)


def rows_in_use(ids, num_rows: int):
  """`bool[num_rows]`: the rows some id points at. The others the original never reads."""
  return jnp.zeros((num_rows,), bool).at[ids].set(True)


def residual_backward(w, e, d_res, in_use):
  """Cotangents of `w` and `e` given that of `res[r] = W @ E[r]`, two GEMMs at the rows' batch.

  A row not `in_use` (a user without candidates) is never read by the original: its
  cotangent is zero, and its values (NaN, say) reach neither `d_w` nor its own `d_e`,
  as `0 * NaN` in the GEMMs would carry them.
  """
  keep = in_use[:, None, None]
  # float32 operands: full float32 products. 16-bit operands: the default
  # precision (TF32 on recent GPUs) keeps more mantissa than the operands have,
  # at several times the speed of full float32.
  precision = jax.lax.Precision.HIGHEST if e.dtype == _F32 else None
  d_w = jnp.einsum("umn,ukn->mk", d_res, jnp.where(keep, e.astype(_F32), 0), precision=precision)
  d_e = jnp.where(keep, jnp.einsum("mk,umn->ukn", w.astype(_F32), d_res, precision=precision), 0)
  return d_w.astype(w.dtype), d_e.astype(e.dtype)


def user_backward(w_user, e_user, cand_to_user, d_out, *, num_users: int):
  """Cotangents of `w_user` and `e_user`: reduce `d_out` per user, then two GEMMs at batch U."""
  d_user = sum_per_user(d_out, cand_to_user, num_users)
  return residual_backward(w_user, e_user, d_user, rows_in_use(cand_to_user, num_users))


def backward(w_user, w_cand, e_user, e_cand, cand_to_user, d_out, *, num_users: int):
  """Cotangents of all four float operands; no broadcast is ever materialized.

  The user side first reduces `d_out` over each user's candidates
  (`sum_per_user`, at batch B), then runs its two GEMMs at batch U.
  """
  d_w_user, d_e_user = user_backward(w_user, e_user, cand_to_user, d_out, num_users=num_users)
  d_w_cand, d_e_cand = candidate_backward(w_cand, e_cand, d_out)
  return d_w_user, d_w_cand, d_e_user, d_e_cand


def candidate_backward(w_cand, e_cand, d_out):
  """Cotangents of `w_cand` and `e_cand`: two GEMMs at batch B."""
  d_w_cand = jnp.einsum("bmn,bkn->mk", d_out, e_cand, preferred_element_type=_F32)
  d_e_cand = jnp.einsum("mk,bmn->bkn", w_cand, d_out, preferred_element_type=_F32)
  return d_w_cand.astype(w_cand.dtype), d_e_cand.astype(e_cand.dtype)
