"""Regression tests for defects found by trying the library on ordinary inputs.

Each test names the defect it pins down. GPU-only defects run on the GPU
(`gpu` mark); where the code path is shared with the interpreter, a CPU
variant runs too.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify

from ikbo_jax.testing.problems import random_attention_args, random_index, random_lce_args
from ikbo_jax import CandidateIndex, linear_compression, self_target_attention, target_attention
from ikbo_jax import platform
from ikbo_jax.nn import LinearCompression
from ikbo_jax.ops import linear_compression as lce_op
from ikbo_jax.ops import linear_compression_mosaic
from ikbo_jax.ops import self_target_attention as self_target_op
from ikbo_jax.ops import target_attention as target_op
from ikbo_jax.testing import error_rule, references, sweep


def _assert_sweep_case_passes(case, implementations, interpret=False):
  results = sweep.run_case(case, implementations, interpret=interpret)
  assert {r.implementation for r in results} == set(implementations)
  failures = [r.describe() for r in results if not r.ok]
  assert not failures, "\n".join(failures)


# Defect: Mosaic GPU linear compression wrong for N <= 64 (a consumer's store
# past a 64-wide dimension landed on the other consumer's columns).
@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k_user, k_cand", [
    (96, 64, 128, 256), (70, 64, 128, 256), (64, 64, 64, 64), (96, 33, 40, 64), (40, 130, 16, 8)])
def test_gpu_lce_mosaic_small_n_and_m(m, n, k_user, k_cand):
  case = sweep.LinearCompressionCase(
      seed=m + n, mapping=sweep.Mapping(20, 300, 2, False), m=m, n=n, k_user=k_user,
      k_cand=k_cand, dtype="bfloat16")
  _assert_sweep_case_passes(case, ("mosaic_gpu",))


@pytest.mark.gpu
def test_gpu_lce_mosaic_two_launch_forward_n64():
  """The two-launch forward (user GEMM in XLA first) at the reported shape."""
  mapping = sweep.Mapping(20, 300, 0, False)
  index = mapping.index(np.random.default_rng(0))
  case = sweep.LinearCompressionCase(0, mapping, 96, 64, 128, 256, "bfloat16")
  args = random_lce_args(0, 96, 128, 256, 64, 20, 300, jnp.bfloat16)
  out, _ = linear_compression_mosaic.forward(*args, index.cand_to_user, interpret=False,
                                             single_launch=False)
  same = references.linear_compression(*args, index.cand_to_user)
  f32 = references.linear_compression(*[a.astype(jnp.float32) for a in args],
                                      index.cand_to_user, precision="highest")
  error_rule.assert_within_reference_error("out", out, same, f32, jnp.bfloat16)


# Defect: the target-attention backward looked like garbage for a user with
# kv_len == 1. Its true dq and dk are exactly zero (one key: every softmax
# weight is 1), so a relative error per user divides rounding noise by zero;
# the rule judges such rows on the tensor's scale.
_ONE_KEY = sweep.AttentionCase(seed=5, mapping=sweep.Mapping(3, 64, 0, False), n_seed=7,
                               seq_len=2000, heads=2, head_dim=64, kv_len=(1, 1500, 2000),
                               dtype="bfloat16")


@pytest.mark.gpu
def test_gpu_backward_with_a_one_key_history():
  _assert_sweep_case_passes(_ONE_KEY, ("triton", "mosaic_gpu"))


def test_interpret_triton_backward_with_a_one_key_history():
  case = dataclasses.replace(_ONE_KEY, mapping=sweep.Mapping(3, 9, 0, False), seq_len=130,
                             kv_len=(1, 100, 130))
  _assert_sweep_case_passes(case, ("triton",), interpret=True)


# Defect: a history of one position (S = 1) gave gradients of order 1e29 on both
# kernel paths on the H200 (forward right; S = 2 right). The Triton backward now
# runs on K/V padded to whole key blocks.
_ONE_POSITION = (
    sweep.AttentionCase(seed=61, mapping=sweep.Mapping(61, 61, 0, False), n_seed=16, seq_len=1,
                        heads=2, head_dim=64, kv_len=(1,) * 61, dtype="bfloat16"),
    sweep.AttentionCase(seed=50, mapping=sweep.Mapping(50, 50, 0, False), n_seed=33, seq_len=1,
                        heads=1, head_dim=128, kv_len=(1,) * 50, dtype="bfloat16"),
)


@pytest.mark.gpu
@pytest.mark.parametrize("case", _ONE_POSITION, ids=["d64", "d128"])
def test_gpu_backward_with_a_single_position_history(case):
  _assert_sweep_case_passes(case, ("xla", "triton", "mosaic_gpu"))


@pytest.mark.parametrize("seq_len", [1, 2])
def test_interpret_triton_backward_with_a_single_position_history(seq_len):
  case = sweep.AttentionCase(seed=7, mapping=sweep.Mapping(5, 9, 1, False), n_seed=3,
                             seq_len=seq_len, heads=2, head_dim=16, kv_len=(1, seq_len, 0, 1, 1),
                             dtype="bfloat16")
  _assert_sweep_case_passes(case, ("triton",), interpret=True)


# Defect: the xla path's float32 gradients differed between two identical calls
# on the GPU (D = 32): its per-user K/V sums were a scatter-add, whose atomics
# add duplicate ids in arrival order. The sums now run in user order with
# scatters whose ids are distinct (`ops/user_sums.py`).
_FLOAT32_D32 = sweep.AttentionCase(seed=32, mapping=sweep.Mapping(7, 300, 0, False), n_seed=5,
                                   seq_len=70, heads=2, head_dim=32, kv_len=(70, 1, 0, 33, 64, 70, 2),
                                   dtype="float32")


@pytest.mark.gpu
def test_gpu_xla_gradients_are_bit_repeatable_in_float32():
  _assert_sweep_case_passes(_FLOAT32_D32, ("xla",))


def test_xla_attention_backward_never_scatters_floats_to_duplicate_ids():
  index = _FLOAT32_D32.mapping.index(np.random.default_rng(0))
  args = random_attention_args(0, 7, 300, 5, 70, 2, 32, jnp.float32)
  loss = lambda *a: jnp.sum(target_attention(*a, index, implementation="xla") ** 2)
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args)
  scatters = [e for e in _equations(jaxpr.jaxpr) if e.primitive.name.startswith("scatter")
              and jnp.issubdtype(e.outvars[0].aval.dtype, jnp.floating)]
  assert scatters and all(e.params["unique_indices"] for e in scatters), scatters


def _equations(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if hasattr(sub, "eqns"):
          yield from _equations(sub)
        elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
          yield from _equations(sub.jaxpr)


# Defect: the backward needed all n_seed query rows of a candidate in shared
# memory (RESOURCE_EXHAUSTED at n_seed = 256 and 512 on the H200).
@pytest.mark.gpu
@pytest.mark.parametrize("n_seed", [256, 512])
def test_gpu_backward_large_n_seed(n_seed):
  case = sweep.AttentionCase(seed=n_seed, mapping=sweep.Mapping(3, 10, 1, False), n_seed=n_seed,
                             seq_len=300, heads=2, head_dim=128, kv_len=(300, 0, 129),
                             dtype="bfloat16")
  _assert_sweep_case_passes(case, ("triton", "mosaic_gpu"))


def test_interpret_triton_backward_n_seed_in_several_query_blocks():
  case = sweep.AttentionCase(seed=3, mapping=sweep.Mapping(2, 3, 0, False), n_seed=200,
                             seq_len=70, heads=1, head_dim=16, kv_len=(70, 33), dtype="float32")
  _assert_sweep_case_passes(case, ("triton",), interpret=True)


# Defect: implementation=None chose Triton for inputs it cannot run (D = 48, 96).
@pytest.fixture
def on_hopper(monkeypatch):
  monkeypatch.setattr(platform, "default_platform", lambda: "gpu")
  monkeypatch.setattr(platform, "is_hopper", lambda: True)


@pytest.mark.parametrize("dtype, head_dim, expected", [
    ("bfloat16", 128, "mosaic_gpu"), ("bfloat16", 96, "xla"), ("float32", 48, "xla"),
    ("float32", 64, "triton"), ("float16", 32, "triton"), ("bfloat16", 512, "xla")])
def test_default_only_picks_an_implementation_that_supports_the_inputs(on_hopper, dtype,
                                                                       head_dim, expected):
  assert target_op.default_implementation(dtype, head_dim) == expected
  self_target_expected = "mosaic_gpu" if expected == "mosaic_gpu" else "xla"
  assert self_target_op.default_implementation(dtype, head_dim) == self_target_expected


def test_default_linear_compression_per_dtype(on_hopper):
  assert lce_op.default_implementation(jnp.bfloat16) == "mosaic_gpu"
  assert lce_op.default_implementation(jnp.float32) == "xla"


def test_named_implementation_that_cannot_run_the_inputs_raises_before_tracing(on_hopper):
  (q, k, v), index = _attention_inputs(d=48, dtype=jnp.float32)
  with pytest.raises(ValueError, match=r"implementation='triton' supports head dims .* got D=48"):
    target_attention(q, k, v, index, implementation="triton")
  with pytest.raises(TypeError, match="implementation='mosaic_gpu' supports bfloat16 and float16"):
    target_attention(q, k, v, index, implementation="mosaic_gpu")


def _attention_inputs(d=16, dtype=jnp.float32, t=3, s=20, num_users=3, num_cands=6):
  index = random_index(np.random.default_rng(0), num_users, num_cands)
  return random_attention_args(0, num_users, num_cands, t, s, 2, d, dtype), index


# Defect: NaN/Inf semantics differed between implementations. Required: those of
# jax.nn.dot_product_attention over the valid keys.
_NAN_IMPLEMENTATIONS = [("xla", False), ("xla_materialized", False), ("triton", True),
                        ("mosaic_gpu", True)]


def _nan_problem():
  args, index = _attention_inputs(d=64, dtype=jnp.bfloat16, t=16, s=200)
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


# Defect (found by the GPU sweep): the Mosaic self + target backward raised inside
# cuDNN ("Unsupported sequence length Q 127, KV 127") for an odd sequence length.
@pytest.mark.gpu
@pytest.mark.parametrize("seq_len, causal", [(127, True), (3717, True), (201, False)])
def test_gpu_self_target_backward_with_an_odd_sequence_length(seq_len, causal):
  case = sweep.AttentionCase(seed=seq_len, mapping=sweep.Mapping(3, 8, 1, False), n_seed=16,
                             seq_len=seq_len, heads=2, head_dim=64,
                             kv_len=(seq_len, 0, seq_len // 2), dtype="float16", causal=causal)
  _assert_sweep_case_passes(case, ("mosaic_gpu",))


# Defect: nn.LinearCompression initialized at 2.17x nnx.Linear's scale at the published shape.
def test_linear_compression_init_matches_nnx_linear_over_the_concatenated_stack():
  k_user, k_cand, m = 1178, 866, 433
  layer = LinearCompression(k_user, k_cand, m, rngs=nnx.Rngs(0))
  dense = nnx.Linear(k_user + k_cand, m, rngs=nnx.Rngs(1))
  w = np.concatenate([layer.w_user[...], layer.w_cand[...]], axis=1)
  assert w.shape == (m, k_user + k_cand)
  np.testing.assert_allclose(w.std(), np.asarray(dense.kernel[...]).std(), rtol=0.02)
  np.testing.assert_allclose(w.std(), 1 / np.sqrt(k_user + k_cand), rtol=0.05)


# Defect: dataclasses.replace kept the old counts and sort order.
def test_replaced_index_derives_its_metadata_again():
  index = CandidateIndex.from_mapping(jnp.array([0, 0, 1, 2]), num_users=3)
  replaced = dataclasses.replace(index, cand_to_user=jnp.array([2, 1, 1, 1]))
  np.testing.assert_array_equal(replaced.user_counts, [0, 3, 1])
  np.testing.assert_array_equal(replaced.sort_order, [1, 2, 3, 0])
  fresh = CandidateIndex.from_mapping(jnp.array([2, 1, 1, 1]), num_users=3)
  (q, k, v), _ = _attention_inputs(num_cands=4)
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
  (q, k, v), good = _attention_inputs(num_users=2, num_cands=2)
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


def test_flags_must_be_bools():
  (q, k, v), index = _attention_inputs()
  with pytest.raises(TypeError, match="checked must be a Python bool, got 'yes'"):
    target_attention(q, k, v, index, checked="yes")
  with pytest.raises(TypeError, match="causal must be a Python bool, got 'yes'"):
    self_target_attention(k, q, k, v, index, causal="yes")
  with pytest.raises(TypeError, match="interpret must be a Python bool"):
    linear_compression(*[jnp.ones(s) for s in ((2, 3), (2, 4), (3, 3, 5), (6, 4, 5))], index,
                       interpret=1)


def test_self_target_errors_name_q_cand():
  (q, k, v), index = _attention_inputs()
  with pytest.raises(ValueError, match=r"q_cand.shape\[0\]"):
    self_target_attention(k, q[:-1], k, v, index)


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
