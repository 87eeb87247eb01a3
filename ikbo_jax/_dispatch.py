"""Implementations declare what they support; one resolver picks or refuses them.

Every op lists its implementations as `Backend`s in order of preference. A
backend states the dtypes it runs, the device it needs and any op-specific
limit on the inputs (`limits`). `implementation=None` takes the first backend
that supports the inputs on the default device; a named backend that does
not support them raises before anything is traced, naming the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import jax
import jax.numpy as jnp
from jax._src.interpreters import ad

from ikbo_jax import platform

_F32, _BF16, _F16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
ALL_FLOATS = (_F32, _BF16, _F16)
HALF_FLOATS = (_BF16, _F16)


@dataclasses.dataclass(frozen=True)
class Backend:
  """One implementation of an op and the inputs it can run.

  Attributes:
    name: the `implementation=` string.
    is_kernel: runs a Pallas kernel (so `interpret=True` applies).
    dtypes: input dtypes it runs.
    device: what the default device must be: None (any), "gpu" (a CUDA GPU) or
      "hopper" (compute capability 9.0).
    default_dtypes: dtypes for which `implementation=None` may pick it
      (default: `dtypes`); empty for a backend that is never the default.
    limits: `facts -> message or None`, the op-specific limit on the inputs
      (`facts` are the keyword arguments the op passes to `resolve`).
  """

  name: str
  is_kernel: bool
  dtypes: tuple = ALL_FLOATS
  device: Literal[None, "gpu", "hopper"] = None
  default_dtypes: tuple | None = None
  limits: Callable[..., str | None] = lambda **facts: None

  def unsupported(self, dtype, interpret: bool, **facts) -> tuple[type, str] | None:
    """Why this backend cannot run these inputs here, as `(exception type, message)`, or None."""
    prefix = f"implementation={self.name!r}"
    if jnp.dtype(dtype) not in self.dtypes:
      *others, last = (str(d) for d in self.dtypes)
      names = f"{', '.join(others)} and {last}" if others else last
      return TypeError, f"{prefix} supports {names} inputs, got {jnp.dtype(dtype)}"
    if (reason := self.limits(**facts)) is not None:
      return ValueError, f"{prefix} {reason}"
    if interpret or self.device is None:
      return None
    if platform.default_platform() != "gpu":
      return RuntimeError, (
          f"{prefix} needs a CUDA GPU, the default backend is {platform.default_platform()!r}; "
          "pass interpret=True to run it under the Pallas interpreter")
    if self.device == "hopper" and not platform.is_hopper():
      return RuntimeError, (f"{prefix} needs a Hopper GPU (compute capability 9.0), got "
                            f"{platform.gpu_compute_capability()}")
    return None

  def may_default(self, dtype) -> bool:
    dtypes = self.dtypes if self.default_dtypes is None else self.default_dtypes
    return jnp.dtype(dtype) in dtypes


def names(backends: tuple[Backend, ...]) -> tuple[str, ...]:
  return tuple(b.name for b in backends)


def resolve(backends: tuple[Backend, ...], implementation: str | None, dtype, *,
            interpret: bool, **facts) -> Backend:
  """The backend to run: the named one if it supports the inputs, else the first that does."""
  by_name = {b.name: b for b in backends}
  if implementation is None:
    if interpret:
      raise ValueError("interpret=True needs a named kernel implementation")
    for backend in backends:
      if backend.may_default(dtype) and backend.unsupported(dtype, False, **facts) is None:
        return backend
    raise AssertionError(f"no implementation supports these inputs: {facts}")
  if implementation not in by_name:
    raise ValueError(
        f"implementation must be one of {names(backends)} or None, got {implementation!r}")
  backend = by_name[implementation]
  if interpret and not backend.is_kernel:
    kernels = tuple(b.name for b in backends if b.is_kernel)
    raise ValueError(f"interpret=True applies to kernel implementations {kernels} only")
  if (reason := backend.unsupported(dtype, interpret, **facts)) is not None:
    error, message = reason
    raise error(message)
  return backend


def supported(backends: tuple[Backend, ...], dtype, interpret: bool = False,
              **facts) -> tuple[str, ...]:
  """Names of the backends that run these inputs on the default device (or the interpreter)."""
  return tuple(b.name for b in backends if b.unsupported(dtype, interpret, **facts) is None)


def common_varying_axes(*args):
  """`args` with every array marked as varying over each `shard_map` axis any of them varies over.

  A `custom_vjp`'s backward must return cotangents typed like the primal inputs.
  Inside `jax.shard_map`, a replicated weight that meets sharded data gets a
  gradient that differs by shard; cast to varying before the `custom_vjp`, the
  weight's cast transposes to the all-reduce that sums those gradients. Outside
  `shard_map` nothing varies and `args` come back unchanged.
  """
  leaves, tree = jax.tree.flatten(args)
  axes = frozenset().union(*(_varying_axes(x) for x in leaves))
  if not axes:
    return args

  def cast(x):
    missing = tuple(sorted(axes - _varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.unflatten(tree, [cast(x) for x in leaves])


def _varying_axes(x) -> frozenset:
  """The `shard_map` axes along which `x` differs by shard (empty outside `shard_map`)."""
  return frozenset(jax.typeof(x).mat.varying)


def reverse_mode_only(op: str, *args) -> None:
  """Raises one clear error where forward-mode autodiff reaches an op with a custom VJP.

  JAX cannot push tangents forward through a `custom_vjp`; its own error names
  neither the op nor a way out. Forward-mode tracers are visible here when
  `jax.jvp`/`jax.jacfwd` call the op outside `jax.jit`; under `jit` (and for
  `jax.linearize`, whose tracers are those of `jax.grad`) JAX's message stands.
  """
  if forward_mode(*args):
    raise TypeError(
        f"{op} has reverse-mode derivatives only (a custom VJP with its own backward kernels), "
        "so jax.jvp, jax.jacfwd and jax.linearize cannot pass through it. Use jax.grad, "
        "jax.vjp or jax.jacrev; for forward-mode derivatives, differentiate the model written "
        "without IKBO ops (for ikbo_jax.rewrite.rewrite(fn), differentiate fn itself)")


def forward_mode(*args) -> bool:
  """Whether forward-mode autodiff (`jax.jvp`, `jax.jacfwd`) is tracing any of `args`."""
  return any(isinstance(x, ad.JVPTracer) for x in jax.tree.leaves(args))
