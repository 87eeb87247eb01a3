"""Checks on 8 simulated CPU devices; `tests/test_sharding.py` runs this file in a subprocess
with `--xla_force_host_platform_device_count=8` (the flag must precede jax's start)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ikbo_jax import CandidateIndex, linear_compression, target_attention
from ikbo_jax.data import pack_requests
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.models import Ranker, RankerConfig
from ikbo_jax.models.sharded import place, shard_batch, sharded_loss, sharded_scores
from ikbo_jax.sharding import plan_shards
from ikbo_jax.models import masked_loss

CONFIG = RankerConfig(num_items=300, max_history=16)


@pytest.fixture(scope="module")
def mesh():
  assert len(jax.devices()) == 8, "run with --xla_force_host_platform_device_count=8"
  return jax.make_mesh((8,), ("data",))


def _batch(num_requests, seed=0):
  requests = ClickGenerator(CONFIG, seed=seed, mean_candidates=6, max_candidates=30).requests(
      num_requests)
  return pack_requests(requests, CONFIG, num_users=num_requests + 3, num_candidates=400)


def _no_user_gathers(hlo: str):
  for collective in ("all-gather", "all-to-all", "collective-permute"):
    assert collective not in hlo, f"{collective} in the sharded program"


def test_sharded_ranker_equals_unsharded(mesh):
  model = Ranker(CONFIG, rngs=nnx.Rngs(0))
  batch = _batch(21)  # uneven: 21 requests of 1-30 candidates over 8 shards
  expected = np.asarray(nnx.jit(lambda m, b: m(b))(model, batch))[np.asarray(
      batch.candidate_mask())]
  sharded = shard_batch(batch, 8)
  graphdef, state = nnx.split(model)
  scores = sharded_scores(graphdef, mesh)
  placed = place(sharded.batch, mesh)
  got = sharded.restore(scores(state, placed))
  np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-6)
  hlo = scores.lower(state, placed).compile().as_text()
  _no_user_gathers(hlo)
  assert "all-reduce" not in hlo  # the forward needs no collective at all


def test_sharded_training_gradients_equal_unsharded(mesh):
  model = Ranker(CONFIG, rngs=nnx.Rngs(1))
  batch = _batch(13, seed=1)
  graphdef, state = nnx.split(model)
  expected = jax.grad(lambda s: masked_loss(nnx.merge(graphdef, s)(batch), batch))(state)
  sharded = shard_batch(batch, 8)
  loss = sharded_loss(graphdef, mesh)
  step = jax.jit(jax.value_and_grad(loss))
  placed = place(sharded.batch, mesh)
  value, got = step(state, placed)
  np.testing.assert_allclose(
      float(value), float(masked_loss(nnx.merge(graphdef, state)(batch), batch)), rtol=1e-5)
  for (path, a), b in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(expected)):
    scale = float(jnp.max(jnp.abs(b))) + 1e-8
    assert float(jnp.max(jnp.abs(a - b))) <= 1e-4 * scale + 1e-7, jax.tree_util.keystr(path)
  _no_user_gathers(step.lower(state, placed).compile().as_text())


def test_ops_per_shard_under_shard_map(mesh):
  rng = np.random.default_rng(2)
  num_users, num_candidates = 19, 150
  ids = rng.integers(0, num_users, num_candidates)
  plan = plan_shards(ids, num_users, 8)
  f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
  e_user, e_cand = f32(num_users, 5, 16), f32(num_candidates, 3, 16)
  w_user, w_cand = f32(7, 5), f32(7, 3)
  q, k, v = f32(num_candidates, 4, 2, 8), f32(num_users, 12, 2, 8), f32(num_users, 12, 2, 8)
  u = plan.users_per_shard

  def per_shard(e_user, e_cand, q, k, v, local_ids):
    index = CandidateIndex.from_mapping(local_ids, u)
    return (linear_compression(w_user, w_cand, e_user, e_cand, index),
            target_attention(q, k, v, index))

  sharded = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"),
                                  out_specs=P("data")))
  args = jax.device_put((plan.users(e_user), plan.candidates(e_cand), plan.candidates(q),
                         plan.users(k), plan.users(v), plan.local_cand_to_user),
                        NamedSharding(mesh, P("data")))
  lce, attention = sharded(*args)
  index = CandidateIndex.from_mapping(jnp.asarray(ids, jnp.int32), num_users)
  with jax.default_matmul_precision("highest"):
    np.testing.assert_allclose(plan.restore(lce),
                               linear_compression(w_user, w_cand, e_user, e_cand, index),
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(plan.restore(attention), target_attention(q, k, v, index),
                               rtol=1e-4, atol=1e-4)
  _no_user_gathers(sharded.lower(*args).compile().as_text())


def test_serving_over_devices_equals_one_device():
  import asyncio

  from ikbo_jax.serving import Batcher, BatchingConfig, Bucket, BucketedModel, DeviceSet

  model = Ranker(CONFIG, rngs=nnx.Rngs(3))
  buckets = [Bucket(96, 8, CONFIG.max_history)]
  requests = ClickGenerator(CONFIG, seed=4, mean_candidates=6, max_candidates=30).requests(40)
  one, several = BucketedModel(model, buckets), DeviceSet(model, buckets,
                                                          devices=jax.devices()[:4])

  async def serve(served):
    async with Batcher(served, BatchingConfig(max_batch_requests=2, max_in_flight=8)) as batcher:
      return await asyncio.gather(*(batcher.score(r) for r in requests))

  expected, got = asyncio.run(serve(one)), asyncio.run(serve(several))
  for a, b in zip(got, expected):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert sum(several.batches_per_device) >= 20
  assert sum(count > 0 for count in several.batches_per_device) >= 2, several.batches_per_device
