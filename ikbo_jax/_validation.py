"""Argument checks shared by the ops: clear errors before anything is traced into a kernel."""

from __future__ import annotations

import jax.numpy as jnp

from ikbo_jax import platform
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


def require_gpu(implementation: str, interpret: bool) -> None:
  """A kernel implementation outside the interpreter needs a CUDA GPU as the default backend."""
  if not interpret and platform.default_platform() != "gpu":
    raise RuntimeError(
        f"implementation={implementation!r} needs a CUDA GPU, the default backend is "
        f"{platform.default_platform()!r}; pass interpret=True to run it under the "
        "Pallas interpreter")


def check_implementation(implementation: str, implementations: tuple, kernels: tuple, dtype,
                         interpret: bool) -> None:
  """A known implementation that can run here; `interpret` only with a kernel.

  The Mosaic GPU kernels take 16-bit inputs and need a Hopper GPU (outside the
  interpreter); op-specific limits are checked by the op.
  """
  if implementation not in implementations:
    raise ValueError(
        f"implementation must be one of {implementations} or None, got {implementation!r}")
  if implementation not in kernels:
    if interpret:
      raise ValueError(f"interpret=True applies to kernel implementations {kernels} only")
    return
  if implementation == "mosaic_gpu" and jnp.dtype(dtype) == jnp.float32:
    raise TypeError("implementation='mosaic_gpu' supports bfloat16 and float16 inputs, got float32")
  require_gpu(implementation, interpret)
  if implementation == "mosaic_gpu" and not interpret and not platform.is_hopper():
    raise RuntimeError(
        "implementation='mosaic_gpu' needs a Hopper GPU (compute capability 9.0), got "
        f"{platform.gpu_compute_capability()}")


def resolve_implementation(implementation: str | None, implementations: tuple, kernels: tuple,
                           dtype, interpret: bool, default) -> str:
  """The implementation to run: `default()` for None, checked by `check_implementation`."""
  if implementation is None:
    if interpret:
      raise ValueError("interpret=True needs a named kernel implementation")
    implementation = default()
  check_implementation(implementation, implementations, kernels, dtype, interpret)
  return implementation


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
