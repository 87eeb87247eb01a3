"""Linear compression on the Mosaic GPU kernels: operand alignment, forward and backward.

The kernels need TMA-friendly layouts (see their module docstrings); this module
pads to them, runs the forward's fused candidate GEMM and the backward's two
candidate-side GEMMs, and slices the padding off again. The user side of the
backward runs at batch U in XLA (`linear_compression_xla.user_backward`).
"""

from __future__ import annotations

from ikbo_jax._padding import pad_to, pad_to_multiple, round_up
from ikbo_jax.kernels.mosaic_gpu import linear_compression as fused_kernel
from ikbo_jax.kernels.mosaic_gpu import weight_grad as weight_grad_kernel
from ikbo_jax.ops import linear_compression_xla as xla

# TMA tiles rows by 8; the swizzled minor dimension is loaded 64 elements at a time.
_ROW_ALIGN, _MINOR_ALIGN = 8, 64
# Tilings measured fastest on the H200 at the published shape (lce_diagnostics):
# the forward's consumers split N (64-row tiles fit M = 433 with less padding),
# the backward's dE_cand GEMM (M = K_cand) splits M.
FORWARD_CONFIG = fused_kernel.Config(tile_n=128, split="n")
BACKWARD_CONFIG = fused_kernel.Config()


def align_embeddings(e_cand):
  """`e_cand` padded to K a multiple of 8 and N of 64: a full copy, unless already aligned."""
  return pad_to_multiple(pad_to_multiple(e_cand, 1, _ROW_ALIGN), 2, _MINOR_ALIGN)


def align_weight(w, k: int, config: fused_kernel.Config):
  """`[M, K_w]` weight padded to rows a multiple of 8 and `k` rounded up to `tile_k` columns."""
  return pad_to_multiple(pad_to(w, 1, round_up(k, config.tile_k)), 0, _ROW_ALIGN)


def align_user_res(user_res, config: fused_kernel.Config):
  """`user_res` is read with plain loads of whole CTA tiles, so it is padded to them."""
  return pad_to_multiple(pad_to_multiple(user_res, 1, config.cta_tile_m), 2, config.cta_tile_n)


def forward(w_user, w_cand, e_user, e_cand, cand_to_user, *, interpret: bool,
            single_launch: bool | None = None):
  """The fused forward; also returns the aligned `e_cand` for the backward to reuse.

  `single_launch` computes the user GEMM inside the candidate kernel's launch
  instead of in XLA before it; None picks it wherever it can run (not under the
  interpreter, which lacks the global semaphores it needs).
  """
  if single_launch is None:
    single_launch = not interpret
  if not single_launch:
    return residual_forward(w_cand, e_cand, xla.user_result(w_user, e_user), cand_to_user,
                            interpret=interpret)
  if interpret:
    raise ValueError("single_launch=True cannot run under the interpreter")
  m, n = w_cand.shape[0], e_cand.shape[2]
  e_cand = align_embeddings(e_cand)
  config = FORWARD_CONFIG.for_n(e_cand.shape[2])
  e_user = align_embeddings(e_user)
  out = fused_kernel.single_launch_forward(
      align_weight(w_user, e_user.shape[1], config), align_weight(w_cand, e_cand.shape[1], config),
      e_user, e_cand, cand_to_user, num_rows=m, config=config)
  return out[:, :, :n], e_cand


def residual_rows(m: int, n: int) -> int:
  """The rows `residual_forward` reads `res` at (M rounded up to whole CTA tiles): a
  residual computed with that many rows (zero weight rows) is read without a padded copy."""
  return round_up(m, FORWARD_CONFIG.for_n(round_up(n, _MINOR_ALIGN)).cta_tile_m)


def residual_forward(w_cand, e_cand, res, cand_to_row, *, interpret: bool):
  """`W_cand @ e_cand[b] + res[cand_to_row[b]]` for a float32 `res [R, M, N]` computed
  elsewhere (a group's own GEMM plus its user's); also the aligned `e_cand`."""
  m, n = w_cand.shape[0], e_cand.shape[2]
  e_cand = align_embeddings(e_cand)
  config = FORWARD_CONFIG.for_n(e_cand.shape[2])
  out = fused_kernel.batched_gemm(
      align_weight(w_cand, e_cand.shape[1], config), e_cand, align_user_res(res, config),
      cand_to_row, num_rows=m, config=config, interpret=interpret)
  return out[:, :, :n], e_cand


def candidate_backward(w_cand, e_cand_aligned, d_out, *, interpret: bool):
  """Cotangents of `w_cand` and `e_cand`.

  `dE_cand[b] = W_cand^T @ dOut[b]` reuses the fused forward kernel without the
  user term; `dW_cand = sum_b dOut[b] @ E_cand[b]^T` runs on the split-batch
  weight-gradient kernel. Both read one padded copy of `d_out` (M to a multiple
  of 8, N to the aligned embeddings' N).
  """
  m, k_cand = w_cand.shape
  n = d_out.shape[2]
  d_out_aligned = pad_to_multiple(pad_to(d_out, 2, e_cand_aligned.shape[2]), 1, _ROW_ALIGN)
  config = BACKWARD_CONFIG.for_n(d_out_aligned.shape[2])
  d_e_cand = fused_kernel.batched_gemm(
      align_weight(w_cand.T, d_out_aligned.shape[1], config), d_out_aligned,
      num_rows=k_cand, config=config, interpret=interpret)[:, :, :n]
  d_w_cand_t = weight_grad_kernel.weight_grad(e_cand_aligned, d_out_aligned, interpret=interpret)
  return d_w_cand_t[:k_cand, :m].T.astype(w_cand.dtype), d_e_cand


def backward(w_user, w_cand, e_user, e_cand_aligned, cand_to_user, d_out, *, num_users: int,
             interpret: bool):
  """Cotangents of the four float operands: the candidate side on the kernels
  (`candidate_backward`), the user side at batch U in XLA."""
  d_w_cand, d_e_cand = candidate_backward(w_cand, e_cand_aligned, d_out, interpret=interpret)
  d_w_user, d_e_user = xla.user_backward(w_user, e_user, cand_to_user, d_out, num_users=num_users)
  return d_w_user, d_w_cand, d_e_user, d_e_cand
