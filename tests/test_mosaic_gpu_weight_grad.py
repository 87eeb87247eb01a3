"""The Mosaic GPU weight-gradient kernel and the Mosaic backward of linear compression."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ikbo_jax import linear_compression
from ikbo_jax.kernels.mosaic_gpu import weight_grad as weight_grad_kernel
from ikbo_jax.testing.problems import (
    assert_within_reference_error, random_index, random_lce_args, rel_err)


def _operands(seed, num_cands, k, m, n, dtype=jnp.bfloat16):
  ke, kd = jax.random.split(jax.random.key(seed))
  e = jax.random.normal(ke, (num_cands, k, n), jnp.float32).astype(dtype)
  d_out = jax.random.normal(kd, (num_cands, m, n), jnp.float32).astype(dtype)
  return e, d_out


def _reference(e, d_out):
  return jnp.einsum("bkn,bmn->km", e.astype(jnp.float32), d_out.astype(jnp.float32),
                    precision="highest")


# (B, K, M, N): split batches with a ragged last split (B=5 over 2 simulated SMs),
# K and M not multiples of the tiles, several M tiles, one candidate.
@pytest.mark.parametrize("num_cands, k, m, n", [
    (5, 64, 40, 64), (3, 136, 296, 128), (1, 72, 8, 64)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_weight_grad_interpret(num_cands, k, m, n, dtype):
  e, d_out = _operands(num_cands + k, num_cands, k, m, n, dtype)
  out = weight_grad_kernel.weight_grad(e, d_out, interpret=True)
  assert out.shape == (k, m) and out.dtype == jnp.float32
  # Products of 16-bit floats are exact in float32: only the summation order differs.
  assert rel_err(out, _reference(e, d_out)) < 1e-5


def test_weight_grad_config_tiles_m_evenly():
  config = weight_grad_kernel.Config().for_m(440)
  assert config.tile_n == 224  # two tiles of 224 columns cover 440 (one of 256 would not)
  assert weight_grad_kernel.Config().for_m(40).tile_n == 64


def _grads(implementation, args, index, d_out, interpret):
  fn = lambda *a: linear_compression(*a, index, implementation=implementation,
                                     interpret=interpret)
  return jax.vjp(fn, *args)[1](d_out)


@pytest.mark.parametrize("num_users, num_cands", [(3, 7), (1, 5)])
def test_mosaic_backward_within_reference_error(num_users, num_cands):
  """Every cotangent of the Mosaic path against the float32 reference, by the 2x rule."""
  rng = np.random.default_rng(num_cands)
  index = random_index(rng, num_users, num_cands, empty_users=int(num_users > 1))
  args = random_lce_args(20, 70, 40, 30, 100, num_users, num_cands, jnp.bfloat16)
  d_out = jax.random.normal(jax.random.key(21), (num_cands, 70, 100), jnp.bfloat16)
  grads = _grads("mosaic_gpu", args, index, d_out, interpret=True)
  same_precision = _grads("xla_materialized", args, index, d_out, interpret=False)
  f32 = _grads("xla_materialized", [a.astype(jnp.float32) for a in args], index,
               d_out.astype(jnp.float32), interpret=False)
  for name, g, s, r in zip(("w_user", "w_cand", "e_user", "e_cand"), grads, same_precision, f32):
    assert g.shape == s.shape and g.dtype == jnp.bfloat16, name
    assert_within_reference_error(g, s, r)
