"""The rewrite inside `lax.scan`: carried broadcasts stay at U where the body keeps their form.

Each program: the rewritten function equals the original (outputs and every gradient), and
the report and the rewritten program say what ran at U.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core

from ikbo_jax import rewrite
from ikbo_jax.testing.rewrite_check import check_rewrite

U, B, F = 3, 10, 6
IDS = jnp.array([2, 0, 1, 2, 2, 0, 1, 1, 0, 2], jnp.int32)


def _normal(seed, *shape):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _tower(user, ids, cand, layers):
  """A user tower of stacked layers, broadcast first and then scanned: the usual way to write it."""
  def layer(h, w):
    h = jnp.tanh(h @ w)
    return h, jnp.sum(h, axis=-1)
  h, sums = jax.lax.scan(layer, user[ids], layers)
  return jnp.sum(h * cand, axis=-1) + jnp.sum(sums, axis=0)


def _scan_products(fn, args):
  """The row counts of the products inside the rewritten program's scan body."""
  jaxpr = jax.make_jaxpr(rewrite.rewrite(fn, mapping=1, users=(0,)))(*args).jaxpr
  found = []

  def visit(jaxpr, inside):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general" and inside:
        found.append(eqn.invars[0].aval.shape[0])
      for sub in jax_core.jaxprs_in_params(eqn.params):
        visit(sub, inside or eqn.primitive.name == "scan")

  visit(jaxpr, False)
  return found


def test_a_carried_user_tower_runs_at_users():
  args = (_normal(0, U, F), IDS, _normal(1, B, F), 0.4 * _normal(2, 4, F, F))
  report = check_rewrite(_tower, args, mapping=1, users=(0,))
  entered = [c for c in report.changes if c.kind == "entered"]
  assert [(c.primitive, c.reason) for c in entered] == [("scan", "")]
  # The original's body multiplies B rows; the user rows carry up to two extra rows (what
  # out-of-range ids read).
  assert [rows - U in (0, 1, 2) for rows in _scan_products(_tower, args)] == [True]


def test_a_carry_that_becomes_candidate_level_is_made_ordinary():
  def model(user, ids, cand, layers):
    def layer(carry, w):
      h, steps = carry
      return (h @ w + cand, steps + 1), None
    (h, steps), _ = jax.lax.scan(layer, (user[ids], jnp.int32(0)), layers)
    return h * steps
  args = (_normal(0, U, F), IDS, _normal(1, B, F), 0.4 * _normal(2, 4, F, F))
  report = check_rewrite(model, args, mapping=1, users=(0,))
  assert any(c.kind == "entered" and "made ordinary" in c.reason for c in report.changes)
  assert _scan_products(model, args) == [B]


def test_a_broadcast_closed_over_and_a_reverse_scan():
  def model(user, ids, cand, xs):
    u = user[ids]
    def body(c, x):
      return c + jnp.sum(u * x, axis=-1), u[:, 0] * x[0]
    c, ys = jax.lax.scan(body, jnp.zeros(B), xs, reverse=True)
    return c + jnp.sum(ys, axis=0) + cand[:, 0]
  args = (_normal(0, U, F), IDS, _normal(1, B, F), _normal(2, 5, F))
  report = check_rewrite(model, args, mapping=1, users=(0,))
  assert report.count("entered") == 1 and report.count("at_users") >= 3


def test_a_scan_over_broadcast_rows_runs_on_them_as_written():
  def model(user, ids, cand):
    rows = user[ids] * 2.0
    total, prefix = jax.lax.scan(lambda c, row: (c + row, c * row), jnp.zeros(F), rows)
    return prefix * cand + total
  args = (_normal(0, U, F), IDS, _normal(1, B, F))
  report = check_rewrite(model, args, mapping=1, users=(0,))
  assert report.count("entered") == 1


def test_padding_users_and_out_of_range_ids_through_a_carried_tower():
  """User 3 has no candidates and a NaN row the original never reads; ids 100 and -1 pad.

  Both padding ids read row 4 in the original (a clamp, and negative indexing).
  """
  user = _normal(0, U + 2, F).at[3].set(jnp.nan)
  ids = IDS.at[0].set(100).at[5].set(-1)
  args = (user, ids, _normal(1, B, F), 0.4 * _normal(2, 4, F, F))
  fast = rewrite.rewrite(_tower, mapping=1, users=(0,))
  grads = jax.grad(lambda *a: jnp.sum(fast(*a)), argnums=(0, 2, 3))(*args)
  check_rewrite(_tower, args, mapping=1, users=(0,))
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_an_integer_carry_of_a_layer_loop_needs_no_broadcast():
  def model(user, ids, cand, layers):
    def layer(carry, w):
      h, k = carry
      return (jax.nn.relu(h @ w) + k.astype(h.dtype), k + 1), None
    (h, _), _ = jax.lax.scan(layer, (user, jnp.int32(0)), layers)
    return h[ids] * cand
  args = (_normal(0, U, F), IDS, _normal(1, B, F), 0.4 * _normal(2, 3, F, F))
  check_rewrite(model, args, mapping=1, users=(0,))
