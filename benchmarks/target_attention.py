"""Target attention benchmark: the IKBO kernels against the cuDNN baselines, one run.

    python -m benchmarks.target_attention --out benchmarks/results/target_attention_h200.json

Published IKBO benchmark shape: B=2048, U=32 (64 candidates each), H=2, D=128,
n_seed=64, bf16, S from 512 to 16384. Baselines in the same run: cuDNN on K/V
broadcast outside the timing ("prebroadcast"), broadcast + cuDNN, and cuDNN on
the zero-copy per-user packed layout (sorted, uniform counts: all of a user's
candidate queries as one query sequence), and JAX's own Pallas Mosaic GPU attention
(`jax.experimental.pallas.ops.gpu.attention_mgpu`, FlashAttention-3 style, forward and
backward; no logit scale, which changes no timing) on that packed layout: a pure Pallas
peer. Ours: the Triton and Mosaic GPU
kernels with a shuffled and a sorted mapping (Mosaic GPU persistent: one CTA per
SM looping over tiles), the Mosaic GPU kernel with one CTA per tile, and Mosaic GPU with the published
odd counts (each user 64 or 65 candidates at random, so B differs and rows
compare by TFLOP/s). Forward FLOPs are `4 * B * H * n_seed * S * D`; forward +
backward counts 3.5x that (the backward's five GEMMs against the forward's
two), the backward alone 2.5x. `fwd_bwd/` rows time `jax.grad`, `bwd/` rows the
VJP function alone (its residuals computed outside the timing); each IKBO
row runs its implementation's own backward kernels (Mosaic GPU or Triton).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks.problems import attention_sweep_parser, attention_sweep_setup, cudnn
from ikbo_jax import CandidateIndex, target_attention
from ikbo_jax.kernels.mosaic_gpu import target_attention as mosaic_kernel
from ikbo_jax.ops.target_attention import mosaic_gpu as target_attention_mosaic

SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
BASELINES = ("cudnn_prebroadcast", "broadcast_cudnn", "cudnn_packed_sorted", "xla_materialized")


def _broadcast_cudnn(q, k, v, ids):
  return cudnn(q, k[ids], v[ids])


def _packed_cudnn(q, k, v):
  """All of a user's candidate queries as one query sequence (sorted, uniform counts)."""
  num_users, (num_cands, t, h, d) = k.shape[0], q.shape
  packed = cudnn(q.reshape(num_users, num_cands // num_users * t, h, d), k, v)
  return packed.reshape(q.shape)


def _packed_attention_mgpu(q, k, v):
  """JAX's Pallas Mosaic GPU attention on the packed per-user layout (as `_packed_cudnn`).

  Its kernel stages tiles in float16 whatever the inputs are, so it runs on float16 copies made
  outside the timed call: the same bytes and the same tensor-core rate as bfloat16.
  """
  from jax.experimental.pallas.ops.gpu import attention_mgpu  # imports CUDA-only modules
  num_users, (num_cands, t, h, d) = k.shape[0], q.shape
  config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2,
                                       block_q_dkv=64, block_kv_dkv=64, block_q_dq=64,
                                       block_kv_dq=64)
  packed = attention_mgpu.attention(q.reshape(num_users, num_cands // num_users * t, h, d), k, v,
                                    config)
  return packed.reshape(q.shape)


def _ikbo(implementation):
  return functools.partial(target_attention, implementation=implementation)


def _bwd_only(fn, operands, d_out):
  """`(timed fn, operands)`: the VJP of `fn` at `operands`, its residuals computed once here."""
  _, vjp = jax.jit(lambda *a: jax.vjp(fn, *a))(*operands)
  return jax.jit(lambda vjp, d_out: vjp(d_out)), (vjp, d_out.astype(operands[0].dtype))


def _fwd_bwd(fn, num_diff: int = 3):
  """Forward + backward of `sum(fn(...) * cotangent)` w.r.t. q, k, v (the cotangent is fixed)."""
  def loss(*args):
    out = fn(*args[:-1])
    return jnp.sum(out.astype(jnp.float32) * args[-1])
  return jax.jit(jax.grad(loss, argnums=tuple(range(num_diff))))


def _inputs(seq_len, counts, shape, dtype, shuffle_seed):
  u, h, d, t = (shape[key] for key in ("num_users", "heads", "head_dim", "n_seed"))
  b = int(np.sum(counts))
  keys = jax.random.split(jax.random.key(seq_len + b), 4)
  q = jax.random.normal(keys[0], (b, t, h, d), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (u, seq_len, h, d), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (u, seq_len, h, d), jnp.float32).astype(dtype)
  d_out = jax.random.normal(keys[3], q.shape, jnp.float32)
  sorted_index = CandidateIndex.from_counts(counts)
  ids = np.random.default_rng(shuffle_seed).permutation(np.repeat(np.arange(u), counts))
  shuffled_index = CandidateIndex.from_mapping(jnp.asarray(ids, jnp.int32), u)
  return q, k, v, d_out, sorted_index, shuffled_index


def variants(seq_len, shape, dtype, on_gpu, with_backward):
  """name -> (fn, operands, (FLOPs, bytes)): forward rows, then `fwd_bwd/` rows."""
  u = shape["num_users"]

  def cost(q, k, backward=False):
    """(FLOPs, fewest bytes): read q, k, v and write out (+ read d_out, write dq, dk, dv)."""
    flops = 4 * q.shape[0] * q.shape[2] * q.shape[1] * seq_len * q.shape[3]
    if backward == "fwd_bwd":
      return 3.5 * flops, q.dtype.itemsize * (3 * q.size + 4 * k.size)
    if backward == "bwd":
      return 2.5 * flops, q.dtype.itemsize * (4 * q.size + 4 * k.size)
    return flops, q.dtype.itemsize * (2 * q.size + 2 * k.size)

  uniform = np.full(u, shape["num_candidates"] // u)
  q, k, v, d_out, sorted_index, index = _inputs(seq_len, uniform, shape, dtype, seq_len)
  ids = sorted_index.cand_to_user
  if not on_gpu:
    return {"xla": (jax.jit(_ikbo("xla")), (q, k, v, index), cost(q, k)),
            "xla_materialized": (jax.jit(_ikbo("xla_materialized")), (q, k, v, index), cost(q, k))}
  rows = {
      "cudnn_prebroadcast": (jax.jit(cudnn), (q, k[ids], v[ids]), cost(q, k)),
      "broadcast_cudnn": (jax.jit(_broadcast_cudnn), (q, k, v, ids), cost(q, k)),
      "cudnn_packed_sorted": (jax.jit(_packed_cudnn), (q, k, v), cost(q, k)),
  }
  half = tuple(x.astype(jnp.float16) for x in (q, k, v))
  rows["attention_mgpu_packed_sorted"] = (jax.jit(_packed_attention_mgpu), half, cost(q, k))
  for impl in ("mosaic_gpu", "triton"):
    rows[f"{impl}_shuffled"] = (jax.jit(_ikbo(impl)), (q, k, v, index), cost(q, k))
    rows[f"{impl}_sorted"] = (jax.jit(_ikbo(impl)), (q, k, v, sorted_index), cost(q, k))
  per_item = functools.partial(target_attention_mosaic.aligned_forward, save_lse=False,
                               scale=1 / np.sqrt(q.shape[-1]),
                               config=mosaic_kernel.Config(persistent=False))
  rows["mosaic_gpu_cta_per_tile_shuffled"] = (
      jax.jit(lambda q, k, v, index: per_item(q, k, v, index, jnp.full(u, seq_len))[0]),
      (q, k, v, index), cost(q, k))
  odd = 64 + np.random.default_rng(seq_len).integers(0, 2, u)
  q_odd, k_odd, v_odd, _, _, odd_index = _inputs(seq_len, odd, shape, dtype, seq_len + 1)
  rows["mosaic_gpu_odd_shuffled"] = (jax.jit(_ikbo("mosaic_gpu")),
                                     (q_odd, k_odd, v_odd, odd_index), cost(q_odd, k_odd))
  if with_backward:
    packed = lambda q, k, v, index: _packed_cudnn(q, k, v)
    broadcast = lambda q, k, v, index: _broadcast_cudnn(q, k, v, ids)
    paths = {"broadcast_cudnn": (broadcast, sorted_index),
             "cudnn_packed_sorted": (packed, sorted_index),
             "mosaic_gpu_shuffled": (_ikbo("mosaic_gpu"), index),
             "mosaic_gpu_sorted": (_ikbo("mosaic_gpu"), sorted_index),
             "triton_shuffled": (_ikbo("triton"), index)}
    for name, (fn, path_index) in paths.items():
      bound = functools.partial(lambda fn, path_index, q, k, v: fn(q, k, v, path_index), fn,
                                path_index)
      rows[f"fwd_bwd/{name}"] = (_fwd_bwd(bound), (q, k, v, d_out), cost(q, k, "fwd_bwd"))
      rows[f"bwd/{name}"] = (*_bwd_only(bound, (q, k, v), d_out), cost(q, k, "bwd"))
    d_half = d_out.astype(jnp.float16)
    rows["fwd_bwd/attention_mgpu_packed_sorted"] = (
        _fwd_bwd(_packed_attention_mgpu), (*half, d_half), cost(q, k, "fwd_bwd"))
    rows["bwd/attention_mgpu_packed_sorted"] = (
        *_bwd_only(_packed_attention_mgpu, half, d_half), cost(q, k, "bwd"))
  return rows


def run(seq_len, shape, dtype, iterations, on_gpu, with_backward, ceilings):
  rows = {}
  for name, (fn, operands, (flops, nbytes)) in variants(seq_len, shape, dtype, on_gpu,
                                                        with_backward).items():
    try:
      ms, timer = common.median_ms(fn, *operands, iterations=iterations)
    except Exception as e:  # e.g. out of memory at long S: record it and go on
      rows[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
      continue
    rows[name] = dict(ms=ms, timer=timer, **common.rates(ms, flops, nbytes, ceilings))
  for name, row in rows.items():
    prefix = name[: name.index("/") + 1] if "/" in name else ""
    for base in BASELINES:
      base_row = rows.get(prefix + base, {})
      if "ms" in row and "tflops" in base_row:
        # By throughput: rows with odd counts have a different B.
        row[f"speedup_vs_{base}"] = row["tflops"] / base_row["tflops"]
  return rows


def main():
  parser = attention_sweep_parser(SEQ_LENS, backward_seq_lens=(512, 1024, 2048, 4096, 8192))
  args = parser.parse_args()
  on_gpu, dtype, shape, ceilings = attention_sweep_setup(args.small)
  payload = dict(**common.metadata(), dtype=jnp.dtype(dtype).name, shape=shape, ceilings=ceilings,
                 flops_per_forward="4*B*H*n_seed*S*D", fwd_bwd_flops="3.5x forward",
                 bwd_flops="2.5x forward",
                 bytes="fewest: q, k, v read and out written once (fwd_bwd: q, d_out, dq, k, v, "
                       "dk, dv; bwd: q, out, d_out, dq, k, v, dk, dv)", sweep={})
  for seq_len in ([32] if args.small else args.seq_lens):
    rows = run(seq_len, shape, dtype, args.iterations, on_gpu,
               with_backward=seq_len in args.backward_seq_lens, ceilings=ceilings)
    payload["sweep"][seq_len] = rows
    print("S", seq_len, {k: (round(r["ms"], 3), round(r["tflops"])) if "ms" in r else "error"
                         for k, r in rows.items()}, flush=True)
    common.write_json(args.out, payload)


if __name__ == "__main__":
  main()
