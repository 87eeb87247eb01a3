"""Diagnostics for the Mosaic GPU attention kernel: configs side by side at the published shape.

    python -m benchmarks.attention_diagnostics --out diag.json

Times target attention alone and self + target attention in one launch for each
kernel `Config` in `CONFIGS` (median CUPTI time, one run), to pick the defaults.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks.self_target_attention import _inputs
from benchmarks.target_attention import PUBLISHED
from ikbo_jax.kernels.mosaic_gpu import target_attention as kernel
from ikbo_jax.ops import target_attention_mosaic

CONFIGS = {
    "default": kernel.Config(),
    "block_kv=64,steps=4": kernel.Config(block_kv=64, max_concurrent_steps=4),
}


def run(seq_len, iterations):
  (q_user, q_cand, k, v), index, _ = _inputs(PUBLISHED, seq_len, jnp.bfloat16)
  kv_len = jnp.full(k.shape[0], seq_len, jnp.int32)
  common_args = dict(scale=1 / np.sqrt(k.shape[-1]), save_lse=False)
  rows = {}
  for name, config in CONFIGS.items():
    target = functools.partial(target_attention_mosaic.forward, config=config, **common_args)
    fused = functools.partial(target_attention_mosaic.self_target_forward, causal=False,
                              config=config, **common_args)
    rows[f"target/{name}"] = common.median_ms(
        jax.jit(lambda q, k, v, index: target(q, k, v, index, kv_len)[0]),
        q_cand, k, v, index, iterations=iterations)[0]
    rows[f"fused/{name}"] = common.median_ms(
        jax.jit(lambda qu, q, k, v, index: fused(qu, q, k, v, index, kv_len)[:2]),
        q_user, q_cand, k, v, index, iterations=iterations)[0]
  return rows


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--seq-lens", type=int, nargs="*", default=(512, 1024, 4096))
  parser.add_argument("--iterations", type=int, default=30)
  args = parser.parse_args()
  payload = dict(**common.metadata(), shape=PUBLISHED, configs=list(CONFIGS), ms={})
  for seq_len in args.seq_lens:
    payload["ms"][seq_len] = run(seq_len, args.iterations)
    print("S", seq_len, {k: round(v, 4) for k, v in payload["ms"][seq_len].items()}, flush=True)
    common.write_json(args.out, payload)


if __name__ == "__main__":
  main()
