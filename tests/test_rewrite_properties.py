"""Differential testing of the rewrite over generated programs (`hypothesis`).

Every generated program (`ikbo_jax.testing.programs`) must give, rewritten,
the outputs and every float gradient of the original, under `jax.jit`. The
CI profile runs a fixed, derandomized set; the long profile runs on demand:

    IKBO_REWRITE_EXAMPLES=10000 IKBO_REWRITE_SEED=1 python -m pytest -q \
        tests/test_rewrite_properties.py

(`tools/rewrite_fuzz.py` runs it in parallel processes and counts programs.)
"""

import os

from hypothesis import HealthCheck, Phase, given, seed, settings

from ikbo_jax.testing import programs
from ikbo_jax.testing.rewrite_check import check_rewrite

EXAMPLES = int(os.environ.get("IKBO_REWRITE_EXAMPLES", "40"))
SEED = int(os.environ.get("IKBO_REWRITE_SEED", "0"))


@seed(SEED)
@settings(max_examples=EXAMPLES, deadline=None, derandomize="IKBO_REWRITE_SEED" not in os.environ,
          database=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate] + (
              [Phase.shrink] if os.environ.get("IKBO_REWRITE_SHRINK") else []))
@given(programs.programs())
def test_rewrite_equals_the_original_program(program):
  steps, args = program
  tol = programs.tolerance(steps)
  check_rewrite(programs.build(steps), args, rtol=tol, atol=tol, **programs.WHERE)
