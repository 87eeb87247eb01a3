"""The IKBO rewrite on a corpus of models written the standard way.

Each model: the rewritten function equals the original (outputs and every
gradient), the report lists the expected changes, and the lowered program no
longer gathers a `[B, ...]` copy of a user tensor where a rewrite was expected
(and still does where none was).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ikbo_jax import rewrite
from ikbo_jax.data import pack_requests
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.models import Ranker, RankerConfig, RankingBatch
from ikbo_jax.testing.rewrite_check import check_rewrite

U, B = 3, 10
IDS = jnp.array([2, 0, 1, 2, 2, 0, 1, 1, 0, 2], jnp.int32)  # unsorted


def _normal(seed, *shape):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _copies_of(fn, args, user_shape) -> int:
  """Gathers in the lowered program that copy a `user_shape` tensor to B rows.

  The rewrite's user rows may carry up to two extra rows (what out-of-range ids read).
  """
  text = jax.jit(fn).lower(*args).as_text()
  rows = "|".join(str(user_shape[0] + extra) for extra in range(3))
  user = f"(?:{rows})x" + "x".join(map(str, user_shape[1:]))
  copy = "x".join(map(str, (B, *user_shape[1:])))
  pattern = rf'"?stablehlo\.gather"?\(?.*\(tensor<{user}xf32>, tensor<[0-9x]*xi32>\) -> tensor<{copy}xf32>'
  return len(re.findall(pattern, text))


def _check(fn, args, *, users, expect, user_shape=None, mapping=1, rtol=1e-5,
           candidates=None):
  report = check_rewrite(fn, args, mapping=mapping, users=users, candidates=candidates,
                         rtol=rtol, atol=rtol)
  for kind in expect:
    assert report.count(kind) >= 1, (kind, str(report))
  if user_shape is not None:
    fast = rewrite.rewrite(fn, mapping=mapping, users=users, candidates=candidates)
    assert _copies_of(fn, args, user_shape) >= 1, "the original should copy the user tensor"
    expected_copies = 0 if expect else 1
    assert (_copies_of(fast, args, user_shape) >= 1) == bool(expected_copies), str(report)
  return report


def test_dlrm_style_concat_and_mlp():
  def model(user, ids, cand, w1, w2):
    return jax.nn.relu(jnp.concatenate([user[ids], cand], axis=1) @ w1) @ w2
  args = (_normal(0, U, 8), IDS, _normal(1, B, 4), _normal(2, 12, 16), _normal(3, 16, 1))
  _check(model, args, users=(0,), expect=["split_dense"], user_shape=(U, 8))


def test_linear_compression_over_a_concatenated_stack():
  def model(e_user, ids, e_cand, w):
    return jnp.einsum("mk,bkn->bmn", w, jnp.concatenate([e_user[ids], e_cand], axis=1))
  args = (_normal(0, U, 6, 5), IDS, _normal(1, B, 7, 5), _normal(2, 9, 13))
  report = _check(model, args, users=(0,), expect=["linear_compression"],
                  user_shape=(U, 6, 5))
  assert report.bytes_saved > 0


@pytest.mark.parametrize("padding_id", [None, U, -1])
def test_linear_compression_over_jnp_take_in_its_fill_mode(padding_id):
  """`jnp.take(x, cand_to_user, axis=0)`, how many rankers gather, keeps its linear compression."""
  def model(e_user, ids, e_cand, w):
    stack = jnp.concatenate([jnp.take(e_user, ids, axis=0), e_cand], axis=1)
    return jnp.einsum("mk,bkn->bmn", w, stack)
  ids = IDS if padding_id is None else IDS.at[-1].set(padding_id)
  args = (_normal(0, U, 6, 5), ids, _normal(1, B, 7, 5), _normal(2, 9, 13))
  report = _check(model, args, users=(0,), expect=["linear_compression"], user_shape=(U, 6, 5))
  assert not report.materialized, str(report)


def test_linear_compression_with_the_stack_on_the_left():
  def model(e_user, ids, e_cand, w):
    return jnp.einsum("bkn,km->bnm", jnp.concatenate([e_user[ids], e_cand], axis=1), w)
  args = (_normal(0, U, 6, 5), IDS, _normal(1, B, 7, 5), _normal(2, 13, 9))
  _check(model, args, users=(0,), expect=["linear_compression"], user_shape=(U, 6, 5))


def test_a_user_tower_runs_at_batch_u():
  def model(user, ids, cand, w1, b1, w2):
    tower = jnp.tanh(jax.nn.relu(user[ids] @ w1 + b1) @ w2)
    return jnp.sum(tower * cand, axis=-1)
  args = (_normal(0, U, 8), IDS, _normal(1, B, 6), _normal(2, 8, 6), _normal(3, 6),
          _normal(4, 6, 6))
  report = _check(model, args, users=(0,), expect=["at_users"], user_shape=(U, 8))
  assert report.count("materialized") == 1 and report.flops_saved > 0


def test_take_with_a_clamped_index_and_clip_mode_are_broadcasts():
  def model(user, ids, cand, w):
    a = jnp.take(user, jnp.clip(ids, 0, U - 1), axis=0) @ w  # fill mode, index known in range
    b = jnp.take(user, ids, axis=0, mode="clip") @ w
    return a * cand + b * cand
  args = (_normal(0, U, 8), IDS, _normal(1, B, 5), _normal(2, 8, 5))
  report = _check(model, args, users=(0,), expect=["at_users"], user_shape=(U, 8))
  assert report.count("broadcast") == 2


def test_take_that_fills_is_a_broadcast_with_its_own_out_of_range_rows():
  """Out-of-range candidates get NaN rows and no cotangent, as `jnp.take` gives them."""
  def model(user, ids, w, cand):
    return jnp.take(user, ids, axis=0) @ w * cand  # out-of-range ids give NaN rows
  ids = IDS.at[3].set(7).at[5].set(-9)
  args = (_normal(0, U, 8), ids, _normal(2, 8, 5), _normal(1, B, 5))
  report = _check(model, args, users=(0,), expect=["at_users"])
  assert report.count("broadcast") == 1 and [c.primitive for c in report.materialized] == ["mul"]


def _din_args(seed=0, s=12, f=8, t=2):
  return (_normal(seed, U, s, f), IDS, _normal(seed + 1, B, t, f), _normal(seed + 2, f, f),
          _normal(seed + 3, f, f), _normal(seed + 4, f, f), jnp.array([12, 0, 5], jnp.int32))


def test_din_style_target_attention_through_the_marker():
  def model(seq, ids, cand, wq, wk, wv, lengths):
    heads = lambda x: x.reshape(*x.shape[:-1], 2, 4)
    k, v = heads(seq[ids] @ wk), heads(seq[ids] @ wv)
    return rewrite.attention(heads(cand @ wq), k, v, lengths[ids])
  _check(model, _din_args(), users=(0, 6), expect=["target_attention"], rtol=1e-3,
         user_shape=(U, 12, 8))


def test_self_and_target_attention_over_one_projected_sequence():
  def model(seq, ids, cand, wq, wk, wv, lengths):
    heads = lambda x: x.reshape(*x.shape[:-1], 2, 4)
    hist, n = seq[ids], lengths[ids]
    k, v = heads(hist @ wk), heads(hist @ wv)
    encoded = rewrite.attention(heads(hist @ wq), k, v, n, causal=True)  # user rows: at U
    target = rewrite.attention(heads(cand @ wq), k, v, n)
    return jnp.sum(encoded, axis=1, keepdims=True) + target
  report = _check(model, _din_args(1), users=(0, 6),
                  expect=["target_attention", "at_users"], rtol=1e-3)
  assert report.count("target_attention") == 1


def test_embedding_lookups_are_not_broadcasts():
  def model(user, ids, table, items):
    return jnp.sum(table[items] * user[ids], axis=-1)
  table = _normal(1, 50, 8)
  items = jnp.arange(B, dtype=jnp.int32) * 3
  args = (_normal(0, U, 8), IDS, table, items)
  report = _check(model, args, users=(0,), expect=[])
  assert report.count("broadcast") == 1  # the mapping's gather only, not the lookup
  text = jax.jit(rewrite.rewrite(model, mapping=1, users=(0,))).lower(
      *args).as_text()
  assert "tensor<50x8xf32>" in text  # the lookup is still there


def test_a_model_without_broadcasts_is_unchanged():
  def model(cand, ids, w):
    del ids
    return jax.nn.relu(cand @ w)
  args = (_normal(0, B, 4), IDS, _normal(1, 4, 3))
  report = _check(model, args, users=(), expect=[], mapping=1)
  assert not report.changes


def test_cond_and_a_scan_over_broadcast_rows():
  def model(user, ids, cand):
    x = user[ids]
    y = jax.lax.cond(jnp.sum(cand) > 0, lambda a: a * 2.0, lambda a: a - 1.0, x)
    z, _ = jax.lax.scan(lambda c, row: (c + row, None), jnp.zeros(x.shape[1:]), y)
    return y * cand + z
  args = (_normal(0, U, 6), IDS, _normal(1, B, 6))
  report = _check(model, args, users=(0,), expect=[], user_shape=(U, 6))
  assert report.count("entered") == 2 and report.count("materialized") >= 1


def test_composes_with_vmap_over_weights():
  def model(user, ids, cand, w1):
    return jnp.concatenate([user[ids], cand], axis=1) @ w1
  fast = rewrite.rewrite(model, mapping=1, users=(0,))
  args = (_normal(0, U, 8), IDS, _normal(1, B, 4))
  ws = _normal(2, 3, 12, 5)
  got = jax.vmap(fast, in_axes=(None, None, None, 0))(*args, ws)
  want = jax.vmap(model, in_axes=(None, None, None, 0))(*args, ws)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_nnx_linear_user_tower():
  class Tower(nnx.Module):
    def __init__(self, rngs):
      self.user = nnx.Linear(8, 16, rngs=rngs)
      self.out = nnx.Linear(16 + 4, 1, rngs=rngs)

    def __call__(self, user, ids, cand):
      return self.out(jnp.concatenate([nnx.relu(self.user(user[ids])), cand], axis=-1))

  graphdef, state = nnx.split(Tower(nnx.Rngs(0)))
  fn = lambda user, ids, cand, state: nnx.merge(graphdef, state)(user, ids, cand)
  args = (_normal(0, U, 8), IDS, _normal(1, B, 4), state)
  fast = rewrite.rewrite(fn, mapping=1, users=(0,))
  np.testing.assert_allclose(fast(*args), fn(*args), rtol=1e-5, atol=1e-6)
  grad = lambda f: jax.grad(lambda s: jnp.sum(f(*args[:3], s) ** 2))(state)
  for g, w in zip(jax.tree.leaves(grad(fast)), jax.tree.leaves(grad(fn))):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  report = rewrite.explain(fn, *args, mapping=1, users=(0,))
  assert report.count("at_users") and report.count("split_dense"), str(report)


def test_the_reference_models_standard_build():
  config = RankerConfig(num_items=100, max_history=12)
  model = Ranker(config, rngs=nnx.Rngs(0))
  requests = ClickGenerator(config, seed=0, mean_candidates=3, max_candidates=8).requests(4)
  batch = pack_requests(requests, config, num_users=4, num_candidates=24)
  graphdef, state = nnx.split(model)

  def standard(state, user_dense, history, history_len, ids, cand_items, cand_dense):
    b = RankingBatch(user_dense, history, history_len, ids, cand_items, cand_dense,
                     jnp.zeros(ids.shape, jnp.float32))
    return nnx.merge(graphdef, state).standard(b)

  args = (state, batch.user_dense, batch.history, batch.history_len, batch.cand_to_user,
          batch.cand_items, batch.cand_dense)
  where = dict(mapping=4, users=(1, 2, 3), candidates=(5, 6))
  fast = rewrite.rewrite(standard, **where)
  mask = np.asarray(batch.candidate_mask())
  np.testing.assert_allclose(np.asarray(jax.jit(fast)(*args))[mask],
                             np.asarray(standard(*args))[mask], rtol=1e-4, atol=1e-4)
  report = rewrite.explain(standard, *args, **where)
  assert report.count("linear_compression") == 1, str(report)
  assert report.count("target_attention") == 1 and not report.count("materialized"), str(report)


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match=r"mapping=0 is also selected by users=\(0,\)"):
    rewrite.rewrite(lambda a: a, mapping=0, users=(0,))
  fast = rewrite.rewrite(lambda a, ids: a, mapping=1)
  with pytest.raises(TypeError, match=r"must be an int\[B\] array, got float32"):
    fast(jnp.ones(3), jnp.ones(3))


def test_a_select_on_the_mapping_is_a_new_index_gathered_with_as_written():
  def model(user, ids, cand):
    other = jnp.where(ids % 2 == 0, ids, ids + 1)  # not the mapping: ids + 1 for odd ids
    return jnp.tanh(user[jnp.clip(other, 0, U - 1)]) * cand
  args = (_normal(0, U, 4), IDS, _normal(1, B, 4))
  report = _check(model, args, users=(0,), expect=["at_users"])
  assert report.count("broadcast") == 1


def test_nnx_multi_head_attention_through_the_attention_fn_hook():
  make = lambda fn: nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False,
                                           attention_fn=fn, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(make(rewrite.flax_attention_fn))
  plain = nnx.merge(*nnx.split(make(nnx.dot_product_attention)))
  fn = lambda seq, ids, cand, state: nnx.merge(graphdef, state)(cand, seq[ids])  # DIN: candidates query
  args = (_normal(0, U, 12, 8), IDS, _normal(1, B, 3, 8), state)
  np.testing.assert_allclose(fn(*args), plain(args[2], args[0][IDS]), rtol=1e-4, atol=1e-5)
  fast = rewrite.rewrite(fn, mapping=1, users=(0,), candidates=(2,))
  np.testing.assert_allclose(fast(*args), fn(*args), rtol=1e-4, atol=1e-5)
  grad = lambda f: jax.grad(lambda s: jnp.sum(f(*args[:3], s) ** 2))(state)
  for g, w in zip(jax.tree.leaves(grad(fast)), jax.tree.leaves(grad(fn))):
    np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4)
  report = rewrite.explain(fn, *args, mapping=1, users=(0,), candidates=(2,))
  assert report.count("target_attention") == 1 and not report.count("materialized"), str(report)


def test_explain_lists_every_op_moved_to_the_users_with_its_line():
  def model(user, ids, cand):
    return jnp.tanh(user[ids] * 2.0) @ cand

  text = str(rewrite.explain(model, jnp.ones((3, 4)), jnp.array([0, 1, 2, 1]), jnp.ones((4, 5)),
                             mapping=1, users=0))
  moved = [line for line in text.splitlines() if line.strip().startswith("at_users")]
  assert {line.split()[1] for line in moved} == {"mul", "tanh", "dot_general"}, text
  assert all("test_rewrite.py" in line for line in moved), text
