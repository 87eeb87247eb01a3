"""Triage of a generated program that `tools/rewrite_fuzz.py` reported: rounding or a real difference?

    python tools/rewrite_triage.py --seed 1046 --per-seed 100

Replays the seed (same hypothesis draws as the fuzz run) up to the first
program outside the float32 tolerance, then evaluates the original and the
rewritten program in float64 as well. Per gradient, it prints the float32
error of each against the float64 original, and how far the float64 rewritten
program is from the float64 original: at float64's rounding (about 1e-16) the
rewrite is the same computation and the float32 miss is the program's own
conditioning; anything larger is a real difference.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

from ikbo_jax import rewrite  # noqa: E402
from ikbo_jax.testing import programs  # noqa: E402
from ikbo_jax.testing.rewrite_check import check_rewrite, outputs_and_gradients  # noqa: E402


def first_failure(seed_value: int, per_seed: int):
  found = {}

  @seed(seed_value)
  @settings(max_examples=per_seed, deadline=None, database=None,
            suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
  @given(programs.programs())
  def check(program):
    steps, inputs = program
    tol = programs.tolerance(steps)
    try:
      check_rewrite(programs.build(steps), inputs, rtol=tol, atol=tol, **programs.WHERE)
    except AssertionError:
      found["program"] = program
      raise

  try:
    check()
  except AssertionError:
    pass
  return found.get("program")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seed", type=int, required=True)
  parser.add_argument("--per-seed", type=int, default=100)
  args = parser.parse_args()
  program = first_failure(args.seed, args.per_seed)
  if program is None:
    print(f"seed {args.seed}: no program outside the tolerance")
    return
  steps, inputs = program
  print(f"seed {args.seed}: {steps}")
  as_dtype = lambda dtype: jax.tree.map(
      lambda x: jnp.asarray(x, dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, inputs)
  fn = programs.build(steps)
  fast = rewrite.rewrite(fn, **programs.WHERE)
  grads = {name: outputs_and_gradients(f, as_dtype(dtype))[1]
           for name, f, dtype in (("original32", fn, jnp.float32), ("rewritten32", fast, jnp.float32),
                                  ("original64", fn, jnp.float64), ("rewritten64", fast, jnp.float64))}
  for k, truth in enumerate(grads["original64"]):
    truth = np.asarray(truth, np.float64)
    finite = np.isfinite(truth)  # errors are taken where the float64 original is finite
    scale = max(float(np.abs(truth[finite]).max(initial=0.0)), 1e-30)
    err, pattern = {}, {}
    for n, g in grads.items():
      if n != "original64":
        g = np.asarray(g[k], np.float64)
        err[n] = float(np.abs(g[finite] - truth[finite]).max(initial=0.0)) / scale
        pattern[n] = "same" if (np.array_equal(np.isnan(g), np.isnan(truth)) and np.array_equal(
            np.where(np.isinf(g), g, 0), np.where(np.isinf(truth), truth, 0))) else "differs"
    if any(err.values()) or not finite.all():
      print(f"gradient {k} {truth.shape} (max finite |g| {scale:.3g}, {int((~finite).sum())} "
            f"non-finite): float32 error original {err['original32']:.2e}, rewritten "
            f"{err['rewritten32']:.2e}; float64 rewritten vs original {err['rewritten64']:.2e}; "
            f"non-finite entries vs the float64 original: original32 {pattern['original32']}, "
            f"rewritten32 {pattern['rewritten32']}, rewritten64 {pattern['rewritten64']}")


if __name__ == "__main__":
  main()
