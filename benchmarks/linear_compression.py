"""Linear compression benchmark: the published ladder and the B / ratio sweeps.

    python -m benchmarks.linear_compression --out benchmarks/results/linear_compression_h200.json

Every variant is timed in the same run (median CUPTI kernel time). `--small`
runs tiny shapes on any backend (used by CI to keep the script working).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks import common
from benchmarks.problems import linear_compression_problem, pad_k
from benchmarks.shapes import LINEAR_COMPRESSION as PUBLISHED
from benchmarks.shapes import LINEAR_COMPRESSION_PUBLISHED_H100_MS as PUBLISHED_MS
from ikbo_jax import linear_compression
from ikbo_jax.ops import linear_compression_mosaic as mosaic
from ikbo_jax.ops.linear_compression import default_implementation

def variants(args, index, kernels: bool):
  """name -> (jitted fn, operands). Padding/broadcast marked 'pre' happen outside the timing."""
  w_user, w_cand, e_user, e_cand = args
  padded = [pad_k(x) for x in args]
  w_full = jnp.concatenate([w_user, w_cand], axis=1)
  e_full = jnp.concatenate([e_user[index.cand_to_user], e_cand], axis=1)
  op = lambda impl: jax.jit(functools.partial(linear_compression, implementation=impl))
  einsum = jax.jit(lambda w, e: jnp.einsum("mk,bkn->bmn", w, e))
  out = {
      "baseline_prebroadcast": (einsum, (w_full, e_full)),
      "baseline_materialized": (op("xla_materialized"), (*args, index)),
      "decomposed": (op("xla"), (*args, index)),
      "decomposed_padded_pre": (op("xla"), (*padded, index)),
      "floor_cand_gemm_padded": (einsum, (padded[1], padded[3])),
  }
  if kernels:
    # The user GEMM in XLA before the fused candidate kernel (two launches),
    # timed against the op's default, which runs both in one launch.
    two_launches = jax.jit(lambda *a: mosaic.forward(
        *a, interpret=False, single_launch=False)[0])
    out["triton_fused"] = (op("triton"), (*args, index))
    out["mosaic_gpu_fused"] = (op("mosaic_gpu"), (*args, index))
    out["mosaic_gpu_two_launches_padded_pre"] = (two_launches,
                                                 (*padded, index.clamped_cand_to_user))
    out["mosaic_gpu_fused_padded_pre"] = (op("mosaic_gpu"), (*padded, index))
  return out


def _flops_bytes(name, num_candidates, num_users, m, n, k_user, k_cand, itemsize):
  if name == "baseline_prebroadcast" or name == "baseline_materialized":
    flops = 2 * m * n * (k_user + k_cand) * num_candidates
  elif name.startswith("floor"):
    flops = 2 * m * n * k_cand * num_candidates
  else:
    flops = 2 * m * n * (k_cand * num_candidates + k_user * num_users)
  # The fewest bytes of the IKBO problem: each input once, the output once.
  nbytes = itemsize * (num_candidates * k_cand * n + num_users * k_user * n
                       + m * (k_user + k_cand) + num_candidates * m * n)
  return flops, nbytes


def run_shape(shape, dtype, ceilings, kernels, iterations, check=True):
  args, index = linear_compression_problem(**shape, dtype=dtype)
  rows = {}
  ref = None
  for name, (fn, operands) in variants(args, index, kernels).items():
    ms, timer = common.median_ms(fn, *operands, iterations=iterations)
    flops, nbytes = _flops_bytes(name, **shape, itemsize=jnp.dtype(dtype).itemsize)
    row = dict(ms=ms, timer=timer, **common.rates(ms, flops, nbytes, ceilings))
    if check and not name.startswith(("floor", "baseline_prebroadcast")):
      result = fn(*operands).astype(jnp.float32)
      ref = result if ref is None else ref
      row["rel_diff_vs_materialized"] = float(
          jnp.linalg.norm(result - ref) / jnp.linalg.norm(ref))
    rows[name] = row
  base = rows["baseline_prebroadcast"]["ms"]
  base_in = rows["baseline_materialized"]["ms"]
  floor = rows["floor_cand_gemm_padded"]["ms"]
  for row in rows.values():
    row["speedup_vs_prebroadcast_baseline"] = base / row["ms"]
    row["speedup_vs_materialized_baseline"] = base_in / row["ms"]
    row["ratio_to_floor"] = row["ms"] / floor
  return rows


def fwd_bwd(shape, dtype, iterations):
  """Forward + backward of the op (IKBO default, and XLA) vs the materialized model.

  The materialized model is differentiated by plain autodiff (the scatter-add
  of the gather and the full-K GEMMs); every variant gets the same cotangent.
  """
  args, index = linear_compression_problem(**shape, dtype=dtype)
  impl = default_implementation(dtype)
  cot = jax.random.normal(jax.random.key(9), (shape["num_candidates"], shape["m"], shape["n"]),
                          dtype)

  def step(impl, *a):
    # Returning the output keeps the forward alive: the op is linear, so its
    # backward alone does not need it and XLA would drop it.
    out, vjp = jax.vjp(lambda *x: linear_compression(*x, index, implementation=impl), *a)
    return out, vjp(cot)

  result = {}
  variants = {"materialized": "xla_materialized", "ikbo_xla": "xla", "ikbo_" + impl: impl}
  for name, chosen in variants.items():
    fn = jax.jit(functools.partial(step, chosen))
    result[name] = common.median_ms(fn, *args, iterations=iterations)[0]
  result["speedup"] = result["materialized"] / result["ikbo_" + impl]
  return result


def _table(rows) -> str:
  lines = ["| variant | ms | TFLOP/s | TB/s | roofline | x prebroadcast | x materialized | / floor |",
           "|---|---|---|---|---|---|---|---|"]
  for name, r in rows.items():
    lines.append(f"| {name} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['tbps']:.2f} | "
                 f"{r['roofline_fraction']:.2f} | {r['speedup_vs_prebroadcast_baseline']:.2f} | "
                 f"{r['speedup_vs_materialized_baseline']:.2f} | {r['ratio_to_floor']:.2f} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--small", action="store_true", help="tiny shapes, any backend")
  parser.add_argument("--iterations", type=int, default=30)
  parser.add_argument("--no-sweeps", action="store_true")
  args = parser.parse_args()
  on_gpu = jax.default_backend() == "gpu"
  kernels = on_gpu
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  main_shape = (dict(num_candidates=64, num_users=4, m=40, n=32, k_user=50, k_cand=30)
                if args.small else PUBLISHED)
  ceilings = common.measure_ceilings()
  print("ceilings", ceilings)
  payload = dict(**common.metadata(), dtype=jnp.dtype(dtype).name, ceilings=ceilings,
                 published_h100_ms=PUBLISHED_MS, main_shape=main_shape)
  payload["ladder"] = run_shape(main_shape, dtype, ceilings, kernels, args.iterations)
  print(_table(payload["ladder"]))
  payload["fwd_bwd"] = fwd_bwd(main_shape, dtype, args.iterations)
  print("fwd+bwd", payload["fwd_bwd"])
  common.write_json(args.out, payload)
  if args.no_sweeps:
    return
  sweep_b = [64, 128] if args.small else list(range(512, 3073, 512))
  sweep_ratio = [2, 16] if args.small else [2, 5, 10, 50, 100, 1000]
  payload["sweep_b"], payload["sweep_ratio"] = {}, {}
  for b in sweep_b:
    shape = dict(main_shape, num_candidates=b, num_users=max(1, round(b / 70)))
    payload["sweep_b"][b] = run_shape(shape, dtype, ceilings, kernels, args.iterations // 2,
                                      check=False)
    print("B", b, {k: round(v["ms"], 3) for k, v in payload["sweep_b"][b].items()})
    common.write_json(args.out, payload)
  for ratio in sweep_ratio:
    b = main_shape["num_candidates"]
    shape = dict(main_shape, num_users=max(1, b // ratio))
    payload["sweep_ratio"][ratio] = run_shape(shape, dtype, ceilings, kernels,
                                              args.iterations // 2, check=False)
    print("ratio", ratio, {k: round(v["ms"], 3) for k, v in payload["sweep_ratio"][ratio].items()})
    common.write_json(args.out, payload)


if __name__ == "__main__":
  main()
