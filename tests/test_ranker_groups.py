"""The reference ranker's group level: requests with groups, packing, both builds, training."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ikbo_jax.data import RequestError, pack_requests
from ikbo_jax.data.files import DataError, read_requests, write_requests
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax import rewrite
from ikbo_jax.models import Ranker, RankerConfig, RankingBatch, masked_loss
from ikbo_jax.serving import Bucket, BucketedModel
from ikbo_jax.training import TrainConfig, Trainer

CONFIG = RankerConfig(num_items=200, max_history=16).with_groups(group_dense=6,
                                                                 group_dense_tokens=3)
_ikbo = nnx.jit(lambda model, batch: model(batch))
_standard = nnx.jit(lambda model, batch: model.standard(batch))


def _requests(count, seed=0, config=CONFIG):
  gen = ClickGenerator(config, seed=seed, mean_candidates=6, max_candidates=16)
  return [r.validated(config) for r in gen.requests(count)]


def test_groups_are_per_request_some_empty_and_no_more_than_the_candidates():
  requests = _requests(60)
  assert all(1 <= r.num_groups <= r.num_candidates for r in requests)
  empty = [r for r in requests if len(np.unique(r.cand_groups)) < r.num_groups]
  assert 0 < len(empty) < len(requests)
  assert max(r.num_groups for r in requests) > 1


def test_packing_lays_groups_out_request_by_request_with_out_of_range_padding():
  requests = _requests(3, seed=4)
  batch = pack_requests(requests, CONFIG, num_users=5, num_candidates=48, num_groups=20)
  g, n = sum(r.num_groups for r in requests), sum(r.num_candidates for r in requests)
  assert batch.group_to_user[g:].tolist() == [5] * (20 - g)  # padding groups: user U
  assert batch.item_to_group[n:].tolist() == [20] * (48 - n)  # padding items: group G
  # Every real item's group belongs to the item's user, and holds that request's features.
  i2g = batch.item_to_group[:n]
  np.testing.assert_array_equal(batch.group_to_user[i2g], batch.cand_to_user[:n])
  first = requests[0]
  np.testing.assert_array_equal(batch.group_dense[first.cand_groups],
                                first.group_dense[first.cand_groups])


def test_builds_give_the_same_scores_and_gradients_with_padding_at_every_level():
  model = Ranker(CONFIG, rngs=nnx.Rngs(1))
  batch = pack_requests(_requests(5, seed=2), CONFIG, num_users=7, num_candidates=64,
                        num_groups=40)
  mask = np.asarray(batch.candidate_mask())
  ikbo, standard = _ikbo(model, batch), _standard(model, batch)
  assert np.isfinite(np.asarray(ikbo)).all()
  np.testing.assert_allclose(np.asarray(ikbo)[mask], np.asarray(standard)[mask], rtol=1e-4,
                             atol=1e-4)
  grad = lambda build: nnx.jit(nnx.grad(lambda m: masked_loss(build(m, batch), batch)))(model)
  g_ikbo, g_std = grad(lambda m, b: m(b)), grad(lambda m, b: m.standard(b))
  for (path, a), b in zip(jax.tree.leaves_with_path(g_ikbo), jax.tree.leaves(g_std)):
    scale = float(jnp.max(jnp.abs(b))) + 1e-8
    assert float(jnp.max(jnp.abs(a - b))) <= 1e-4 * scale + 1e-7, jax.tree_util.keystr(path)
  assert float(jnp.abs(g_ikbo["compress"]["w_group"][...]).sum()) > 0
  assert float(jnp.abs(g_ikbo["group_dense"]["kernel"][...]).sum()) > 0


def test_padding_groups_and_candidates_do_not_change_real_scores():
  model = Ranker(CONFIG, rngs=nnx.Rngs(0))
  requests = _requests(3, seed=5)
  n, g = sum(r.num_candidates for r in requests), sum(r.num_groups for r in requests)
  tight = pack_requests(requests, CONFIG, num_users=3, num_candidates=n, num_groups=g)
  loose = pack_requests(requests, CONFIG, num_users=6, num_candidates=n + 17, num_groups=g + 9)
  np.testing.assert_allclose(np.asarray(_ikbo(model, loose))[:n],
                             np.asarray(_ikbo(model, tight)), rtol=1e-5, atol=1e-6)


def test_a_group_changes_only_its_own_candidates_scores():
  model = Ranker(CONFIG, rngs=nnx.Rngs(3))
  requests = _requests(4, seed=6)
  batch = pack_requests(requests, CONFIG, num_users=4, num_candidates=64, num_groups=32)
  changed = dataclasses.replace(batch, group_dense=batch.group_dense.copy())
  target = int(batch.item_to_group[0])
  changed.group_dense[target] += 3.0
  diff = np.abs(np.asarray(_ikbo(model, changed)) - np.asarray(_ikbo(model, batch)))
  mask = np.asarray(batch.candidate_mask())
  in_group = mask & (batch.item_to_group == target)
  assert diff[in_group].min() > 1e-4
  assert diff[mask & ~in_group].max() <= 1e-6 * diff[in_group].min()


@pytest.mark.parametrize("change, message", [
    (dict(cand_groups=None), "cand_groups is missing"),
    (dict(group_dense=np.zeros((0, 6))), r"1 <= g <="),
    (dict(group_dense=np.zeros((2, 5))), r"group_dense must have shape \(2, 6\)"),
    (dict(cand_groups="bad"), "cand_groups must be int"),
    (dict(cand_groups=1.5), "cand_groups must be int"),
])
def test_a_bad_group_field_is_named(change, message):
  request = _requests(1, seed=7)[0]
  with pytest.raises(RequestError, match=message):
    dataclasses.replace(request, **change).validated(CONFIG)


def test_group_ids_out_of_range_and_groups_for_a_model_without_them_are_refused():
  request = _requests(1, seed=8)[0]
  bad = request.cand_groups.copy()
  bad[0] = request.num_groups
  with pytest.raises(RequestError, match=rf"group indices \[{request.num_groups}\] out of range"):
    dataclasses.replace(request, cand_groups=bad).validated(CONFIG)
  with pytest.raises(RequestError, match="the model has no group level"):
    request.validated(RankerConfig(num_items=200, max_history=16))


def test_group_slots_that_do_not_fit_and_batches_without_groups_are_refused():
  requests = _requests(4, seed=9)
  g = sum(r.num_groups for r in requests)
  with pytest.raises(ValueError, match=f"{g} groups do not fit num_groups={g - 1}"):
    pack_requests(requests, CONFIG, num_users=4, num_candidates=64, num_groups=g - 1)
  plain = RankerConfig(num_items=200, max_history=16)
  batch = pack_requests(_requests(2, config=plain), plain, num_users=2, num_candidates=32)
  with pytest.raises(ValueError, match="the batch has none"):
    Ranker(CONFIG, rngs=nnx.Rngs(0))(batch)


def test_the_paths_without_a_group_level_refuse_a_model_or_request_with_one(tmp_path):
  model = Ranker(CONFIG, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="user_state splits the one-level model only"):
    model.user_state(jnp.zeros((1, 16), jnp.int32), jnp.zeros((1, 8)), jnp.zeros(1, jnp.int32))
  with pytest.raises(ValueError, match="serving takes models without a group level"):
    BucketedModel(model, [Bucket(64, 4, 16)])
  with pytest.raises(DataError, match="request 0 has groups"):
    write_requests(_requests(1), tmp_path / "r.parquet")
  with pytest.raises(DataError, match="no group columns"):
    read_requests(tmp_path / "r.parquet", CONFIG)


def test_training_with_groups_learns_the_group_rule():
  """The group's quality moves its candidates' clicks; a model that reads groups learns it."""
  config = RankerConfig().with_groups()
  gen = ClickGenerator(config, seed=0)
  held_out = gen.requests(200, start=10**9)
  trainer = Trainer(config, TrainConfig(steps=150, num_groups=128), gen.request)
  trainer.fit(150, progress=False)
  with_groups = trainer.evaluate(held_out)["auc"]
  # The same model with the group features zeroed scores worse: it relies on them.
  blind = [dataclasses.replace(r, group_dense=np.zeros_like(r.group_dense)) for r in held_out]
  without = trainer.evaluate(blind)["auc"]
  assert with_groups > 0.7 and with_groups > without + 0.02, (with_groups, without)


def test_the_rewrite_runs_the_standard_group_builds_levels_at_their_own_batches():
  """The standard build copies user and group inputs to the candidates; rewritten, neither is."""
  model = Ranker(CONFIG, rngs=nnx.Rngs(4))
  batch = pack_requests(_requests(4, seed=10), CONFIG, num_users=5, num_candidates=48,
                        num_groups=24)
  graphdef, state = nnx.split(model)
  fields = ("user_dense", "history", "history_len", "cand_to_user", "cand_items", "cand_dense",
            "item_to_group", "group_to_user", "group_dense")

  def standard(state, *arrays):
    b = RankingBatch(**dict(zip(fields, arrays)), labels=jnp.zeros(arrays[3].shape))
    return nnx.merge(graphdef, state).standard(b)

  args = (state, *(getattr(batch, f) for f in fields))
  where = dict(mapping=4, users=(1, 2, 3, 8, 9), candidates=(5, 6, 7))
  mask = np.asarray(batch.candidate_mask())
  np.testing.assert_allclose(np.asarray(jax.jit(rewrite.rewrite(standard, **where))(*args))[mask],
                             np.asarray(_standard(model, batch))[mask], rtol=1e-4, atol=1e-4)
  report = rewrite.explain(standard, *args, **where)
  assert report.count("split_dense") == 1 and not report.count("materialized"), str(report)
