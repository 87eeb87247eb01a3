"""Argument checks shared by the ops: clear errors before anything is traced into a kernel."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ikbo_jax.index import CandidateIndex

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_rank(name: str, x, rank: int, layout: str) -> None:
  if x.ndim != rank:
    raise ValueError(f"{name} must have rank {rank} {layout}, got shape {tuple(x.shape)}")


def check_index(index) -> None:
  if not isinstance(index, CandidateIndex):
    raise TypeError(f"index must be a CandidateIndex, got {type(index).__name__}")


def check_operands(**operands) -> None:
  """Rank and non-emptiness of each `name=(array, dim_names)`, e.g. `q=(q, ("B", "T", "H", "D"))`."""
  for name, (x, dims) in operands.items():
    check_rank(name, x, len(dims), f"[{', '.join(dims)}]")
    check_nonempty(name, x)


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


def check_flag(name: str, value) -> bool:
  """A static Python bool: `"yes"`, 1 or an array would otherwise pass a truth test."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a Python bool, got {value!r} ({type(value).__name__})")
  return bool(value)


def resolve_scale(scale, head_dim: int) -> float:
  """The logit scale: `1 / sqrt(D)` by default, else a finite Python or NumPy number."""
  if scale is None:
    return 1.0 / float(np.sqrt(head_dim))
  if not isinstance(scale, (int, float, np.number)) or isinstance(scale, bool):
    raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")
  if not np.isfinite(scale):
    raise ValueError(f"scale must be finite, got {scale}")
  return float(scale)
