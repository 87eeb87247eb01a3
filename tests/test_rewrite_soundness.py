"""Regression tests for the rewrite's soundness defects: each failed before its fix.

Custom derivative rules dropped (a straight-through estimator, a gradient
clipper, relu at exactly zero), index arithmetic taken for the identity
(a clamp of the mapping below U - 1), crashes instead of leaving code alone
(grouped-query attention, the mapping inside a pytree, a failing rule) and
forward-mode autodiff's error.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ikbo_jax import rewrite
from ikbo_jax.rewrite import interpreter
from ikbo_jax.testing.programs import clip_gradient, straight_through
from ikbo_jax.testing.rewrite_check import check_rewrite, outputs_and_gradients

U, B = 3, 10
IDS = jnp.array([2, 0, 1, 2, 2, 0, 1, 1, 0, 2], jnp.int32)


def _normal(seed, *shape):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _only_the_candidate_product(report) -> bool:
  """The one broadcast made real is the one multiplied by candidate values, as it must be."""
  return [c.primitive for c in report.materialized] == ["mul"]


def test_a_straight_through_estimator_keeps_its_gradient_at_users():
  def model(user, ids, cand, w):
    return straight_through(user[ids] @ w) * cand
  args = (_normal(0, U, 8), IDS, _normal(1, B, 5), _normal(2, 8, 5))
  report = check_rewrite(model, args, mapping=1, users=0)
  assert report.count("entered") == 1 and _only_the_candidate_product(report), str(report)
  _, (d_user, *_) = outputs_and_gradients(rewrite.rewrite(model, mapping=1, users=0), args)
  assert np.abs(d_user).max() > 0  # the primal's round would give zero


def test_a_custom_vjp_gradient_clipper_runs_as_written():
  def model(user, ids, cand, w):
    return clip_gradient(user[ids] @ w) * cand
  args = (_normal(0, U, 8), IDS, _normal(1, B, 5), _normal(2, 8, 5))
  report = check_rewrite(model, args, mapping=1, users=0)
  (why,) = report.materialized
  unclipped = lambda u, i, c, w: (u[i] @ w) * c
  _, clipped_grads = outputs_and_gradients(rewrite.rewrite(model, mapping=1, users=0), args)
  _, plain_grads = outputs_and_gradients(unclipped, args)
  assert np.abs(clipped_grads[0] - plain_grads[0]).max() > 0.1  # the clip is in force
  assert why.primitive == "custom_vjp_call" and "cotangents at B" in why.reason


def test_relu_at_exactly_zero_keeps_jaxs_derivative():
  # Cold-start users: all-zero features and zero biases put whole rows at exactly zero.
  def model(user, ids, cand, w, b, w2):
    return jnp.sum(jax.nn.relu(user[ids] @ w + b) @ w2 * cand, axis=-1)
  user = _normal(0, U, 8).at[1].set(0.0)
  args = (user, IDS, _normal(1, B, 5), _normal(2, 8, 6), jnp.zeros(6), _normal(3, 6, 5))
  report = check_rewrite(model, args, mapping=1, users=0)
  assert report.count("entered") == 1 and _only_the_candidate_product(report), str(report)


@pytest.mark.parametrize("n_valid", [2, 3])
def test_a_clamp_of_the_mapping_is_gathered_with_as_written(n_valid):
  def model(user, ids, cand):
    return jnp.tanh(user[jnp.minimum(ids, n_valid - 1)]) * cand  # padding onto the last user
  args = (_normal(0, U, 4), IDS, _normal(1, B, 4))
  check_rewrite(model, args, mapping=1, users=0)


def test_a_traced_clamp_of_the_mapping():
  def model(user, ids, cand, n_valid):
    return jnp.tanh(user[jnp.maximum(jnp.minimum(ids, n_valid - 1), 0)]) * cand
  args = (_normal(0, U, 4), IDS, _normal(1, B, 4), jnp.int32(2))
  check_rewrite(model, args, mapping=1, users=0)


def test_negative_ids_wrap_and_clipped_ids_clamp_as_in_the_original():
  def model(user, ids, cand, w):
    wrapped = jax.nn.gelu(user[ids] @ w)  # numpy indexing: -1 is the last user
    clipped = jnp.take(user, ids * 3 - 2, axis=0, mode="clip") @ w  # far out of range
    return (wrapped + clipped) * cand
  ids = IDS.at[0].set(-1).at[1].set(-3).at[2].set(-2)
  args = (_normal(0, U, 8), ids, _normal(1, B, 5), _normal(2, 8, 5))
  check_rewrite(model, args, mapping=1, users=0)


def test_grouped_query_attention_through_the_marker():
  def model(seq_k, seq_v, ids, cand, lengths):  # 4 query heads over 2 key/value heads
    return rewrite.attention(cand, seq_k[ids], seq_v[ids], lengths[ids])
  args = (_normal(0, U, 12, 2, 8), _normal(1, U, 12, 2, 8), IDS, _normal(2, B, 3, 4, 8),
          jnp.array([12, 0, 5], jnp.int32))
  report = check_rewrite(model, args, mapping=2, users=(0, 1, 4), rtol=1e-4, atol=1e-5)
  assert report.count("target_attention") == 1, str(report)


def test_keys_past_a_length_get_no_gradient_even_from_a_nan_cotangent():
  """Keys past a user's length hold Inf and one candidate's output cotangent is NaN.

  A key past the length is never read: its gradient is zero in the original as in the
  IKBO kernel (before, the original's `0 * NaN` made it NaN and the rewrite's did not).
  """
  def model(seq, ids, cand, lengths):
    out = rewrite.attention(cand, seq[ids], seq[ids] * 0.5, lengths[ids])
    return out * jnp.log(jnp.abs(cand[:, :1, :1, :1]))  # candidate 1's query is zero: log 0
  lengths = jnp.array([12, 3, 5], jnp.int32)
  seq = _normal(0, U, 12, 2, 8)
  seq = jnp.where(jnp.arange(12)[None, :, None, None] < lengths[:, None, None, None], seq,
                  jnp.inf)
  args = (seq, IDS, _normal(2, B, 3, 2, 8).at[1].set(0.0), lengths)
  report = check_rewrite(model, args, mapping=1, users=(0, 3), rtol=1e-4, atol=1e-5)
  assert report.count("target_attention") == 1, str(report)
  d_seq = jax.grad(lambda s: jnp.sum(jnp.sin(model(s, *args[1:]))))(seq)
  past = np.arange(12)[None, :] >= np.asarray(lengths)[:, None]
  np.testing.assert_array_equal(np.asarray(d_seq)[past], 0.0)


@dataclasses.dataclass
class Batch:
  user: jax.Array
  cand_to_user: jax.Array
  cand: jax.Array


jax.tree_util.register_dataclass(Batch, data_fields=["user", "cand_to_user", "cand"],
                                 meta_fields=[])


@pytest.mark.parametrize("container", ["dict", "dataclass"])
def test_the_mapping_inside_a_pytree_named_by_path(container):
  def model(params, batch):
    get = (lambda k: batch[k]) if isinstance(batch, dict) else (lambda k: getattr(batch, k))
    x = jnp.concatenate([jnp.tanh(get("user")[get("cand_to_user")]), get("cand")], axis=1)
    return x @ params["w"]
  fields = dict(user=_normal(0, U, 8), cand_to_user=IDS, cand=_normal(1, B, 4))
  batch = fields if container == "dict" else Batch(**fields)
  args = ({"w": _normal(2, 12, 3)}, batch)
  report = check_rewrite(model, args, mapping="batch.cand_to_user", users="batch.user",
                         candidates="batch.cand")
  assert report.count("split_dense") == 1 and not report.materialized, str(report)
  by_predicate = rewrite.explain(model, *args, mapping=lambda path, x: path.endswith("to_user"),
                                 users=lambda path, x: path.endswith(".user"))
  assert by_predicate.count("split_dense") == 1


def test_nnx_state_and_the_batch_in_one_call():
  class Tower(nnx.Module):
    def __init__(self, rngs):
      self.user = nnx.Linear(8, 6, rngs=rngs)

    def __call__(self, batch):
      return nnx.relu(self.user(batch["user"][batch["ids"]])) * batch["cand"]

  graphdef, state = nnx.split(Tower(nnx.Rngs(0)))
  fn = lambda state, batch: nnx.merge(graphdef, state)(batch)
  batch = {"user": _normal(0, U, 8), "ids": IDS, "cand": _normal(1, B, 6)}
  report = check_rewrite(fn, (state, batch), mapping="batch.ids", users="batch.user")
  assert report.count("at_users") >= 2 and _only_the_candidate_product(report), str(report)


def test_selectors_that_do_not_name_one_mapping_are_refused():
  fn = rewrite.rewrite(lambda batch: batch["user"], mapping="batch.missing", users="batch.user")
  with pytest.raises(ValueError, match=r"mapping='batch.missing' must select one array .* 0"):
    fn({"user": jnp.ones((U, 2)), "ids": IDS})
  fn = rewrite.rewrite(lambda batch: batch["user"], mapping="batch", users=())
  with pytest.raises(ValueError, match="selects 2"):
    fn({"user": jnp.ones((U, 2)), "ids": IDS})
  with pytest.raises(TypeError, match="users must be selectors"):
    rewrite.rewrite(lambda x: x, mapping=0, users=[1.5])


def test_a_failing_rule_falls_back_and_says_why(monkeypatch):
  def broken(rw, eqn, operands):
    raise RuntimeError("deliberately broken")
  monkeypatch.setitem(interpreter._RULES, jax.lax.tanh_p, broken)

  def model(user, ids, cand):
    return jnp.tanh(user[ids]) * cand
  report = check_rewrite(model, (_normal(0, U, 4), IDS, _normal(1, B, 4)), mapping=1, users=0)
  (why,) = report.materialized
  assert why.primitive == "tanh" and "tanh rule failed (RuntimeError" in why.reason


def _lce_model(e_user, ids, e_cand, w):
  return jnp.einsum("mk,bkn->bmn", w, jnp.concatenate([e_user[ids], e_cand], axis=1))


def test_forward_mode_of_a_rewrite_runs_the_ikbo_op_as_written():
  args = (_normal(0, U, 6, 5), IDS, _normal(1, B, 7, 5), _normal(2, 9, 13))
  report = rewrite.Report()
  fast = rewrite.rewrite(_lce_model, mapping=1, users=0, report=report)
  tangent = (jnp.ones_like(args[3]),)
  got = jax.jvp(lambda w: fast(*args[:3], w), args[3:], tangent)
  want = jax.jvp(lambda w: _lce_model(*args[:3], w), args[3:], tangent)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
  (why,) = report.materialized
  assert "forward-mode" in why.reason


def test_forward_mode_through_an_ikbo_op_names_the_op():
  from ikbo_jax import CandidateIndex, linear_compression
  index = CandidateIndex.from_mapping(IDS, U)
  e_user, e_cand, w_user, w_cand = (_normal(0, U, 6, 5), _normal(1, B, 7, 5), _normal(2, 9, 6),
                                    _normal(3, 9, 7))
  f = lambda w: linear_compression(w, w_cand, e_user, e_cand, index)
  with pytest.raises(TypeError, match="ikbo_jax.linear_compression has reverse-mode derivatives "
                     "only.*Use jax.grad"):
    jax.jvp(f, (w_user,), (w_user,))
  jax.grad(lambda w: jnp.sum(f(w)))(w_user)  # reverse mode is unaffected


def test_forward_mode_through_moved_work_is_exact():
  def model(user, ids, cand, w):
    return jax.nn.relu(user[ids] @ w) * cand
  args = (_normal(0, U, 8), IDS, _normal(1, B, 5), _normal(2, 8, 5))
  fast = rewrite.rewrite(model, mapping=1, users=0)
  tangent = (jnp.ones_like(args[0]),)
  got = jax.jvp(lambda u: fast(u, *args[1:]), args[:1], tangent)
  want = jax.jvp(lambda u: model(u, *args[1:]), args[:1], tangent)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


# Defect: work moved to batch U also ran on the rows of users without candidates,
# which the original never computes. A non-finite value or derivative there put NaN
# into the weights' gradients through a zero cotangent (L2 norm of a zero row, log
# of a zero count, a lookup of a padding user's sentinel ids, a NaN input row).
# Those rows are now copies of rows some candidate reads.
_UNUSED = jnp.array([0, 2, 0, 2, 2, 0, 3, 3, 0, 2], jnp.int32)  # users 1 and 4 have none


def _norm_tower(user, ids, cand, w):
  rows = user[ids]
  return jnp.sum((rows / jnp.linalg.norm(rows, axis=-1, keepdims=True)) @ w * cand)


def _log_count(user, ids, cand, w):
  return jnp.sum(jnp.log(user[ids][:, :1]) * (cand @ w.T)[:, :1])


def _sentinel_lookup(hist, ids, cand, table, w):
  pooled = jnp.mean(jnp.take(table, hist[ids], axis=0), axis=1)  # fill mode: sentinel is NaN
  return jnp.sum(jnp.tanh(pooled @ w) * cand)


@jax.custom_jvp
def _root(x):
  return jnp.sqrt(x)


_root.defjvp(lambda x, dx: (_root(x[0]), dx[0] / (2 * jnp.sqrt(x[0]))))  # inf at 0


def _custom_rule_tower(user, ids, cand, w):
  return jnp.sum(_root(user[ids]) @ w * cand)


_PROGRAMS = dict(norm_tower=_norm_tower, log_count=_log_count, nan_row=_norm_tower,
                 custom_rule=_custom_rule_tower)


@pytest.mark.parametrize("program", [*_PROGRAMS, "sentinel_lookup"])
def test_rows_of_users_without_candidates_stay_out_of_every_gradient(program):
  user = jnp.abs(_normal(0, 5, 8)) + 0.5
  user = user.at[1].set(0.0).at[4].set(jnp.nan if program == "nan_row" else 0.0)
  cand, w = _normal(1, B, 5), _normal(2, 8, 5)
  if program == "sentinel_lookup":
    hist = jax.random.randint(jax.random.key(3), (5, 4), 0, 6).at[1].set(6).at[4].set(6)
    model, args = _sentinel_lookup, (hist, _UNUSED, cand, _normal(4, 6, 5), _normal(5, 5, 5))
  else:
    model, args = _PROGRAMS[program], (user, _UNUSED, cand, w)
  out, grads = outputs_and_gradients(model, args)
  assert np.isfinite(out) and all(np.isfinite(g).all() for g in grads)  # the original's
  report = check_rewrite(model, args, mapping=1, users=0)
  assert report.count("at_users") >= 1, str(report)


# Slowness: the rows above were once replaced before the work at U ran (a scatter
# marking the rows read, then a gather), in every call, differentiated or not;
# on small programs that cost more than the work moved to U saved. The
# replacement now happens only where the work is differentiated.
def test_exactness_on_unread_rows_costs_the_forward_nothing():
  args = (_normal(0, 5, 8), _UNUSED, _normal(1, B, 5), _normal(2, 8, 5))
  fast = rewrite.rewrite(_norm_tower, mapping=1, users=0)
  assert "scatter" not in jax.jit(fast).lower(*args).compile().as_text()


# Defect: with ids past U in `user[ids]`, the forward agreed (a clamped read) but the
# rewrite added those candidates' cotangents to row U - 1, where JAX's gather drops
# them. Out-of-range candidates now read a copy of the clamped row whose gradient
# is stopped.
@pytest.mark.parametrize("spelling", ["index", "promise", "take_clip", "take_fill"])
def test_out_of_range_ids_get_exactly_jaxs_gradient(spelling):
  gather = {"index": lambda u, i: u[i],
            "promise": lambda u, i: u.at[i].get(mode="promise_in_bounds"),
            "take_clip": lambda u, i: jnp.take(u, i, axis=0, mode="clip"),
            "take_fill": lambda u, i: jnp.take(u, i, axis=0)}[spelling]

  def model(user, ids, cand, w):
    return jax.nn.relu(gather(user, ids) @ w) * cand
  ids = IDS.at[1].set(U).at[4].set(U + 7).at[6].set(-U - 2)
  args = (_normal(0, U, 8), ids, _normal(1, B, 5), _normal(2, 8, 5))
  report = check_rewrite(model, args, mapping=1, users=0)
  assert report.count("broadcast") == 1 and report.count("at_users") >= 1, str(report)


def test_the_old_keyword_names_still_work_and_warn():
  def model(user, ids, cand, w):
    return jax.nn.relu(user[ids] @ w) * cand
  args = (_normal(0, U, 8), IDS, _normal(1, B, 5), _normal(2, 8, 5))
  with pytest.warns(DeprecationWarning, match="use mapping="):
    fast = rewrite.rewrite(model, mapping_argnum=1, user_argnums=(0,), candidate_argnums=(2,))
  np.testing.assert_allclose(fast(*args), model(*args), rtol=1e-6)
  with pytest.warns(DeprecationWarning, match="use users="):
    assert rewrite.explain(model, *args, mapping=1, user_argnums=(0,)).count("at_users")
  with pytest.raises(TypeError, match="both mapping_argnum= and its new name mapping="):
    rewrite.rewrite(model, mapping=1, mapping_argnum=1)
  with pytest.raises(TypeError, match="unexpected keyword argument 'user_argnum'"):
    rewrite.rewrite(model, mapping=1, user_argnum=0)


@pytest.mark.parametrize("row", ["nan", "zero_length"])
@pytest.mark.parametrize("queries", ["candidates", "users_too"])
def test_attention_over_rows_of_users_without_candidates_keeps_gradients_finite(queries, row):
  def model(seq, ids, cand, wq, wk, wv, lengths):
    heads = lambda x: x.reshape(*x.shape[:-1], 2, 4)
    k, v = heads(seq[ids] @ wk), heads(seq[ids] @ wv)
    target = rewrite.attention(heads(cand @ wq), k, v, lengths[ids])
    if queries == "candidates":
      return target
    encoded = rewrite.attention(heads(seq[ids] @ wq), k, v, lengths[ids], causal=True)
    return target + jnp.sum(encoded, axis=1, keepdims=True)
  seq = _normal(0, 5, 6, 8)
  seq = seq.at[1].set(jnp.nan) if row == "nan" else seq.at[1].set(0.0)
  lengths = jnp.array([6, 0 if row == "zero_length" else 6, 3, 1, 0], jnp.int32)
  args = (seq, _UNUSED, _normal(1, B, 2, 8), *(_normal(k, 8, 8) for k in (2, 3, 4)), lengths)
  report = check_rewrite(model, args, mapping=1, users=(0, 6), rtol=1e-4, atol=1e-5)
  assert report.count("target_attention") == 1, str(report)
