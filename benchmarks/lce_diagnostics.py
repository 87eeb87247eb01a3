"""Diagnostics for linear compression on the GPU: backward pieces and Mosaic GPU tile configs.

    python -m benchmarks.lce_diagnostics --out diag.json
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks import common
from benchmarks.problems import linear_compression_problem, pad_k
from benchmarks.shapes import LINEAR_COMPRESSION as PUBLISHED
from ikbo_jax._padding import pad_to_multiple
from ikbo_jax.kernels.mosaic_gpu import linear_compression as mosaic_kernel
from ikbo_jax.kernels.mosaic_gpu import weight_grad as weight_grad_kernel
from ikbo_jax.ops import linear_compression_mosaic as mosaic
from ikbo_jax.ops import linear_compression_xla as xla


def backward_parts(args, index, d_out):
  w_user, w_cand, e_user, e_cand = args
  ids, num_users = index.cand_to_user, index.num_users
  f32 = jnp.float32
  e_aligned = mosaic.align_embeddings(e_cand)
  d_aligned = pad_to_multiple(d_out, 1, 8)
  config = mosaic_kernel.Config()
  parts = {
      "segment_sum_f32": (lambda d: jax.ops.segment_sum(d.astype(f32), ids, num_users), (d_out,)),
      "onehot_matmul": (lambda d: jnp.einsum(
          "ub,bmn->umn", jax.nn.one_hot(ids, num_users, dtype=d.dtype, axis=0), d,
          preferred_element_type=f32), (d_out,)),
      "d_w_cand_einsum": (lambda d, e: jnp.einsum("bmn,bkn->mk", d, e, preferred_element_type=f32),
                          (d_out, e_cand)),
      "d_w_cand_mosaic_kernel": (weight_grad_kernel.weight_grad, (e_aligned, d_aligned)),
      "d_e_cand_einsum": (lambda w, d: jnp.einsum("mk,bmn->bkn", w, d), (w_cand, d_out)),
      "d_e_cand_mosaic_kernel": (lambda w, d: mosaic_kernel.batched_gemm(
          mosaic.align_weight(w.T, d.shape[1], config), d, num_rows=w.shape[1], config=config),
          (w_cand, d_aligned)),
      "pad_d_out": (lambda d: pad_to_multiple(d, 1, 8), (d_out,)),
      "user_backward": (lambda *a: xla.user_backward(*a, num_users=num_users),
                        (w_user, e_user, ids, d_out)),
      "full_xla_backward": (lambda *a: xla.backward(*a, num_users=num_users),
                            (*args, ids, d_out)),
      "full_mosaic_backward": (lambda *a: mosaic.backward(*a, num_users=num_users, interpret=False),
                               (w_user, w_cand, e_user, e_aligned, ids, d_out)),
  }
  return {name: common.median_ms(jax.jit(fn), *ops, iterations=20)[0]
          for name, (fn, ops) in parts.items()}


# Forward tile configs: consumers side by side along M (sharing the E tile) or N.
FORWARD_CONFIGS = {
    "default: split=m,64x256,steps=4,epi=64": mosaic_kernel.Config(),
    "split=m,64x256,steps=3": mosaic_kernel.Config(max_concurrent_steps=3),
    "split=m,64x256,steps=4,epi=32": mosaic_kernel.Config(epi_tile_n=32),
    "split=m,64x256,steps=3,epi=128": mosaic_kernel.Config(max_concurrent_steps=3,
                                                           epi_tile_n=128),
    "split=n,64x128,steps=4": mosaic_kernel.Config(tile_n=128, split="n"),
}


def mosaic_configs(args, index):
  """Kernel-only time per tile config, on operands already aligned for the kernel."""
  w_user, w_cand, e_user, e_cand = [pad_k(a) for a in args]
  user_res = xla.user_result(w_user, e_user)
  results = {}
  for name, config in FORWARD_CONFIGS.items():
    operands = (mosaic.align_weight(w_cand, e_cand.shape[1], config), e_cand,
                mosaic.align_user_res(user_res, config), index.cand_to_user)
    fn = jax.jit(functools.partial(mosaic_kernel.batched_gemm,
                                   num_rows=w_cand.shape[0], config=config))
    try:
      results[name] = common.median_ms(fn, *operands, iterations=20)[0]
    except Exception as e:  # an over-budget config (shared memory) is reported, not fatal
      results[name] = f"{type(e).__name__}: {str(e)[:200]}"
  return results


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  out_path = parser.parse_args().out
  args, index = linear_compression_problem(**PUBLISHED, dtype=jnp.bfloat16)
  d_out = jax.random.normal(jax.random.key(3), (PUBLISHED["num_candidates"], PUBLISHED["m"],
                                                PUBLISHED["n"]), jnp.bfloat16)
  payload = dict(**common.metadata(), shape=PUBLISHED)
  payload["backward_parts_ms"] = backward_parts(args, index, d_out)
  print(payload["backward_parts_ms"])
  payload["mosaic_configs_ms"] = mosaic_configs(args, index)
  print(payload["mosaic_configs_ms"])
  common.write_json(out_path, payload)


if __name__ == "__main__":
  main()
