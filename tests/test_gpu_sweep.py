"""The randomized correctness sweep on the GPU: every op, every implementation that claims the inputs.

A fixed set of seeded cases per op (`ikbo_jax.testing.sweep`), each run
against every implementation the dispatcher says supports it on this device,
forward and every gradient, under the project's error rule, and twice for
repeatability. `tools/soak.py` runs many more. On a CPU the same machinery
runs the XLA implementations on smaller cases (`test_sweep.py`).
"""

import pytest

from ikbo_jax.testing import sweep

CASES_PER_OP = {"linear_compression": 12, "target_attention": 12, "self_target_attention": 8,
                "two_level_linear_compression": 8, "two_level_target_attention": 8}


@pytest.mark.gpu
@pytest.mark.parametrize("op, seed", [(op, seed) for op, n in CASES_PER_OP.items()
                                      for seed in range(n)])
def test_gpu_sweep(op, seed):
  case = sweep.draw_case(op, seed)
  results = sweep.run_case(case)
  assert results, f"no implementation supports {case}"
  failures = [r.describe() for r in results if not r.ok]
  # Printed now as well: under `pytest -s` a run cut short by a time limit keeps them.
  for failure in failures:
    print(failure, flush=True)
  assert not failures, "\n".join(failures)
