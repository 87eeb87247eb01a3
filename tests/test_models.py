"""The reference ranking model: the IKBO and the standard build agree, in scores and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ikbo_jax.data import pack_requests
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.models import Ranker, RankerConfig
from ikbo_jax.training.trainer import masked_loss

_ikbo = nnx.jit(lambda model, batch: model(batch))
_standard = nnx.jit(lambda model, batch: model.standard(batch))


def _batch(config, num_requests, num_users, num_candidates, seed=0):
  requests = ClickGenerator(config, seed=seed, mean_candidates=4, max_candidates=12).requests(
      num_requests)
  # Edge cases: an empty history and a full one.
  requests[0] = requests[0].__class__(**{**requests[0].__dict__, "history": np.zeros(0, int)})
  return pack_requests(requests, config, num_users=num_users, num_candidates=num_candidates)


def test_builds_give_the_same_scores_and_gradients():
  config = RankerConfig(num_items=200, max_history=24)
  model = Ranker(config, rngs=nnx.Rngs(1))
  batch = _batch(config, num_requests=5, num_users=7, num_candidates=64)  # padding users, cands
  mask = np.asarray(batch.candidate_mask())
  ikbo, standard = _ikbo(model, batch), _standard(model, batch)
  assert np.isfinite(np.asarray(ikbo)).all()
  np.testing.assert_allclose(np.asarray(ikbo)[mask], np.asarray(standard)[mask],
                             rtol=1e-4, atol=1e-4)

  grad = lambda build: nnx.jit(nnx.grad(lambda m: masked_loss(build(m, batch), batch)))(model)
  g_ikbo = grad(lambda m, b: m(b))
  g_std = grad(lambda m, b: m.standard(b))
  leaves = jax.tree.leaves_with_path(g_ikbo)
  assert len(leaves) == len(jax.tree.leaves(g_std)) > 20
  for (path, a), b in zip(leaves, jax.tree.leaves(g_std)):
    scale = float(jnp.max(jnp.abs(b))) + 1e-8
    assert float(jnp.max(jnp.abs(a - b))) <= 1e-4 * scale + 1e-7, jax.tree_util.keystr(path)
  assert float(jnp.abs(g_ikbo["sequence"]["key"]["kernel"][...]).sum()) > 0


def test_bfloat16_builds_agree_within_bfloat16_rounding():
  config = RankerConfig(dtype="bfloat16", num_items=200, max_history=16)
  model = Ranker(config, rngs=nnx.Rngs(2))
  batch = _batch(config, num_requests=4, num_users=4, num_candidates=48, seed=3)
  mask = np.asarray(batch.candidate_mask())
  ikbo, standard = np.asarray(_ikbo(model, batch))[mask], np.asarray(_standard(model, batch))[mask]
  f32 = np.asarray(_ikbo(Ranker(RankerConfig(num_items=200, max_history=16), rngs=nnx.Rngs(2)),
                        batch))[mask]
  # Each build is within bfloat16 rounding of the float32 model, and of each other.
  scale = np.abs(f32).max()
  assert np.abs(ikbo - f32).max() < 0.05 * scale
  assert np.abs(ikbo - standard).max() < 0.05 * scale


def test_padding_candidates_do_not_change_real_scores():
  config = RankerConfig(num_items=100, max_history=8, causal=False)
  model = Ranker(config, rngs=nnx.Rngs(0))
  tight = _batch(config, num_requests=3, num_users=3, num_candidates=40)
  n = int(np.sum(tight.candidate_mask()))
  exact = _batch(config, num_requests=3, num_users=3, num_candidates=n)
  np.testing.assert_allclose(np.asarray(_ikbo(model, tight))[:n], np.asarray(_ikbo(model, exact)),
                             rtol=1e-5, atol=1e-6)


def test_config_rejects_bad_sizes():
  with pytest.raises(ValueError, match="embed_dim"):
    RankerConfig(embed_dim=30, num_heads=4)
  with pytest.raises(ValueError, match="max_history must be a positive int, got 0"):
    RankerConfig(max_history=0)
  with pytest.raises(ValueError, match="dtype"):
    RankerConfig(dtype="int8")
