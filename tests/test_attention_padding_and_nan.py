"""Attention padding and NaN semantics: rows past `kv_len` are never read, and NaN/Inf reach
exactly the rows that read them (those of `jax.nn.dot_product_attention`), on every implementation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ikbo_jax import self_target_attention, target_attention
from ikbo_jax.testing.problems import attention_inputs


# Defect: NaN/Inf semantics differed between implementations. Required: those of
# jax.nn.dot_product_attention over the valid keys.
_NAN_IMPLEMENTATIONS = [("xla", False), ("xla_materialized", False), ("triton", True),
                        ("mosaic_gpu", True)]


def _nan_problem():
  args, index = attention_inputs(d=64, dtype=jnp.bfloat16, t=16, s=200)
  kv_len = jnp.array([200, 70, 130])
  return args, index, kv_len


def _target(impl, interpret, index, kv_len):
  return lambda q, k, v: target_attention(q, k, v, index, kv_len=kv_len, implementation=impl,
                                          interpret=interpret)


@pytest.mark.parametrize("impl, interpret", _NAN_IMPLEMENTATIONS)
def test_interpret_padding_is_never_read(impl, interpret):
  (q, k, v), index, kv_len = _nan_problem()
  k_bad = k.at[1, 70:].set(jnp.nan).at[2, 130:].set(jnp.inf)
  v_bad = v.at[1, 70:].set(jnp.inf).at[2, 199].set(jnp.nan)
  fn = _target(impl, interpret, index, kv_len)
  clean, grads = jax.value_and_grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) ** 2),
                                    argnums=(0, 1, 2))(q, k, v)
  dirty, dirty_grads = jax.value_and_grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) ** 2),
                                          argnums=(0, 1, 2))(q, k_bad, v_bad)
  assert np.isfinite(dirty) and dirty == clean
  for g, d in zip(grads, dirty_grads):
    np.testing.assert_array_equal(g, d)


@pytest.mark.parametrize("impl, interpret", _NAN_IMPLEMENTATIONS)
def test_interpret_nan_and_inf_reach_exactly_the_rows_that_read_them(impl, interpret):
  (q, k, v), index, kv_len = _nan_problem()
  ids = np.asarray(index.cand_to_user)
  b_nan = int(np.flatnonzero(ids == 0)[0])
  q_bad = q.at[b_nan, 3, 1, 5].set(jnp.nan)  # one query row of one candidate, head 1
  k_bad = k.at[1, 10, 0].set(jnp.nan)  # a valid key of user 1, head 0
  v_bad = v.at[2, 0, 1, 7].set(jnp.inf)  # a valid value of user 2, head 1
  out = np.asarray(_target(impl, interpret, index, kv_len)(q_bad, k_bad, v_bad), np.float32)
  expected_bad = np.zeros(out.shape, bool)
  expected_bad[b_nan, 3, 1, :] = True
  expected_bad[ids == 1, :, 0, :] = True
  expected_bad[ids == 2, :, 1, 7] = True
  np.testing.assert_array_equal(~np.isfinite(out), expected_bad)
  ref = jax.nn.dot_product_attention(q_bad[b_nan:b_nan + 1], k_bad[:1], v_bad[:1])
  assert np.isnan(np.asarray(ref[0, 3, 1], np.float32)).all()  # the semantics we match


@pytest.mark.parametrize("impl, interpret", [("xla", False), ("mosaic_gpu", True)])
def test_interpret_self_target_padding_is_never_read(impl, interpret):
  (q, k, v), index, kv_len = _nan_problem()
  q_user = jax.random.normal(jax.random.key(3), k.shape, k.dtype)
  bad = lambda x: x.at[1, 70:].set(jnp.nan).at[2, 130:].set(jnp.inf)

  def loss(*a):
    out_user, out_cand = self_target_attention(*a, index, kv_len=kv_len, causal=True,
                                               implementation=impl, interpret=interpret)
    return jnp.sum(out_user.astype(jnp.float32) ** 2) + jnp.sum(out_cand.astype(jnp.float32))

  clean = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q_user, q, k, v)
  dirty = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(bad(q_user), q, bad(k), bad(v))
  assert np.isfinite(dirty[0]) and dirty[0] == clean[0]
  for g, d, kept in zip(clean[1], dirty[1], (True, True, True, True)):
    valid = np.ones(g.shape, bool)
    if g.shape == k.shape:  # padding positions get zero gradients either way
      valid[1, 70:], valid[2, 130:] = False, False
    np.testing.assert_array_equal(np.asarray(g)[valid], np.asarray(d)[valid])
    assert np.isfinite(np.asarray(d, np.float32)).all() == kept


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "mosaic_gpu"])
def test_gpu_nan_semantics(impl):
  test_interpret_padding_is_never_read(impl, False)
  test_interpret_nan_and_inf_reach_exactly_the_rows_that_read_them(impl, False)


@pytest.mark.gpu
def test_gpu_self_target_padding_is_never_read():
  test_interpret_self_target_padding_is_never_read("mosaic_gpu", False)
