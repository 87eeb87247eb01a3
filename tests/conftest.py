"""pytest setup: GPU tests skip without a GPU; failures are logged as they happen.

The shared problem builders are in `ikbo_jax.testing.problems`.
"""

import os

import jax
import pytest


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def pytest_runtest_logreport(report):
  """Appends each failure, in full, to the file IKBO_FAILURE_LOG names, the moment it happens.

  pytest prints tracebacks only when the session ends, so a device run cut by its time
  limit (or one of several workers) would otherwise lose why its tests failed.
  """
  path = os.environ.get("IKBO_FAILURE_LOG")
  if path and report.failed:
    with open(path, "a") as log:
      log.write(f"FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
