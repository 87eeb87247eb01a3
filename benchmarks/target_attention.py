"""Target attention benchmark (first cut): the Triton IKBO kernel against the baselines.

    python -m benchmarks.target_attention --out benchmarks/results/target_attention_h200.json

Published shape (DESIGN.md 2.2): B=2048, U=32, H=2, D=128, n_seed=64, bf16.
Baselines in the same run: cuDNN on K/V broadcast outside the timing, broadcast
+ cuDNN, and cuDNN on the zero-copy per-user packed layout (sorted, uniform
counts). FLOPs counted as `4 * B * H * n_seed * S * D`.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from ikbo_jax import CandidateIndex, target_attention

PUBLISHED = dict(num_candidates=2048, num_users=32, heads=2, head_dim=128, n_seed=64)


def _cudnn(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")


def variants(q, k, v, index, on_gpu: bool):
  """name -> (jitted fn, operands); 'prebroadcast' copies K/V outside the timing."""
  ids = index.cand_to_user
  num_users, t = k.shape[0], q.shape[1]
  per_user = q.shape[0] // num_users
  op = lambda impl: jax.jit(functools.partial(target_attention, implementation=impl))
  out = {"xla_materialized": (op("xla_materialized"), (q, k, v, index))}
  if on_gpu:
    sorted_index = CandidateIndex.from_counts(np.full(num_users, per_user))
    # All of a user's candidate queries as one query sequence: no K/V copies.
    packed_q = q.reshape(num_users, per_user * t, *q.shape[2:])
    out.update({
        "cudnn_prebroadcast": (jax.jit(_cudnn), (q, k[ids], v[ids])),
        "broadcast_cudnn": (jax.jit(lambda q, k, v, ids: _cudnn(q, k[ids], v[ids])),
                            (q, k, v, ids)),
        "cudnn_packed_sorted": (jax.jit(_cudnn), (packed_q, k, v)),
        "triton_ikbo_shuffled": (op("triton"), (q, k, v, index)),
        "triton_ikbo_sorted": (op("triton"), (q, k, v, sorted_index)),
    })
  return out


def run(seq_len, shape, dtype, iterations, on_gpu):
  b, u, h, d, t = (shape[key] for key in ("num_candidates", "num_users", "heads", "head_dim",
                                          "n_seed"))
  keys = jax.random.split(jax.random.key(seq_len), 3)
  q = jax.random.normal(keys[0], (b, t, h, d), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (u, seq_len, h, d), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (u, seq_len, h, d), jnp.float32).astype(dtype)
  ids = np.random.default_rng(seq_len).permutation(np.repeat(np.arange(u), b // u))
  index = CandidateIndex.from_mapping(jnp.asarray(ids, jnp.int32), u)
  flops = 4 * b * h * t * seq_len * d
  rows = {}
  for name, (fn, operands) in variants(q, k, v, index, on_gpu).items():
    ms, timer = common.median_ms(fn, *operands, iterations=iterations)
    rows[name] = dict(ms=ms, timer=timer, tflops=flops / ms / 1e9)
  for base in ("cudnn_prebroadcast", "broadcast_cudnn", "cudnn_packed_sorted"):
    if base in rows:
      for row in rows.values():
        row[f"speedup_vs_{base}"] = rows[base]["ms"] / row["ms"]
  return rows


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--small", action="store_true", help="tiny shapes, any backend")
  parser.add_argument("--iterations", type=int, default=20)
  args = parser.parse_args()
  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  shape = (dict(num_candidates=16, num_users=4, heads=2, head_dim=16, n_seed=8)
           if args.small else PUBLISHED)
  payload = dict(**common.metadata(), dtype=jnp.dtype(dtype).name, shape=shape, sweep={})
  for seq_len in ([32] if args.small else [512, 1024, 2048]):
    payload["sweep"][seq_len] = run(seq_len, shape, dtype, args.iterations, on_gpu)
    print("S", seq_len, {k: (round(r["ms"], 3), round(r["tflops"])) for k, r in
                         payload["sweep"][seq_len].items()})
    common.write_json(args.out, payload)


if __name__ == "__main__":
  main()
