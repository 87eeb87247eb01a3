"""Zero padding to aligned sizes: the one place ops and benchmarks pad operands."""

from __future__ import annotations

import jax.numpy as jnp


def round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def pad_to(x, axis: int, size: int):
  """Zero-pads `x` along `axis` to `size` (a no-op when it is already that size)."""
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def pad_to_multiple(x, axis: int, multiple: int):
  return pad_to(x, axis, round_up(x.shape[axis], multiple))
