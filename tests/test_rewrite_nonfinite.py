"""The rewrite and non-finite values: rows no candidate reads, infinite partials, and the
comparison every rewrite test applies where the original's gradient is not finite.

Each test failed before its fix, or pins the contract (`rewrite_check.assert_same_up_to_order`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ikbo_jax import rewrite
from ikbo_jax.testing.programs import batch_scaled
from ikbo_jax.testing.rewrite_check import (assert_same_up_to_order, check_rewrite,
                                            outputs_and_gradients)


def _normal(seed, *shape):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# Defect (found by the long property test, seed 40043): work at U differentiated at read
# rows took an unread row's own tangent through a partial at another row's values. Here row
# 1 is unread and candidate 0 reads row 2, a zero row where `log|x|` has an infinite
# derivative: the unread row's gradient (only the direct one, as an output) became NaN.
def test_an_unread_rows_gradient_never_meets_another_rows_partial():
  def model(user, ids, cand, w):
    rows = user[(ids + 1) % user.shape[0]]
    return rows + jnp.log(jnp.abs(rows)) + cand @ w, user
  user = _normal(0, 3, 8).at[2].set(0.0)
  args = (user, jnp.array([1, 1, 2, 2], jnp.int32), _normal(1, 4, 5), _normal(2, 5, 8))
  check_rewrite(model, args, mapping=1, users=0)


# Defect (found by the property test, seed 9524): an unread row's tangent was its read
# row's, so its cotangent, a zero times the read row's partial, went back to the read row.
# Where that partial is infinite (a rule scaling by a mean over a row of infinities) the
# zero times infinity is NaN, and the read row's gradient, infinite in the original,
# became NaN. Here row 2 holds the fill value of out-of-range reads and no candidate reads
# it; row 1 is all infinities.
def test_an_unread_row_adds_nothing_to_an_infinite_gradient():
  def model(user, ids, cand):
    rows = jnp.take(user, jnp.where(ids < 0, ids + 2, ids), axis=0, mode="fill",
                    fill_value=jnp.nan)
    return batch_scaled(rows) + cand
  user = jnp.zeros((2, 8)).at[1].set(jnp.inf)
  args = (user, jnp.array([0, 0, 0, -1], jnp.int32), jnp.zeros((4, 8)))
  want = outputs_and_gradients(model, args)[1][0]
  assert np.isposinf(want[0]).all()  # the original's gradient, finite nowhere, is infinite here
  check_rewrite(model, args, mapping=1, users=0)


# Defect (found by the property test, seed 50354): each op differentiated at U gathered its
# operands by `rows`, so a chain of ops (gelu's, here, rematerialized by `jax.checkpoint`)
# fused into gathers of gathers, which XLA's CPU compiler failed on ("Unknown MLIR
# failure") when the mapping was a compile-time constant. The replacement is now a `where`.
def test_a_chain_of_ops_at_u_compiles_under_a_constant_mapping():
  def model(user, ids, cand):
    return jax.checkpoint(jax.nn.gelu)(user[ids]) + cand
  ids = np.full(7, 1, np.int32)
  user, cand = _normal(0, 2, 8), _normal(1, 7, 8)
  fast = rewrite.rewrite(model, mapping=1, users=0)

  def grad_of(fn):
    return jax.jit(jax.grad(lambda u: jnp.sum(jnp.sin(fn(u, ids, cand)))))(user)
  np.testing.assert_allclose(grad_of(fast), grad_of(model), rtol=1e-5, atol=1e-6)


# The contract where the original's gradient is not finite (property-test seed 50247): a
# moved op's infinite partial (sqrt at 0) meets the sum of a user's cotangents, one of which
# is zero (candidate 0's feature), where the original meets each: inf * (0 + c) = inf
# against inf * 0 + inf * c = NaN. The same entries are non-finite; NaN and inf trade places.
def test_nan_and_infinity_may_trade_places_where_the_original_is_not_finite():
  def model(user, ids, cand):
    return jnp.sqrt(user[ids]) * cand
  user = jnp.zeros((2, 3)).at[1].set(4.0)
  args = (user, jnp.array([0, 0, 1], jnp.int32),
          jnp.array([[0.0, 1.0, 2.0], [1.0, 1.0, 1.0], [1.0, 2.0, 3.0]]))
  want = outputs_and_gradients(model, args)[1][0]
  got = outputs_and_gradients(rewrite.rewrite(model, mapping=1, users=0), args)[1][0]
  assert np.isnan(want[0, 0]) and np.isposinf(got[0, 0])
  check_rewrite(model, args, mapping=1, users=0)


@pytest.mark.parametrize("got, want, same", [
    ([np.inf, 1.0], [np.nan, 1.0], True),
    ([np.nan, -np.inf], [-np.inf, np.nan], True),
    ([1.0 + 1e-7, 2.0], [1.0, 2.0], True),
    ([np.inf, 1.0], [3.0, 1.0], False),  # non-finite where the original is finite
    ([np.nan, 1.0], [3.0, 1.0], False),
    ([2.0, 1.0], [np.nan, 1.0], False),  # finite where the original is not
    ([np.inf, 1.0], [-np.inf, 1.0], False),  # an infinity of the other sign
    ([1.1, 2.0], [1.0, 2.0], False),
])
def test_the_comparison_allows_only_reordering(got, want, same):
  compare = lambda: assert_same_up_to_order(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
  if same:
    compare()
  else:
    with pytest.raises(AssertionError):
      compare()
