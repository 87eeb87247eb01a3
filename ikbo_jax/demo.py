"""Demo: linear compression of random request batches, materialized baseline vs IKBO.

Runs on CPU with the XLA path and on a GPU with the default (kernel) path:

    python -m ikbo_jax.demo
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from ikbo_jax import CandidateIndex, linear_compression
from ikbo_jax.ops.linear_compression import default_implementation


def _timed_ms(fn, *args, iters: int) -> tuple[float, float, float]:
  """Wall-clock `(median, 10th, 90th percentile)` in ms of `iters` calls, after 3 warm-up calls.

  A median of a few calls swung 1.8x-9.8x on a CPU machine; the percentiles show the spread.
  """
  for _ in range(3):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return tuple(float(x) for x in np.percentile(times, (50, 10, 90)))


def _report(label: str, base, ikbo, impl: str) -> None:
  spread = lambda t: f"{t[0]:8.3f} ms  [p10 {t[1]:.3f}, p90 {t[2]:.3f}]"
  print(f"{label}  materialized: {spread(base)}")
  print(f"{label}  IKBO ({impl:>10}): {spread(ikbo)}   speedup {base[0] / ikbo[0]:.2f}x "
        f"(between {base[1] / ikbo[2]:.2f}x and {base[2] / ikbo[1]:.2f}x over the spread)")


def main() -> None:
  on_gpu = jax.default_backend() == "gpu"
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--candidates", type=int, default=1024 if on_gpu else 256)
  parser.add_argument("--users", type=int, default=15 if on_gpu else 4)
  parser.add_argument("--iters", type=int, default=50 if on_gpu else 30)
  args = parser.parse_args()
  m, k_user, k_cand, n = (433, 1178, 866, 256) if on_gpu else (64, 96, 80, 64)
  dtype = jnp.bfloat16 if on_gpu else jnp.float32

  rng = np.random.default_rng(0)
  index = CandidateIndex.from_mapping(
      jnp.asarray(rng.integers(0, args.users, args.candidates), jnp.int32), args.users)
  keys = jax.random.split(jax.random.key(0), 4)
  operands = [(jax.random.normal(k, s) / np.sqrt(s[-2] if len(s) == 3 else s[-1])).astype(dtype)
              for k, s in zip(keys, [(m, k_user), (m, k_cand), (args.users, k_user, n),
                                     (args.candidates, k_cand, n)])]
  impl = default_implementation(dtype)
  baseline = jax.jit(lambda *a: linear_compression(*a, implementation="xla_materialized"))
  ikbo = jax.jit(lambda *a: linear_compression(*a, implementation=impl))

  ref = baseline(*operands, index).astype(jnp.float32)
  out = ikbo(*operands, index).astype(jnp.float32)
  err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
  tol = 2e-2 if dtype != jnp.float32 else 1e-5
  print(f"device: {jax.devices()[0].device_kind}  dtype: {jnp.dtype(dtype).name}")
  print(f"B={args.candidates} U={args.users} M={m} N={n} K_user={k_user} K_cand={k_cand}")
  print(f"relative difference IKBO ({impl}) vs materialized: {err:.2e} (tolerance {tol:.0e})")
  if not err < tol:
    raise SystemExit("IKBO and the materialized baseline disagree")
  print(f"wall clock, median of {args.iters} calls (10th and 90th percentiles)")
  _report("forward", _timed_ms(baseline, *operands, index, iters=args.iters),
          _timed_ms(ikbo, *operands, index, iters=args.iters), impl)

  # A training step: the same cotangent through both, all four gradients compared.
  d_out = jax.random.normal(jax.random.key(1), ref.shape).astype(dtype)
  def fwd_bwd(implementation):
    op = lambda *a: linear_compression(*a, index, implementation=implementation)
    return jax.jit(lambda *a: jax.vjp(op, *a)[1](d_out))
  base_step, ikbo_step = fwd_bwd("xla_materialized"), fwd_bwd(impl)
  grad_err = max(
      float(jnp.linalg.norm((g - r).astype(jnp.float32)) / jnp.linalg.norm(r.astype(jnp.float32)))
      for g, r in zip(ikbo_step(*operands), base_step(*operands)))
  print(f"largest relative gradient difference: {grad_err:.2e} (tolerance {tol:.0e})")
  if not grad_err < tol:
    raise SystemExit("IKBO and materialized gradients disagree")
  _report("fwd+bwd", _timed_ms(base_step, *operands, iters=args.iters),
          _timed_ms(ikbo_step, *operands, iters=args.iters), impl)


if __name__ == "__main__":
  main()
