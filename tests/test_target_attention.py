"""Target attention (XLA paths): semantics, lengths, gradients and validation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from ikbo_jax import CandidateIndex, target_attention
from ikbo_jax.testing.problems import (
    assert_within_reference_error, random_attention_args, random_index, rel_err)


def _problem(seed, dtype, num_users=3, num_cands=7, empty_users=1, t=5, s=13, h=2, d=16):
  rng = np.random.default_rng(seed)
  index = random_index(rng, num_users, num_cands, empty_users=empty_users)
  kv_len = jnp.asarray(rng.integers(1, s + 1, num_users), jnp.int32)
  return random_attention_args(seed, num_users, num_cands, t, s, h, d, dtype), index, kv_len


def _per_candidate_loop(q, k, v, ids, kv_len):
  """Independent reference: jax.nn.dot_product_attention one candidate at a time."""
  rows = []
  for b, u in enumerate(np.asarray(ids)):
    n = int(kv_len[u])
    rows.append(jax.nn.dot_product_attention(q[b:b + 1], k[u:u + 1, :n], v[u:u + 1, :n]))
  return jnp.concatenate(rows)


@pytest.mark.parametrize("implementation", ["xla", "xla_materialized"])
def test_matches_per_candidate_dot_product_attention(implementation):
  (q, k, v), index, kv_len = _problem(0, jnp.float32)
  out = target_attention(q, k, v, index, kv_len=kv_len, implementation=implementation)
  ref = _per_candidate_loop(q, k, v, index.cand_to_user, kv_len)
  assert rel_err(out, ref) < 1e-5


def test_lse_and_zero_length_user():
  (q, k, v), index, _ = _problem(2, jnp.float32, empty_users=0)
  kv_len = jnp.array([0, 13, 4])
  out, lse = target_attention(q, k, v, index, kv_len=kv_len, return_lse=True)
  ids = np.asarray(index.cand_to_user)
  assert lse.shape == q.shape[:3] and lse.dtype == jnp.float32
  np.testing.assert_array_equal(out[ids == 0], 0)
  assert np.all(np.isneginf(lse[ids == 0]))
  b = int(np.flatnonzero(ids == 2)[0])
  logits = jnp.einsum("thd,shd->ths", q[b], k[2, :4]) / 4.0
  np.testing.assert_allclose(lse[b], jax.nn.logsumexp(logits, axis=-1), rtol=1e-5)


def test_gradients_match_autodiff_of_materialized_reference():
  (q, k, v), index, kv_len = _problem(3, jnp.float32)

  def loss(implementation, *a):
    out = target_attention(*a, index, kv_len=kv_len, implementation=implementation)
    return jnp.sum(out * jnp.sin(out))

  grads = jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2))(q, k, v)
  ref = jax.grad(lambda *a: jnp.sum(jnp.sin(o := _per_candidate_loop(
      *a, index.cand_to_user, kv_len)) * o), argnums=(0, 1, 2))(q, k, v)
  for name, g, r in zip("qkv", grads, ref):
    assert rel_err(g, r) < 1e-5, name
  empty = np.setdiff1d(np.arange(3), np.asarray(index.cand_to_user))
  np.testing.assert_array_equal(grads[1][empty], 0)


def test_jit_with_traced_index_and_lengths():
  args, index, kv_len = _problem(4, jnp.float32)
  fn = jax.jit(lambda *a, index, kv_len: target_attention(*a, index, kv_len=kv_len))
  np.testing.assert_allclose(fn(*args, index=index, kv_len=kv_len),
                             target_attention(*args, index, kv_len=kv_len), rtol=1e-5, atol=1e-6)


def test_out_of_range_ids_and_lengths_are_clamped_and_checked_mode_raises():
  args, _, _ = _problem(5, jnp.float32, empty_users=0)
  bad = CandidateIndex.from_mapping(jnp.array([0, 9, 1, -3, 2, 1, 0]), num_users=3)
  clamped = CandidateIndex.from_mapping(jnp.array([0, 2, 1, 0, 2, 1, 0]), num_users=3)
  np.testing.assert_allclose(target_attention(*args, bad, kv_len=jnp.array([99, -1, 5])),
                             target_attention(*args, clamped, kv_len=jnp.array([13, 0, 5])))
  with pytest.raises(checkify.JaxRuntimeError, match="num_users=3"):
    target_attention(*args, bad, checked=True)
  index = CandidateIndex.from_mapping(jnp.zeros(7, jnp.int32), num_users=3)
  with pytest.raises(checkify.JaxRuntimeError, match="kv_len values"):
    target_attention(*args, index, kv_len=jnp.array([14, 1, 1]), checked=True)


def test_validation_errors_name_the_argument():
  (q, k, v), index, _ = _problem(6, jnp.float32)
  cases = [
      ((q[0], k, v), {}, ValueError, r"q must have rank 4"),
      ((q[:3], k, v), {}, ValueError, r"q.shape\[0\] \(B"),
      ((q, k[:2], v), {}, ValueError, r"k.shape\[0\] \(U"),
      ((q, k, v[:, :5]), {}, ValueError, r"v.shape\[1\] \(S, from k\)"),
      ((q, k[..., :8], v), {}, ValueError, r"k.shape\[3\] \(D, from q\)"),
      ((q, k, v.astype(jnp.bfloat16)), {}, TypeError, "share one dtype"),
      ((q, k, v), {"kv_len": jnp.ones(2, jnp.int32)}, ValueError, r"kv_len.shape\[0\]"),
      ((q, k, v), {"kv_len": jnp.ones(3)}, TypeError, "kv_len must be an integer"),
      ((q, k, v), {"implementation": "cuda"}, ValueError, "implementation must be one of"),
      ((q, k, v), {"implementation": "xla", "interpret": True}, ValueError, "interpret=True"),
  ]
  for args, kwargs, error, match in cases:
    with pytest.raises(error, match=match):
      target_attention(*args, index, **kwargs)


@pytest.mark.gpu
def test_gpu_triton_at_benchmark_heads():
  """B=256 candidates of 4 users, n_seed 64, H=2, D=128, S=1024 with jagged lengths."""
  rng = np.random.default_rng(8)
  index = random_index(rng, 4, 255, empty_users=0)
  keys = jax.random.split(jax.random.key(8), 3)
  q = jax.random.normal(keys[0], (255, 64, 2, 128), jnp.bfloat16)
  k = jax.random.normal(keys[1], (4, 1024, 2, 128), jnp.bfloat16)
  v = jax.random.normal(keys[2], (4, 1024, 2, 128), jnp.bfloat16)
  kv_len = jnp.array([1024, 1, 500, 777])
  out = target_attention(q, k, v, index, kv_len=kv_len, implementation="triton")
  same = target_attention(q, k, v, index, kv_len=kv_len, implementation="xla_materialized")
  f32 = target_attention(*[a.astype(jnp.float32) for a in (q, k, v)], index, kv_len=kv_len,
                         implementation="xla_materialized")
  assert_within_reference_error(out, same, f32)


def test_triton_interpret_gradients_through_lse_with_an_empty_history():
  # The lse cotangent enters the backward kernels as `delta - d_lse`.
  args, index, _ = _problem(9, jnp.float32, empty_users=0, t=7, s=70)
  kv_len = jnp.array([0, 70, 33])
  weights = jax.random.normal(jax.random.key(9), args[0].shape[:3])

  def loss(implementation, **kwargs):
    def fn(*a):
      out, lse = target_attention(*a, index, kv_len=kv_len, return_lse=True,
                                  implementation=implementation, **kwargs)
      return jnp.sum(out ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * weights)
    return fn

  grads = jax.grad(loss("triton", interpret=True), argnums=(0, 1, 2))(*args)
  ref = jax.grad(loss("xla_materialized"), argnums=(0, 1, 2))(*args)
  for g, r in zip(grads, ref):
    assert rel_err(g, r) < 1e-5
  np.testing.assert_array_equal(grads[1][0], 0)  # user 0 has no valid key
