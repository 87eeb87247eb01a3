"""The error rule every kernel test applies: at most twice the same-precision XLA error.

A kernel output `x` is compared with two XLA references computed from the
same inputs:

- `f32`: the inputs upcast to float32, every product at `precision=HIGHEST`
  (the truth, as far as float32 can tell it);
- `same`: XLA at the inputs' dtype and the default precision, with float32
  accumulation wherever XLA's own path has it, and float32 sums of the
  per-user reductions of the backward (a 16-bit scatter-add would make the
  reference, and so the bound, several times worse than it needs to be).

`x` passes when, for the error against `f32`,

    global:   |x - f32| / |f32|          <= 2 * |same - f32| / |f32| + floor
    each row: |x_r - f32_r| / rms_row    <= 2 * |same_r - f32_r| / rms_row + row_floor

where rows are slices along the leading axis (a candidate, a user), `rms_row`
is the root mean square of the reference's row norms (so a row whose true
value is near zero is judged on the tensor's scale), and the floors are small
multiples of the dtype's epsilon. Non-finite values must sit exactly where the
float32 reference has them. The per-row bound catches a single wrong row that
a global norm would average away.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

# (global floor, row floor) by dtype: about eps / 8 and eps.
_FLOORS = {
    jnp.dtype(jnp.float32): (1e-6, 1e-5),
    jnp.dtype(jnp.bfloat16): (1e-3, 8e-3),
    jnp.dtype(jnp.float16): (1.2e-4, 1e-3),
}


@dataclasses.dataclass(frozen=True)
class Comparison:
  """One output's errors against the float32 reference, and whether it passes."""

  name: str
  kernel_err: float  # global relative error of the output under test
  reference_err: float  # global relative error of the same-precision reference
  worst_row_excess: float  # max over rows of kernel_row_err - 2 * reference_row_err
  worst_row: int
  finite_pattern_ok: bool
  floor: float
  row_floor: float

  @property
  def ratio(self) -> float:
    """Kernel error over reference error, the latter no smaller than the floor (what sweeps report).

    Where the reference is exact (float32 inputs on a CPU), the ratio measures
    the kernel against the floor instead of dividing by zero.
    """
    return self.kernel_err / max(self.reference_err, self.floor)

  @property
  def ok(self) -> bool:
    return (self.finite_pattern_ok
            and self.kernel_err <= 2 * self.reference_err + self.floor
            and self.worst_row_excess <= self.row_floor)

  def describe(self) -> str:
    return (f"{self.name}: error {self.kernel_err:.3e} vs reference {self.reference_err:.3e} "
            f"(ratio {self.ratio:.2f}, bound 2x + {self.floor:.0e}); worst row {self.worst_row} "
            f"exceeds 2x its reference error by {self.worst_row_excess:.3e} "
            f"(floor {self.row_floor:.0e}); non-finite pattern "
            f"{'matches' if self.finite_pattern_ok else 'DIFFERS'}")


def floors(dtype) -> tuple[float, float]:
  """(global floor, row floor) of the rule for outputs computed from `dtype` inputs."""
  return _FLOORS[jnp.dtype(dtype)]


def _rows(x) -> np.ndarray:
  x = np.asarray(x, np.float64)
  return x.reshape(x.shape[0], -1) if x.ndim > 1 else x.reshape(-1, 1)


def compare(name: str, out, same, f32, dtype, scale: float = 0.0) -> Comparison:
  """Applies the rule to `out` with references `same` and `f32` (inputs of `dtype`).

  `scale` is a lower bound on the norm errors are measured against, for outputs
  whose true value cancels to (nearly) zero although their terms do not: dq and
  dk of a one-key history are exactly zero, so their rounding noise would
  otherwise be divided by zero.
  """
  out, same, f32 = _rows(out), _rows(same), _rows(f32)
  if not out.shape == same.shape == f32.shape:
    raise ValueError(f"{name}: shapes differ: {out.shape}, {same.shape}, {f32.shape}")
  finite = np.isfinite(f32)
  finite_pattern_ok = bool(np.array_equal(np.isfinite(out), finite))
  # Compare where the truth is finite; elsewhere only the pattern counts.
  out, same, f32 = (np.where(finite, a, 0.0) for a in (out, same, f32))
  out, same = np.where(np.isfinite(out), out, np.inf), np.where(np.isfinite(same), same, np.inf)
  scale = max(float(np.linalg.norm(f32)), scale, 1e-30)
  rms_row = max(scale / np.sqrt(f32.shape[0]), 1e-30)
  row_err = lambda a: np.linalg.norm(a - f32, axis=1) / rms_row
  excess = row_err(out) - 2 * row_err(same)
  floor, row_floor = floors(dtype)
  return Comparison(
      name=name,
      kernel_err=float(np.linalg.norm(out - f32) / scale),
      reference_err=float(np.linalg.norm(same - f32) / scale),
      worst_row_excess=float(np.max(excess)),
      worst_row=int(np.argmax(excess)),
      finite_pattern_ok=finite_pattern_ok,
      floor=floor,
      row_floor=row_floor)


def assert_within_reference_error(name: str, out, same, f32, dtype,
                                  scale: float = 0.0) -> Comparison:
  """`compare`, raising `AssertionError` with the numbers when the rule fails."""
  comparison = compare(name, out, same, f32, dtype, scale)
  assert comparison.ok, comparison.describe()
  return comparison
