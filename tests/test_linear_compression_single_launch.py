"""The single-launch Mosaic GPU forward (user GEMM and candidate GEMM in one persistent kernel).

It needs global semaphores, which the interpreter lacks: CPU CI lowers it for
an abstract H200, the GPU tests run it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from ikbo_jax import linear_compression
from ikbo_jax.ops import linear_compression_mosaic as mosaic
from ikbo_jax.testing.problems import assert_within_reference_error, random_index, random_lce_args

# M, K_user, K_cand, N of the published IKBO benchmark shape.
PUBLISHED = (433, 1178, 866, 256)


def _forward(args, index, single_launch):
  return mosaic.forward(*args, index.clamped_cand_to_user, interpret=False,
                        single_launch=single_launch)[0]


def _check(args, index, single_launch):
  out = _forward(args, index, single_launch)
  f32 = linear_compression(*[a.astype(jnp.float32) for a in args], index,
                           implementation="xla_materialized")
  same_precision = linear_compression(*args, index, implementation="xla_materialized")
  assert out.shape == f32.shape and out.dtype == args[0].dtype
  assert_within_reference_error(out, same_precision, f32)
  return out


def test_single_launch_refuses_the_interpreter():
  rng = np.random.default_rng(0)
  index = random_index(rng, 3, 7)
  args = random_lce_args(0, 70, 40, 30, 100, 3, 7, jnp.bfloat16)
  with pytest.raises(ValueError, match="cannot run under the interpreter"):
    mosaic.forward(*args, index.clamped_cand_to_user, interpret=True, single_launch=True)


@pytest.mark.parametrize("single_launch", [True, False])
@pytest.mark.parametrize("num_users, n", [(15, 256), (600, 300)])
def test_forward_lowers_for_h200(single_launch, num_users, n):
  """Both forward variants lower for an H200, including more user tiles than SMs and N > tile."""
  m, k_user, k_cand, _ = PUBLISHED
  specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in (
      (m, k_user), (m, k_cand), (num_users, k_user, n), (1024, k_cand, n))]
  cand_to_user = jax.ShapeDtypeStruct((1024,), jnp.int32)
  forward = lambda *a: mosaic.forward(*a, interpret=False, single_launch=single_launch)[0]
  mesh = AbstractMesh((), (), abstract_device=AbstractDevice(
      device_kind="NVIDIA H200", platform="cuda", num_cores=132))
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(forward).trace(*specs, cand_to_user).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "ikbo_linear_compression_mosaic_gpu" in text
  # The XLA user GEMM exists only in the two-launch variant.
  assert ("dot_general" in text) != single_launch


@pytest.mark.gpu
@pytest.mark.parametrize("single_launch", [True, False])
@pytest.mark.parametrize("num_users, num_candidates, shape", [
    (15, 1023, PUBLISHED),            # odd B, one empty user
    (1, 5, (70, 40, 30, 100)),        # a single user, ragged everything
    (400, 801, (100, 72, 40, 300)),   # more user tiles than SMs, two N tiles
])
def test_gpu_both_variants_within_reference_error(single_launch, num_users, num_candidates,
                                                  shape):
  rng = np.random.default_rng(21)
  index = random_index(rng, num_users, num_candidates, empty_users=min(1, num_users - 1))
  args = random_lce_args(21, *shape, num_users, num_candidates, jnp.bfloat16)
  _check(args, index, single_launch)


@pytest.mark.gpu
def test_gpu_single_launch_repeatable():
  """Waits that were missed would read user tiles before they are written: results would vary."""
  rng = np.random.default_rng(22)
  index = random_index(rng, 15, 1024)
  args = random_lce_args(22, *PUBLISHED, 15, 1024, jnp.bfloat16)
  forward = jax.jit(lambda *a: _forward(a, index, True))
  first = np.asarray(forward(*args))
  for _ in range(5):
    np.testing.assert_array_equal(np.asarray(forward(*args)), first)
