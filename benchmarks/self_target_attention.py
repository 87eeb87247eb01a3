"""Self + target attention benchmark: one fused launch against two launches and the baseline.

    python -m benchmarks.self_target_attention --out benchmarks/results/self_target_attention_h200.json

Shape (issue 4): B=2048, U=32, H=2, D=128, n_seed=64, bf16, S in {512, ..., 4096}.
Rows, all in one run (median CUPTI kernel time; a row's time sums its kernels):
- `fused`: `self_target_attention` (Mosaic GPU, one launch for both query kinds);
- `self_cudnn`, `target_mosaic_gpu`: each attention alone, and `two_launches`:
  both in one jitted step (cuDNN self-attention, then our target attention);
- `materialized`: cuDNN self-attention plus K/V broadcast to the candidates and
  cuDNN target attention, the baseline models run today;
- the same with `causal` self-attention, and forward + backward rows.
FLOPs: `4*U*H*S*S*D` for self-attention (about half when causal) plus
`4*B*H*n_seed*S*D` for target attention; forward + backward counts 2.5x.
`block/` rows time the NNX block end to end (projections + attention, forward)
against two `nnx.MultiHeadAttention` calls on the materialized broadcast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks import common
from benchmarks.problems import (attention_sweep_parser, attention_sweep_setup, cudnn,
                                 self_target_inputs)
from ikbo_jax import self_target_attention, target_attention
from ikbo_jax.nn import UserSequenceBlock

SEQ_LENS = (512, 1024, 2048, 4096)


def _cost(shape, seq_len, causal, itemsize, backward=False):
  """(FLOPs, fewest bytes): q_user, q_cand, k, v read and both outputs written once.

  Forward + backward: 2.5x the FLOPs; both queries, both cotangents and k, v
  read, dq_user, dq_cand, dk, dv written.
  """
  u, b, h, d, t = (shape[key] for key in ("num_users", "num_candidates", "heads", "head_dim",
                                          "n_seed"))
  self_pairs = seq_len * (seq_len + 1) / 2 if causal else seq_len * seq_len
  flops = 4 * u * h * d * self_pairs + 4 * b * h * t * seq_len * d
  user_size, cand_size = u * seq_len * h * d, b * t * h * d
  if backward:
    return 2.5 * flops, itemsize * (3 * cand_size + 3 * user_size + 4 * user_size)
  return flops, itemsize * (2 * cand_size + 2 * user_size + 2 * user_size)


def _steps(index, causal, on_gpu):
  """name -> forward step `(q_user, q_cand, k, v) -> (out_user, out_cand)`."""
  ids = index.cand_to_user
  fused = lambda *a: self_target_attention(*a, index, causal=causal)
  if not on_gpu:
    return {"fused_xla": fused}
  return {
      "fused": fused,
      # Each attention alone (returning an input would time a copy of it).
      "self_cudnn": lambda q_user, q_cand, k, v: cudnn(q_user, k, v, causal),
      "target_mosaic_gpu": lambda q_user, q_cand, k, v: target_attention(
          q_cand, k, v, index, implementation="mosaic_gpu"),
      "two_launches": lambda q_user, q_cand, k, v: (
          cudnn(q_user, k, v, causal),
          target_attention(q_cand, k, v, index, implementation="mosaic_gpu")),
      "materialized": lambda q_user, q_cand, k, v: (
          cudnn(q_user, k, v, causal), cudnn(q_cand, k[ids], v[ids])),
  }


def _fwd_bwd(step, cotangents):
  def loss(*args):
    return sum(jnp.sum(out.astype(jnp.float32) * cot)
               for out, cot in zip(step(*args), cotangents))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def _block_rows(shape, seq_len, dtype, index):
  """The NNX block vs two `nnx.MultiHeadAttention` on the materialized broadcast (forward)."""
  u, b, h, d, t = (shape[key] for key in ("num_users", "num_candidates", "heads", "head_dim",
                                          "n_seed"))
  features = h * d
  keys = jax.random.split(jax.random.key(7), 2)
  user_seq = jax.random.normal(keys[0], (u, seq_len, features), jnp.float32).astype(dtype)
  cand_tokens = jax.random.normal(keys[1], (b, t, features), jnp.float32).astype(dtype)
  kwargs = dict(dtype=dtype, param_dtype=dtype)
  block = UserSequenceBlock(num_heads=h, user_features=features, rngs=nnx.Rngs(0), **kwargs)
  mha = lambda seed: nnx.MultiHeadAttention(num_heads=h, in_features=features, decode=False,
                                            rngs=nnx.Rngs(seed), **kwargs)
  self_mha, target_mha = mha(1), mha(2)
  ids = index.cand_to_user

  def materialized(modules, user_seq, cand_tokens):
    self_mha, target_mha = modules
    return self_mha(user_seq), target_mha(cand_tokens, user_seq[ids])

  run_block = nnx.jit(lambda m, s, c: m(s, c, index))
  run_materialized = nnx.jit(materialized)
  return {
      "block/user_sequence_block": (run_block, (block, user_seq, cand_tokens)),
      "block/materialized_multi_head_attention": (
          run_materialized, ((self_mha, target_mha), user_seq, cand_tokens)),
  }


def run(shape, seq_len, dtype, iterations, on_gpu, with_backward, with_block, ceilings):
  operands, index, cotangents = self_target_inputs(shape, seq_len, dtype)
  itemsize = jnp.dtype(dtype).itemsize
  rows = {}

  def time_row(name, fn, args, cost=None):
    try:
      ms, timer = common.median_ms(fn, *args, iterations=iterations)
    except Exception as e:  # e.g. a baseline's memory at long S: record it and go on
      rows[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
      return
    rows[name] = dict(ms=ms, timer=timer)
    if cost:
      rows[name].update(common.rates(ms, *cost, ceilings))

  for causal in (False, True):
    prefix = "causal/" if causal else ""
    cost = _cost(shape, seq_len, causal, itemsize)
    for name, step in _steps(index, causal, on_gpu).items():
      whole = name not in ("self_cudnn", "target_mosaic_gpu")
      time_row(prefix + name, jax.jit(step), operands, cost if whole else None)
      if with_backward and not causal and name in ("fused", "two_launches", "materialized"):
        time_row("fwd_bwd/" + name, _fwd_bwd(step, cotangents), operands,
                 _cost(shape, seq_len, causal, itemsize, backward=True))
  if with_block:
    for name, (fn, args) in _block_rows(shape, seq_len, dtype, index).items():
      time_row(name, fn, args)
  for prefix in ("", "causal/", "fwd_bwd/"):
    for base in ("two_launches", "materialized"):
      fused, base_row = rows.get(prefix + "fused", {}), rows.get(prefix + base, {})
      if "ms" in fused and "ms" in base_row:
        fused[f"speedup_vs_{base}"] = base_row["ms"] / fused["ms"]
  block, base = (rows.get("block/" + name, {}) for name in (
      "user_sequence_block", "materialized_multi_head_attention"))
  if "ms" in block and "ms" in base:
    block["speedup_vs_materialized"] = base["ms"] / block["ms"]
  return rows


def main():
  parser = attention_sweep_parser(SEQ_LENS, backward_seq_lens=(1024, 2048))
  parser.add_argument("--block-seq-lens", type=int, nargs="*", default=(1024,))
  args = parser.parse_args()
  on_gpu, dtype, shape, ceilings = attention_sweep_setup(args.small)
  seq_lens = [32] if args.small else args.seq_lens
  payload = dict(**common.metadata(), dtype=jnp.dtype(dtype).name, shape=shape, ceilings=ceilings,
                 flops="4*U*H*S*S*D (causal: S*(S+1)/2 pairs) + 4*B*H*n_seed*S*D",
                 fwd_bwd_flops="2.5x forward", bytes="fewest (see _cost)", sweep={})
  for seq_len in seq_lens:
    rows = run(shape, seq_len, dtype, args.iterations, on_gpu,
               with_backward=args.small or seq_len in args.backward_seq_lens,
               with_block=args.small or seq_len in args.block_seq_lens, ceilings=ceilings)
    payload["sweep"][seq_len] = rows
    print("S", seq_len, {k: (round(r["ms"], 3), round(r.get("tflops", 0))) if "ms" in r
                         else r["error"][:120] for k, r in rows.items()}, flush=True)
    common.write_json(args.out, payload)


if __name__ == "__main__":
  main()
