import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from ikbo_jax import CandidateIndex


def test_from_mapping_metadata_unsorted_with_empty_user():
  index = CandidateIndex.from_mapping(jnp.array([2, 0, 2, 3, 0, 2]), num_users=4)
  np.testing.assert_array_equal(index.user_counts, [2, 0, 3, 1])
  np.testing.assert_array_equal(index.user_offsets, [0, 2, 2, 5, 6])
  np.testing.assert_array_equal(index.cand_to_user[index.sort_order], [0, 0, 2, 2, 2, 3])
  np.testing.assert_array_equal(index.sort_order, [1, 4, 0, 2, 5, 3])  # stable


def test_from_counts_traced_needs_num_candidates():
  index = jax.jit(lambda c: CandidateIndex.from_counts(c, num_candidates=4))(jnp.array([3, 0, 1]))
  np.testing.assert_array_equal(index.cand_to_user, [0, 0, 0, 2])
  with pytest.raises(ValueError, match="num_candidates must be given"):
    jax.jit(lambda c: CandidateIndex.from_counts(c))(jnp.array([1, 1]))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(cand_to_user=jnp.zeros((2, 2), jnp.int32), num_users=2), ValueError, "rank 1"),
    (dict(cand_to_user=jnp.zeros((2,)), num_users=2), TypeError, "integer"),
    (dict(cand_to_user=jnp.zeros((0,), jnp.int32), num_users=2), ValueError, "empty"),
    (dict(cand_to_user=jnp.zeros((2,), jnp.int32), num_users=0), ValueError, "positive"),
])
def test_from_mapping_rejects_bad_input(kwargs, error, match):
  with pytest.raises(error, match=match):
    CandidateIndex.from_mapping(**kwargs)


def test_from_counts_rejects_negative_and_mismatch():
  with pytest.raises(ValueError, match="non-negative"):
    CandidateIndex.from_counts([1, -1])
  with pytest.raises(ValueError, match="sum to 2"):
    CandidateIndex.from_counts([1, 1], num_candidates=3)


def test_check_eager_and_checkified():
  bad = CandidateIndex.from_mapping(jnp.array([0, 5, -1]), num_users=2)
  with pytest.raises(checkify.JaxRuntimeError, match=r"num_users=2\); got min -1, max 5"):
    bad.check()
  err, _ = checkify.checkify(jax.jit(lambda i: (i.check(), i.user_counts)[1]))(bad)
  assert err.get() is not None
  good = CandidateIndex.from_mapping(jnp.array([0, 1]), num_users=2)
  err, _ = checkify.checkify(jax.jit(lambda i: (i.check(), i.user_counts)[1]))(good)
  assert err.get() is None


def test_index_is_a_pytree_with_static_num_users():
  index = CandidateIndex.from_counts([1, 2])
  leaves, treedef = jax.tree.flatten(index)
  assert len(leaves) == 4
  assert jax.tree.unflatten(treedef, leaves).num_users == 2
