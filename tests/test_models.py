"""The reference ranking model: the IKBO and the standard build agree, in scores and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ikbo_jax import CandidateIndex
from ikbo_jax.data import pack_requests
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.models import Ranker, RankerConfig, masked_loss

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


def test_user_side_then_candidate_side_equals_the_ikbo_build_from_any_table_rows():
  """The two halves a cache keeps apart give the build's scores, wherever the user rows lie."""
  config = RankerConfig(num_items=200, max_history=24)
  model = Ranker(config, rngs=nnx.Rngs(2))
  batch = _batch(config, num_requests=5, num_users=7, num_candidates=64, seed=3)
  mask = np.asarray(batch.candidate_mask())
  state = nnx.jit(lambda m, b: m.user_state(b.history, b.user_dense, b.history_len))(model, batch)
  # The users' rows scattered in a larger table, as cache slots would hold them.
  slots = np.array([9, 2, 5, 0, 11, 7, 4])
  table = jax.tree.map(lambda x: jnp.zeros((12, *x.shape[1:]), x.dtype).at[slots].set(x), state)
  cand_to_slot = slots[np.minimum(np.asarray(batch.cand_to_user), 6)]
  index = CandidateIndex.from_mapping(jnp.asarray(cand_to_slot, jnp.int32), num_users=12)
  split = nnx.jit(lambda m, t, b, i: m.score_candidates(t, b.cand_items, b.cand_dense, i))(
      model, table, batch, index)
  np.testing.assert_allclose(np.asarray(split)[mask], np.asarray(_ikbo(model, batch))[mask],
                             rtol=1e-5, atol=1e-5)
  other = jax.tree.map(lambda x: x.at[slots[0]].set(x[slots[1]]), table)  # a stale row reads wrong
  stale = model.score_candidates(other, batch.cand_items, batch.cand_dense, index)
  assert np.abs(np.asarray(stale) - np.asarray(split))[mask].max() > 1e-3


def test_config_rejects_bad_sizes():
  with pytest.raises(ValueError, match="embed_dim"):
    RankerConfig(embed_dim=30, num_heads=4)
  with pytest.raises(ValueError, match="max_history must be a positive int, got 0"):
    RankerConfig(max_history=0)
  with pytest.raises(ValueError, match="dtype"):
    RankerConfig(dtype="int8")


@pytest.mark.gpu
@pytest.mark.parametrize("shuffled", [False, True])
def test_bfloat16_ikbo_build_meets_the_error_rule_on_the_gpu(shuffled):
  """The IKBO build on the GPU kernels, against the float32 standard build at HIGHEST.

  Its error in the scores and in the loss's gradients, and the error of the scores of its
  two halves (`user_state`, `score_candidates`), are held to the rule's global bound
  against the same-precision (bfloat16) standard build's error.
  """
  from ikbo_jax.testing import error_rule

  sizes = dict(num_items=500, embed_dim=256, num_heads=2, max_history=128, query_tokens=16,
               user_dense=32, cand_dense=16, user_dense_tokens=3, cand_dense_tokens=3,
               compressed=16, tower=(64, 32))
  bf16 = Ranker(RankerConfig(dtype="bfloat16", **sizes), rngs=nnx.Rngs(4))
  f32 = Ranker(RankerConfig(**sizes), rngs=nnx.Rngs(4))  # the same parameters
  requests = ClickGenerator(bf16.config, seed=5, mean_candidates=9, max_candidates=40).requests(12)
  batch = pack_requests(requests, bf16.config, num_users=16, num_candidates=256)
  if shuffled:
    order = np.random.default_rng(6).permutation(batch.num_candidates)
    batch = batch.replace(**{f: getattr(batch, f)[order] for f in
                             ("cand_to_user", "cand_items", "cand_dense", "labels")})
  mask = np.asarray(batch.candidate_mask())

  def scores_and_grads(model, build):
    loss = lambda m: masked_loss(build(m, batch), batch)
    logits = nnx.jit(build)(model, batch)
    grads = nnx.jit(nnx.grad(loss))(model)
    return np.asarray(logits)[mask], grads

  ikbo = scores_and_grads(bf16, lambda m, b: m(b))
  same = scores_and_grads(bf16, lambda m, b: m.standard(b))
  with jax.default_matmul_precision("highest"):
    truth = scores_and_grads(f32, lambda m, b: m.standard(b))
  # Through a whole network the two builds' bfloat16 roundings compound differently from
  # the first layer on, so rows of one output (one logit, one row of a weight's gradient)
  # are noisy draws; the rule's per-row bound belongs to single ops (the GPU sweep) and a
  # model is held to its global bound, and its worst logit to twice the reference's worst.
  def assert_global(name, out, same_out, true_out):
    comparison = error_rule.compare(name, out, same_out, true_out, jnp.bfloat16)
    assert comparison.kernel_err <= 2 * comparison.reference_err + comparison.floor, (
        comparison.describe())

  # The two halves the user-state cache runs apart (serving only: scores, no gradients).
  split = nnx.jit(lambda m, b: m.score_candidates(
      m.user_state(b.history, b.user_dense, b.history_len), b.cand_items, b.cand_dense,
      b.index()))
  halves = np.asarray(split(bf16, batch))[mask]
  worst = lambda out: np.max(np.abs(out - truth[0]))
  for name, logits in (("logits", ikbo[0]), ("logits of the two halves", halves)):
    assert_global(name, logits, same[0], truth[0])
    assert worst(logits) <= 2 * worst(same[0]) + 1e-2 * np.max(np.abs(truth[0])), (
        name, worst(logits), worst(same[0]))
  leaf = lambda grads, path: np.asarray(
      functools.reduce(lambda g, k: g[k], path, grads)[...], np.float32)
  for path in (("items", "embedding"), ("sequence", "key", "kernel"),
               ("sequence", "user_query", "kernel"), ("compress", "w_user"),
               ("compress", "w_cand"), ("queries", "kernel")):
    assert_global("d " + ".".join(path), *(leaf(g[1], path) for g in (ikbo, same, truth)))
