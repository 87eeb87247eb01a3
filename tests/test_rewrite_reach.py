"""The programs people write: each pattern rewrites (equal outputs and gradients, work at U),
or runs as written with the reason in the report where rewriting it would not be the same
computation."""

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from ikbo_jax.testing.rewrite_check import check_rewrite

U, B, RATIO = 3, 9, 3
IDS = jnp.array([2, 0, 1, 2, 2, 0, 1, 1, 0], jnp.int32)


def _normal(seed, *shape):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _materialized_at(report) -> list[str]:
  return [c.primitive for c in report.materialized]


@pytest.mark.parametrize("spelling", ["repeat", "broadcast_to"])
def test_a_uniform_ratio_without_a_mapping(spelling):
  def model(user, ids, cand, w):
    del ids
    if spelling == "repeat":
      rows = jnp.repeat(user, RATIO, axis=0)
    else:
      rows = jnp.broadcast_to(user[:, None], (U, RATIO, user.shape[1])).reshape(B, -1)
    return jax.nn.relu(rows @ w) * cand
  args = (_normal(0, U, 8), IDS, _normal(1, B, 5), _normal(2, 8, 5))
  report = check_rewrite(model, args, mapping=1, users=0)
  assert report.flops_saved > 0 and _materialized_at(report) == ["mul"], str(report)


def test_repeat_by_per_user_counts_is_a_broadcast():
  """`jnp.repeat`'s index fills out of range; its rows past the counts' total are NaN rows."""
  def model(user, counts, cand, w):
    return jnp.tanh(jnp.repeat(user, counts, axis=0, total_repeat_length=B) @ w) * cand
  args = (_normal(0, U, 8), jnp.array([4, 0, 5], jnp.int32), _normal(1, B, 5), _normal(2, 8, 5))
  report = check_rewrite(model, args, mapping=1, users=0)
  assert report.count("broadcast") == 1 and report.count("at_users") >= 1, str(report)


def test_squeeze_and_astype_after_a_broadcast():
  def model(user, ids, cand, w):
    rows = jnp.squeeze(user[ids][:, None, :], axis=1).astype(jnp.bfloat16)
    return (rows @ w.astype(jnp.bfloat16)).astype(jnp.float32) * cand
  args = (_normal(0, U, 8), IDS, _normal(1, B, 5), _normal(2, 8, 5))
  report = check_rewrite(model, args, mapping=1, users=0, rtol=2**-7, atol=2**-7)
  assert _materialized_at(report) == ["mul"], str(report)


@pytest.mark.parametrize("spelling", ["matmul", "einsum"])
def test_a_dlrm_pairwise_interaction_computes_the_user_block_at_users(spelling):
  def model(user_a, ids, user_b, cand_a, cand_b, w):
    x = jnp.stack([user_a[ids], user_b[ids], cand_a, cand_b], axis=1)  # [B, 4, F]
    if spelling == "matmul":
      z = x @ jnp.transpose(x, (0, 2, 1))
    else:  # one product of the stack with itself: the cross block is computed once
      z = jnp.einsum("bif,bjf->bij", x, x)
    rows, cols = jnp.triu_indices(4, 1)
    return jax.nn.relu(z[:, rows, cols] @ w)
  args = (_normal(0, U, 8), IDS, _normal(1, U, 8), _normal(2, B, 8), _normal(3, B, 8),
          _normal(4, 6, 5))
  report = check_rewrite(model, args, mapping=1, users=(0, 2), rtol=1e-5)
  assert report.count("block_product") == 1 and not report.materialized, str(report)


def test_a_value_used_at_users_and_broadcast():
  def model(user, ids, cand, w):
    hidden = jnp.tanh(user @ w)  # at U
    return hidden[ids] * cand + jnp.mean(hidden, axis=0), jnp.sum(hidden, axis=1)
  args = (_normal(0, U, 8), IDS, _normal(1, B, 5), _normal(2, 8, 5))
  check_rewrite(model, args, mapping=1, users=0)


def test_checkpointed_and_conditional_user_towers_are_entered():
  def model(user, ids, cand, w, gate):
    tower = jax.checkpoint(lambda x: jax.nn.relu(x @ w))(user[ids])
    tower = jax.lax.cond(gate > 0, jnp.tanh, jnp.sin, tower)
    return tower * cand
  for gate in (1.0, -1.0):
    args = (_normal(0, U, 8), IDS, _normal(1, B, 5), _normal(2, 8, 5), jnp.float32(gate))
    report = check_rewrite(model, args, mapping=1, users=0)
    assert report.count("entered") == 3 and _materialized_at(report) == ["mul"], str(report)


def test_nnx_remat_of_a_user_tower():
  class Tower(nnx.Module):
    def __init__(self, rngs):
      self.dense = nnx.Linear(8, 5, rngs=rngs)

    def __call__(self, user, ids, cand):
      return nnx.remat(lambda m, x: nnx.relu(m(x)))(self.dense, user[ids]) * cand

  graphdef, state = nnx.split(Tower(nnx.Rngs(0)))
  fn = lambda user, ids, cand, state: nnx.merge(graphdef, state)(user, ids, cand)
  args = (_normal(0, U, 8), IDS, _normal(1, B, 5), state)
  report = check_rewrite(fn, args, mapping=1, users=0)
  assert report.count("at_users") >= 2, str(report)


def test_a_one_hot_product_is_not_a_broadcast():
  # one_hot(ids) @ user rounds user rows at the matmul's precision, turns 0 * inf into NaN
  # and gives zero rows for out-of-range ids: not the same computation as a gather.
  def model(user, ids, cand):
    return (jax.nn.one_hot(ids, U) @ user) * cand
  args = (_normal(0, U, 5), IDS, _normal(1, B, 5))
  report = check_rewrite(model, args, mapping=1, users=0)
  assert not report.count("broadcast"), str(report)


def test_jax_nn_attention_and_flax_attention_without_the_hook_run_as_written():
  def model(seq, ids, cand):
    k = seq[ids]
    return jax.nn.dot_product_attention(cand, k, k) + nnx.dot_product_attention(cand, k, k)
  args = (_normal(0, U, 6, 2, 4), IDS, _normal(1, B, 2, 2, 4))
  report = check_rewrite(model, args, mapping=1, users=0, rtol=1e-5)
  assert report.materialized and not report.count("target_attention"), str(report)


def test_checkpoint_name_inside_a_checkpoint_body_keeps_the_rows_at_users():
  """`checkpoint_name` on user rows names the rows at U; the remat policy still applies."""
  from jax.ad_checkpoint import checkpoint_name

  @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.save_only_these_names("h"))
  def tower(rows, w):
    return jnp.tanh(checkpoint_name(jax.nn.relu(rows @ w), "h") @ w.T)

  def model(user, ids, cand, w):
    return tower(user[ids], w) @ w * cand
  args = (_normal(0, U, 8), IDS, _normal(1, B, 5), _normal(2, 8, 5))
  report = check_rewrite(model, args, mapping=1, users=0)
  assert report.count("at_users") >= 3 and _materialized_at(report) == ["mul"], str(report)


def test_take_along_axis_of_user_rows_by_the_mapping():
  def model(user, ids, cand, w):
    return jnp.tanh(jnp.take_along_axis(user, ids[:, None], axis=0) @ w) * cand
  args = (_normal(0, U, 8), IDS.at[2].set(U + 1), _normal(1, B, 5), _normal(2, 8, 5))
  report = check_rewrite(model, args, mapping=1, users=0)
  assert report.count("broadcast") == 1 and _materialized_at(report) == ["mul"], str(report)


@pytest.mark.parametrize("keepdims", [False, True])
def test_vmap_of_dynamic_index_in_dim_is_a_broadcast(keepdims):
  """A per-candidate lookup of its user's row, written with `vmap`."""
  def model(user, ids, cand, w):
    rows = jax.vmap(lambda i: jax.lax.dynamic_index_in_dim(user, i, keepdims=keepdims))(ids)
    return jnp.tanh(rows.reshape(ids.shape[0], -1) @ w) * cand
  args = (_normal(0, U, 8), IDS.at[3].set(U + 2).at[4].set(-1), _normal(1, B, 5),
          _normal(2, 8, 5))
  report = check_rewrite(model, args, mapping=1, users=0)
  assert report.count("broadcast") == 1 and _materialized_at(report) == ["mul"], str(report)


@pytest.mark.parametrize("fn", ["softmax", "log_softmax", "logsumexp", "stop_gradient"])
def test_the_softmax_family_of_user_rows_runs_at_users(fn):
  """MMoE's per-user gates: `jax.nn.softmax` and its kin call `stop_gradient` on the row
  maximum; it is row-wise (the identity forward, a zero tangent) and runs at U as well."""
  apply = {"softmax": jax.nn.softmax, "log_softmax": jax.nn.log_softmax,
           "logsumexp": lambda x: jax.nn.logsumexp(x, axis=-1, keepdims=True),
           "stop_gradient": lambda x: jax.lax.stop_gradient(x) * x}[fn]

  def model(user, ids, cand, w_gate, experts):
    gates = apply(user[ids] @ w_gate)  # [B, E]: one gate vector per user, broadcast
    return jnp.einsum("be,bf,efk->bk", gates, cand, experts)
  args = (_normal(0, U, 8), IDS, _normal(1, B, 5), _normal(2, 8, 4), _normal(3, 4, 5, 3))
  report = check_rewrite(model, args, mapping=1, users=0)
  assert report.count("at_users") >= 1 and "stop_gradient" not in _materialized_at(report), (
      str(report))
  assert _materialized_at(report) in ([], ["dot_general"], ["mul"]), str(report)


def test_film_parameters_split_from_user_rows_stay_at_users():
  """FiLM: one user projection split into a scale and a shift with `jnp.split`."""
  def model(user, ids, cand, w_film):
    scale, shift = jnp.split(user[ids] @ w_film, 2, axis=1)
    return jax.nn.relu(cand * (1 + scale) + shift)
  args = (_normal(0, U, 8), IDS, _normal(1, B, 5), _normal(2, 8, 10))
  report = check_rewrite(model, args, mapping=1, users=0)
  assert report.count("at_users") >= 2 and "split" not in _materialized_at(report), str(report)


def test_a_factorization_machine_over_stacked_fields_sums_user_fields_at_users():
  """FM: `0.5 * (sum(v)^2 - sum(v^2))` across stacked user and candidate fields."""
  def model(user_fields, ids, cand_fields):
    stack = jnp.concatenate([user_fields[ids], cand_fields], axis=1)  # [B, 5, D]
    total = jnp.sum(stack, axis=1)
    return 0.5 * jnp.sum(total * total - jnp.sum(jnp.square(stack), axis=1), axis=-1)
  args = (_normal(0, U, 3, 4), IDS, _normal(1, B, 2, 4))
  report = check_rewrite(model, args, mapping=1, users=0)
  moved = [c.primitive for c in report.changes if c.kind == "at_users"]
  assert {"square", "reduce_sum"} <= set(moved), str(report)
  assert "concatenate" not in _materialized_at(report), str(report)


def test_field_weights_and_a_squeeze_and_a_max_across_stacked_fields():
  """FiBiNET's squeeze of field-weighted stacks (at U), and a max over fields stacked last
  (as written)."""
  def model(user, ids, cand, w_fields, w_squeeze):
    stack = jnp.stack([user[ids], jnp.tanh(user)[ids], cand], axis=1)  # [B, 3, D]
    weighted = stack * w_fields[None, :, None]
    squeezed = jnp.mean(weighted, axis=-1) @ w_squeeze  # [B, 3] -> [B, D]
    last = jnp.stack([user[ids], cand], axis=-1)  # [B, D, 2]
    return squeezed + jnp.max(last, axis=-1) + jnp.sum(weighted, axis=1)
  args = (_normal(0, U, 4), IDS, _normal(1, B, 4), _normal(2, 3), _normal(3, 3, 4))
  report = check_rewrite(model, args, mapping=1, users=0)
  moved = [c.primitive for c in report.changes if c.kind == "at_users"]
  assert {"mul", "reduce_sum"} <= set(moved), str(report)
  # A max across fields: where fields tie, its derivative is shared among every tied field.
  assert "reduce_max" in _materialized_at(report), str(report)


def test_a_max_across_tied_fields_keeps_the_shared_derivative():
  """Ties between a user field and a candidate field: each gets its share of the gradient."""
  def model(user, ids, cand):
    return jnp.max(jnp.stack([user[ids], cand, user[ids]], axis=1), axis=1)
  user = _normal(0, U, 4)
  args = (user, IDS, user[IDS])  # every field ties
  check_rewrite(model, args, mapping=1, users=0)


def test_autoint_field_attention_projects_user_fields_at_users():
  """AutoInt: per-field query, key and value projections of the stacked fields, attention
  across fields; the user fields' projections and their query-key block run at U."""
  def model(user_fields, ids, cand_fields, wq, wk, wv):
    stack = jnp.concatenate([user_fields[ids], cand_fields], axis=1)  # [B, 5, D]
    q, k, v = stack @ wq, stack @ wk, stack @ wv
    attention = jax.nn.softmax(jnp.einsum("bfd,bgd->bfg", q, k), axis=-1)
    return jax.nn.relu(jnp.einsum("bfg,bgd->bfd", attention, v) + stack).sum(axis=1)
  args = (_normal(0, U, 3, 4), IDS, _normal(1, B, 2, 4), _normal(2, 4, 4), _normal(3, 4, 4),
          _normal(4, 4, 4))
  report = check_rewrite(model, args, mapping=1, users=0)
  moved = [c.primitive for c in report.changes if c.kind == "at_users"]
  assert moved.count("dot_general") >= 3 and report.count("block_product") == 1, str(report)


@pytest.mark.parametrize("mode", ["fill", "clip", "promise_in_bounds"])
def test_take_along_axis_with_an_index_as_wide_as_the_rows_is_a_broadcast(mode):
  """`take_along_axis(user, broadcast_to(ids[:, None], (B, F)), axis=0)`, out-of-range ids too."""
  ids = IDS.at[-1].set(U).at[-2].set(-1)

  def model(user, ids, cand, w):
    wide = jnp.broadcast_to(ids[:, None], (ids.shape[0], user.shape[1]))
    rows = jnp.take_along_axis(user, wide, axis=0, mode=mode)
    return jnp.tanh(rows @ w) * cand
  args = (_normal(0, U, 8), ids, _normal(1, B, 5), _normal(2, 8, 5))
  report = check_rewrite(model, args, mapping=1, users=0)
  assert report.count("broadcast") == 1 and report.count("at_users") >= 2, str(report)


def test_two_take_along_axis_gathers_by_one_wide_index_are_one_broadcast():
  """Both gathers by the same wide index read the same rows: their product runs at U."""
  def model(user_a, ids, user_b, cand):
    wide = jnp.broadcast_to(ids[:, None], (ids.shape[0], user_a.shape[1]))
    rows_a = jnp.take_along_axis(user_a, wide, axis=0)
    rows_b = jnp.take_along_axis(user_b, wide, axis=0)
    return jnp.tanh(rows_a * rows_b) * cand
  args = (_normal(0, U, 4), IDS.at[-1].set(U), _normal(1, U, 4), _normal(2, B, 4))
  report = check_rewrite(model, args, mapping=1, users=(0, 2))
  moved = [c.primitive for c in report.changes if c.kind == "at_users"]
  assert "mul" in moved and "tanh" in moved, str(report)
