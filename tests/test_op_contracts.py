"""One contract for every op and every backend it declares (the pattern of tokamax's test base).

Each backend says which dtypes it runs, which device it needs and what inputs it
limits (`ikbo_jax._dispatch.Backend`); these tests hold every declaration to
what the op does: in every declared dtype the forward and every gradient are
within the project's error rule of the float32 reference (kernels under the
interpreter here, on a CPU), an undeclared dtype is refused with a `TypeError`
naming the backend before anything runs, a kernel off its device asks for the
interpreter, and `interpret=True` is refused by a backend that is not a kernel.
Tests of one backend's own machinery (tiling, padding, lowering for the H200)
stay beside the op, in `test_<op>*.py`; the randomized sweep draws many more
cases (`test_sweep.py`, `test_gpu_sweep.py`).
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ikbo_jax import _dispatch, linear_compression, self_target_attention, target_attention
from ikbo_jax.ops import linear_compression as lce_op
from ikbo_jax.ops import self_target_attention as self_target_op
from ikbo_jax.ops import target_attention as target_op
from ikbo_jax.testing import sweep
from ikbo_jax.testing.cases import AttentionCase, LinearCompressionCase, Mapping
from ikbo_jax.testing.problems import random_attention_args, random_index, random_lce_args


@dataclasses.dataclass(frozen=True)
class Op:
  name: str
  backends: tuple
  run: Callable  # (dtype, **kwargs) -> outputs
  shapes: tuple  # the outputs' shapes


def _lce(dtype, **kwargs):
  index = random_index(np.random.default_rng(0), 3, 5)
  return linear_compression(*random_lce_args(0, 16, 8, 8, 64, 3, 5, dtype), index, **kwargs)


def _target(dtype, **kwargs):
  index = random_index(np.random.default_rng(0), 3, 5)
  q, k, v = random_attention_args(0, 3, 5, 8, 128, 1, 64, dtype)
  return target_attention(q, k, v, index, kv_len=jnp.array([128, 1, 0]), **kwargs)


def _self_target(dtype, **kwargs):
  index = random_index(np.random.default_rng(0), 3, 5)
  q, k, v = random_attention_args(0, 3, 5, 8, 128, 1, 64, dtype)
  return self_target_attention(k, q, k, v, index, kv_len=jnp.array([128, 1, 0]), **kwargs)


OPS = (Op("linear_compression", lce_op.BACKENDS, _lce, ((5, 16, 64),)),
       Op("target_attention", target_op.BACKENDS, _target, ((5, 8, 1, 64),)),
       Op("self_target_attention", self_target_op.BACKENDS, _self_target,
          ((3, 128, 1, 64), (5, 8, 1, 64))))
CASES = [pytest.param(op, backend, id=f"{op.name}-{backend.name}")
         for op in OPS for backend in op.backends]


def _kwargs(backend) -> dict:
  return dict(implementation=backend.name, interpret=backend.is_kernel)


# The accuracy contract's cases: sizes off every kernel's blocks (M, N, K;
# T = 7, S = 70), a user without candidates, unsorted ids, a full, a one-key
# and an empty history.
_MAPPING = Mapping(num_users=3, num_candidates=5, num_empty=1, sorted=False)
_ATTENTION = AttentionCase(3, _MAPPING, n_seed=7, seq_len=70, heads=1, head_dim=64,
                           kv_len=(70, 1, 0), dtype="float32")
ACCURACY_CASES = {
    "linear_compression": (LinearCompressionCase(3, _MAPPING, m=17, n=65, k_user=9, k_cand=24,
                                                 dtype="float32"),),
    "target_attention": (_ATTENTION,),
    "self_target_attention": (dataclasses.replace(_ATTENTION, causal=True),
                              dataclasses.replace(_ATTENTION, causal=False)),
}


@pytest.mark.parametrize("op, backend", CASES)
def test_forward_and_every_gradient_within_the_error_rule(op, backend):
  for dtype in backend.dtypes:
    for case in ACCURACY_CASES[op.name]:
      case = dataclasses.replace(case, dtype=jnp.dtype(dtype).name)
      sweep.assert_passes(case, (backend.name,), interpret=backend.is_kernel)


@pytest.mark.parametrize("op, backend", CASES)
def test_every_declared_dtype_runs(op, backend):
  for dtype in backend.dtypes:
    outputs = jax.tree.leaves(op.run(dtype, **_kwargs(backend)))
    assert [o.shape for o in outputs] == list(op.shapes), (dtype, [o.shape for o in outputs])
    assert all(o.dtype == dtype and bool(jnp.all(jnp.isfinite(o))) for o in outputs), dtype


@pytest.mark.parametrize("op, backend", CASES)
def test_an_undeclared_dtype_is_refused_before_anything_runs(op, backend):
  for dtype in set(_dispatch.ALL_FLOATS) - set(backend.dtypes):
    with pytest.raises(TypeError, match=f"implementation={backend.name!r} supports"):
      op.run(dtype, **_kwargs(backend))


@pytest.mark.parametrize("op, backend", CASES)
def test_a_kernel_off_its_device_asks_for_the_interpreter(op, backend):
  if not backend.is_kernel or jax.default_backend() == "gpu":
    pytest.skip("a kernel backend on a machine without a GPU")
  with pytest.raises(RuntimeError, match="interpret=True"):
    op.run(backend.dtypes[0], implementation=backend.name)


@pytest.mark.parametrize("op, backend", CASES)
def test_interpret_is_refused_by_a_backend_that_is_not_a_kernel(op, backend):
  if backend.is_kernel:
    pytest.skip("a kernel backend")
  with pytest.raises(ValueError, match="interpret=True applies to kernel implementations"):
    op.run(backend.dtypes[0], implementation=backend.name, interpret=True)
