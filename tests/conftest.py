"""pytest setup: GPU tests skip without a GPU.

The shared problem builders are in `ikbo_jax.testing.problems`.
"""

import jax
import pytest


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
