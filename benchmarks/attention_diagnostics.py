"""Diagnostics for the Mosaic GPU attention kernel: configs side by side at the published shape.

    python -m benchmarks.attention_diagnostics --out diag.json
    ncu ... python -m benchmarks.attention_diagnostics --once --seq-lens 1024

Times target attention alone and self + target attention in one launch for each
kernel `Config` in `CONFIGS` (median CUPTI time, one run), to pick the defaults,
and records each config's largest difference from the default's output.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks.problems import self_target_inputs
from benchmarks.shapes import ATTENTION as PUBLISHED
from ikbo_jax.kernels.mosaic_gpu import target_attention as kernel
from ikbo_jax.ops.target_attention import mosaic_gpu as target_attention_mosaic

# The first config is the reference the others' outputs are compared with.
CONFIGS = {
    "default": kernel.Config(),
    "eager_rescale": kernel.Config(lazy_rescale=False),
}


def kernel_steps(seq_len: int, config: kernel.Config, shape=PUBLISHED) -> dict:
  """kind -> (jitted fn, operands): target attention alone and self + target in one launch."""
  (q_user, q_cand, k, v), index, _ = self_target_inputs(shape, seq_len, jnp.bfloat16)
  kv_len = jnp.full(k.shape[0], seq_len, jnp.int32)
  common_args = dict(scale=1 / np.sqrt(k.shape[-1]), save_lse=False, config=config)
  target = functools.partial(target_attention_mosaic.aligned_forward, **common_args)
  fused = functools.partial(target_attention_mosaic.self_target_forward, causal=False,
                            **common_args)
  return {
      "target": (jax.jit(lambda q, k, v, index: target(q, k, v, index, kv_len)[0]),
                 (q_cand, k, v, index)),
      "fused": (jax.jit(lambda qu, q, k, v, index: fused(qu, q, k, v, index, kv_len)[:2]),
                (q_user, q_cand, k, v, index)),
  }


def run(seq_len, iterations, configs, shape=PUBLISHED):
  rows, outputs = {}, {}
  for name in configs:
    config = CONFIGS[name]
    for kind, (fn, operands) in kernel_steps(seq_len, config, shape).items():
      try:
        rows[f"{kind}/{name}"] = common.median_ms(fn, *operands, iterations=iterations)[0]
        out = fn(*operands)
        # Schedule-only configs must give the default's bits; others differ by rounding.
        reference = outputs.setdefault(kind, out)
        rows[f"{kind}/{name}/max_abs_diff_vs_default"] = max(
            float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
            for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(reference)))
      except Exception as e:  # a config that does not compile: record it and go on
        rows[f"{kind}/{name}"] = f"{type(e).__name__}: {str(e)[:200]}"
  return rows


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--seq-lens", type=int, nargs="*", default=(512, 1024, 4096))
  parser.add_argument("--iterations", type=int, default=30)
  parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS),
                      help="the first is the reference for the others' outputs")
  parser.add_argument("--once", action="store_true",
                      help="run each config's target kernel once, untimed (for a profiler such as ncu)")
  args = parser.parse_args()
  if args.once:
    for seq_len in args.seq_lens:
      for name in args.configs:
        fn, operands = kernel_steps(seq_len, CONFIGS[name])["target"]
        jax.block_until_ready(fn(*operands))
    return
  payload = dict(**common.metadata(), shape=PUBLISHED, configs=args.configs, rows={})
  for seq_len in args.seq_lens:
    payload["rows"][seq_len] = run(seq_len, args.iterations, args.configs)
    print("S", seq_len, {k: round(v, 4) if isinstance(v, float) else v
                         for k, v in payload["rows"][seq_len].items()}, flush=True)
    common.write_json(args.out, payload)


if __name__ == "__main__":
  main()
