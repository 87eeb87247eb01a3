"""Correctness tooling shared by the tests and `tools/soak.py`.

- `error_rule`: the bound every kernel output and gradient must meet against
  float32 and same-precision XLA references;
- `references`: those references for the three ops;
- `sweep`: seeded random cases over the whole input space, run against every
  implementation that supports them.
"""
