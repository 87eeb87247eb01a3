"""What the default device can run: decides which implementations are available."""

from __future__ import annotations

import functools

import jax


@functools.cache
def default_platform() -> str:
  return jax.default_backend()


def gpu_compute_capability() -> tuple[int, int] | None:
  """(major, minor) of the default GPU, or None when the default device is not a CUDA GPU."""
  if default_platform() != "gpu":
    return None
  device = jax.devices()[0]
  capability = getattr(device, "compute_capability", None)
  if capability is None:
    return None
  major, minor = str(capability).split(".")
  return int(major), int(minor)


def is_hopper() -> bool:
  return gpu_compute_capability() == (9, 0)
