"""Argument checks shared by the ops: clear errors before anything is traced into a kernel."""

from __future__ import annotations

import jax.numpy as jnp

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_rank(name: str, x, rank: int, layout: str) -> None:
  if x.ndim != rank:
    raise ValueError(f"{name} must have rank {rank} {layout}, got shape {tuple(x.shape)}")


def check_dim(name: str, x, axis: int, expected: int, meaning: str) -> None:
  if x.shape[axis] != expected:
    raise ValueError(
        f"{name}.shape[{axis}] ({meaning}) must be {expected}, got {x.shape[axis]} "
        f"(shape {tuple(x.shape)})")


def check_nonempty(name: str, x) -> None:
  if 0 in x.shape:
    raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")


def check_float_dtypes(**arrays) -> jnp.dtype:
  """All arrays share one dtype among float32/bfloat16/float16; returns it."""
  dtypes = {name: jnp.dtype(x.dtype) for name, x in arrays.items()}
  for name, dtype in dtypes.items():
    if dtype not in FLOAT_DTYPES:
      raise TypeError(
          f"{name} must be float32, bfloat16 or float16, got {dtype}")
  if len(set(dtypes.values())) > 1:
    listing = ", ".join(f"{n}={d}" for n, d in dtypes.items())
    raise TypeError(f"all operands must share one dtype, got {listing}")
  return next(iter(dtypes.values()))
