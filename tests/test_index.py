import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify

from ikbo_jax import CandidateIndex, target_attention
from ikbo_jax.nn import LinearCompression
from ikbo_jax.testing.problems import attention_inputs


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


# Defect: dataclasses.replace kept the old counts and sort order.
def test_replaced_index_derives_its_metadata_again():
  index = CandidateIndex.from_mapping(jnp.array([0, 0, 1, 2]), num_users=3)
  replaced = dataclasses.replace(index, cand_to_user=jnp.array([2, 1, 1, 1]))
  np.testing.assert_array_equal(replaced.user_counts, [0, 3, 1])
  np.testing.assert_array_equal(replaced.sort_order, [1, 2, 3, 0])
  fresh = CandidateIndex.from_mapping(jnp.array([2, 1, 1, 1]), num_users=3)
  (q, k, v), _ = attention_inputs(num_cands=4)
  grad = lambda idx: jax.grad(lambda k: jnp.sum(target_attention(
      q, k, v, idx, implementation="triton", interpret=True) ** 2))(k)
  np.testing.assert_array_equal(grad(replaced), grad(fresh))
  # Derived fields are not settable (Python 3.12 says so with ValueError, 3.13 with TypeError).
  with pytest.raises((TypeError, ValueError), match="user_counts"):
    dataclasses.replace(index, user_counts=jnp.array([4, 0, 0]))


# Defect: wide ids and lengths wrapped around when cast to int32, and loose arguments passed.
def test_wide_ids_and_lengths_saturate_so_checked_mode_sees_them():
  index = CandidateIndex.from_mapping(np.array([2**33 + 1, 0], np.int64), num_users=2)
  with pytest.raises(checkify.JaxRuntimeError, match="num_users=2"):
    index.check()
  (q, k, v), good = attention_inputs(num_users=2, num_cands=2)
  with pytest.raises(checkify.JaxRuntimeError, match=r"kv_len values must lie in \[0, S=20\]"):
    target_attention(q, k, v, good, kv_len=np.array([2**32 + 3, 4], np.int64), checked=True)


@pytest.mark.parametrize("counts, kwargs, error, match", [
    ([1.5, 2], {}, TypeError, "user_counts must be integers"),
    ([2, 1], dict(num_candidates=4), ValueError, "num_candidates=4 but user_counts sum to 3"),
    ([2, 1], dict(num_candidates=2), ValueError, "num_candidates=2 but user_counts sum to 3"),
])
def test_from_counts_rejects_what_it_cannot_honor(counts, kwargs, error, match):
  with pytest.raises(error, match=match):
    CandidateIndex.from_counts(counts, **kwargs)


def test_traced_from_counts_marks_padding_candidates_out_of_range():
  index = jax.jit(lambda c: CandidateIndex.from_counts(c, num_candidates=6))(jnp.array([2, 1]))
  np.testing.assert_array_equal(index.cand_to_user, [0, 0, 1, 2, 2, 2])
  with pytest.raises(checkify.JaxRuntimeError):
    index.check()


def test_checked_mode_with_nnx_jit_through_split_and_checkify():
  """The documented pattern: checkify a pure function of the module's state, then jit it."""
  layer = LinearCompression(3, 2, 4, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(layer)
  bad = CandidateIndex.from_mapping(jnp.array([0, 5, 1]), num_users=2)
  e_user, e_cand = jnp.ones((2, 3, 8)), jnp.ones((3, 2, 8))

  def step(state, e_user, e_cand, index):
    return nnx.merge(graphdef, state)(e_user, e_cand, index, checked=True)

  err, _ = jax.jit(checkify.checkify(step))(state, e_user, e_cand, bad)
  with pytest.raises(checkify.JaxRuntimeError, match="num_users=2"):
    err.throw()
  # Without checkify, jit cannot carry the check: JAX says so at trace time.
  with pytest.raises(ValueError, match="not functionalized"):
    nnx.jit(lambda m, i: m(e_user, e_cand, i, checked=True))(layer, bad)
