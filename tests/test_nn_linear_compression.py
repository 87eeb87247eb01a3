import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ikbo_jax.nn import LinearCompression
from ikbo_jax.testing.problems import random_index, rel_err


class MaterializedCompression(nnx.Module):
  """What models do today: broadcast user embeddings to candidates, concat, one dense map."""

  def __init__(self, w):
    self.w = nnx.Param(w)

  def __call__(self, e_user, e_cand, cand_to_user):
    e = jnp.concatenate([e_user[cand_to_user], e_cand], axis=1)
    return jnp.einsum("mk,bkn->bmn", self.w[...], e, precision="highest")


@pytest.mark.parametrize("implementation", ["xla", "xla_materialized"])
def test_parity_with_materialized_model_forward_and_grad(implementation):
  layer = LinearCompression(12, 9, 10, implementation=implementation, rngs=nnx.Rngs(0))
  index = random_index(np.random.default_rng(0), 4, 11, empty_users=1)
  keys = jax.random.split(jax.random.key(1), 2)
  e_user = jax.random.normal(keys[0], (4, 12, 16))
  e_cand = jax.random.normal(keys[1], (11, 9, 16))
  baseline = MaterializedCompression(
      jnp.concatenate([layer.w_user[...], layer.w_cand[...]], axis=1))

  out = layer(e_user, e_cand, index)
  assert rel_err(out, baseline(e_user, e_cand, index.cand_to_user)) < 1e-5
  grads = nnx.grad(lambda m: jnp.sum(jnp.sin(m(e_user, e_cand, index))))(layer)
  base_grads = nnx.grad(
      lambda m: jnp.sum(jnp.sin(m(e_user, e_cand, index.cand_to_user))))(baseline)
  w = jnp.concatenate([grads.w_user[...], grads.w_cand[...]], axis=1)
  assert rel_err(w, base_grads.w[...]) < 1e-5


def test_module_conventions():
  layer = LinearCompression(3, 2, 5, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  assert layer.w_user[...].shape == (5, 3) and layer.w_cand[...].shape == (5, 2)
  assert layer.w_user[...].dtype == jnp.bfloat16
  index = random_index(np.random.default_rng(1), 2, 3)
  out = layer(jnp.ones((2, 3, 4)), jnp.ones((3, 2, 4)), index)
  assert out.dtype == jnp.float32  # inputs promote with bfloat16 params
  layer32 = LinearCompression(3, 2, 5, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  assert layer32(jnp.ones((2, 3, 4)), jnp.ones((3, 2, 4)), index).dtype == jnp.bfloat16


# Defect: nn.LinearCompression initialized at 2.17x nnx.Linear's scale at the published shape.
def test_linear_compression_init_matches_nnx_linear_over_the_concatenated_stack():
  k_user, k_cand, m = 1178, 866, 433
  layer = LinearCompression(k_user, k_cand, m, rngs=nnx.Rngs(0))
  dense = nnx.Linear(k_user + k_cand, m, rngs=nnx.Rngs(1))
  w = np.concatenate([layer.w_user[...], layer.w_cand[...]], axis=1)
  assert w.shape == (m, k_user + k_cand)
  np.testing.assert_allclose(w.std(), np.asarray(dense.kernel[...]).std(), rtol=0.02)
  np.testing.assert_allclose(w.std(), 1 / np.sqrt(k_user + k_cand), rtol=0.05)
