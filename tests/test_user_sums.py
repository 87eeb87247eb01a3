"""Per-user sums of candidate rows: exact up to float32 rounding, for any mapping, both paths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ikbo_jax.ops import user_sums


def _reference(x, ids, num_users):
  ref = np.zeros((num_users, *x.shape[1:]))
  np.add.at(ref, np.asarray(ids), np.asarray(x, np.float64))
  return ref


@settings(max_examples=40, deadline=None, derandomize=True)
@given(num_users=st.sampled_from([1, 3, 256, 257, 300]),
       num_rows=st.integers(1, 3 * user_sums.SORTED_CHUNK + 5),
       hot_share=st.floats(0.0, 1.0), sort=st.booleans(), seed=st.integers(0, 2**16))
def test_sum_per_user_matches_float64_for_any_mapping(num_users, num_rows, hot_share, sort, seed):
  # `hot_share` of the rows belong to one user, so runs cross chunk boundaries.
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, num_users, num_rows)
  ids[rng.random(num_rows) < hot_share] = rng.integers(0, num_users)
  ids = np.sort(ids) if sort else ids
  x = rng.normal(size=(num_rows, 3, 2)).astype(np.float32)
  got = jax.jit(user_sums.sum_per_user, static_argnums=2)(jnp.asarray(x), jnp.asarray(ids, jnp.int32),
                                                          num_users)
  np.testing.assert_allclose(got, _reference(x, ids, num_users), rtol=1e-5, atol=1e-5)


def test_add_sorted_chunk_drops_padding_and_out_of_range_ids():
  total = jnp.ones((4, 2), jnp.float32)
  ids = jnp.array([0, 0, 2, 4, 4], jnp.int32)  # 4 == U: padding
  rows = jnp.arange(10, dtype=jnp.float32).reshape(5, 2)
  got = user_sums.add_sorted_chunk(total, rows, ids)
  np.testing.assert_array_equal(got, [[1 + 0 + 2, 1 + 1 + 3], [1, 1], [5, 6], [1, 1]])


def test_sorted_path_never_scatters_duplicate_ids():
  # The determinism argument: every floating-point scatter in the sorted path
  # has distinct ids (integer adds, as in `jnp.nonzero`, are exact in any order).
  ids = jnp.asarray(np.repeat(np.arange(300), 3), jnp.int32)
  jaxpr = jax.make_jaxpr(user_sums.sum_per_user, static_argnums=2)(
      jnp.ones((900, 2), jnp.float32), ids, 300)
  scatters = [e for e in _equations(jaxpr.jaxpr) if e.primitive.name == "scatter-add"
              and jnp.issubdtype(e.outvars[0].aval.dtype, jnp.floating)]
  assert scatters and all(e.params["unique_indices"] for e in scatters)


def _equations(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      if hasattr(param, "jaxpr"):
        yield from _equations(getattr(param.jaxpr, "jaxpr", param.jaxpr))


@pytest.mark.parametrize("num_users", [3, user_sums.ONE_HOT_MAX_USERS + 5])
def test_a_non_finite_row_reaches_only_its_users_sum(num_users):
  """A one-hot GEMM multiplies every row by every user's 0 (`0 * NaN = NaN`); the sums must not."""
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(0, num_users, 400), jnp.int32)
  x = jnp.asarray(rng.standard_normal((400, 3)), jnp.float32)
  x = x.at[7, 0].set(jnp.nan).at[8, 1].set(jnp.inf).at[9, 2].set(-jnp.inf).at[10, 2].set(jnp.inf)
  got = np.asarray(user_sums.sum_per_user(x, ids, num_users))
  want = np.asarray(jax.ops.segment_sum(x, ids, num_segments=num_users))
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_finite_rows_whose_sum_overflows_give_the_plain_sum(dtype):
  """Sums are checked before rows: an overflow of finite rows is a plain sum's Inf, no NaN."""
  big = float(jnp.finfo(dtype).max)
  ids = jnp.asarray([0, 0, 1, 1, 2], jnp.int32)
  x = jnp.asarray([[big, 1.0], [big, -1.0], [-big, 2.0], [-big, 0.0], [1.0, 1.0]], dtype)
  got = np.asarray(user_sums.sum_per_user(x, ids, 3))
  # float32 sums: two bfloat16 maxima fit, two float32 maxima overflow to Inf.
  want = np.asarray(x, np.float64)
  want = np.stack([want[:2].sum(0), want[2:4].sum(0), want[4]]).astype(np.float32)
  np.testing.assert_array_equal(got, want)
