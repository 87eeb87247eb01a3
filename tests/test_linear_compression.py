"""Linear compression: every implementation against the float32 reference of the XLA path."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax.experimental import checkify
from jax.sharding import AbstractDevice, AbstractMesh

from ikbo_jax import CandidateIndex, linear_compression
from ikbo_jax.ops import linear_compression_mosaic
from ikbo_jax.testing import error_rule, references, sweep
from ikbo_jax.testing.problems import (
    assert_within_reference_error, random_index, random_lce_args, rel_err)

# M, K_user, K_cand, N: none a multiple of the kernel tiles.
SMALL = (70, 40, 30, 100)
KERNEL_DTYPES = {"triton": (jnp.float32, jnp.bfloat16, jnp.float16),
                 "mosaic_gpu": (jnp.bfloat16, jnp.float16)}


def _problem(seed, dtype, num_users=3, num_candidates=7, empty_users=1, shape=SMALL):
  rng = np.random.default_rng(seed)
  index = random_index(rng, num_users, num_candidates, empty_users=empty_users)
  args = random_lce_args(seed, *shape, num_users, num_candidates, dtype)
  return args, index


def _f32_reference(args, index):
  f32 = [a.astype(jnp.float32) for a in args]
  return linear_compression(*f32, index, implementation="xla_materialized")


def _check(implementation, dtype, args, index, interpret):
  out = linear_compression(*args, index, implementation=implementation, interpret=interpret)
  assert out.shape == (index.num_candidates, args[0].shape[0], args[2].shape[2])
  assert out.dtype == dtype
  same_precision = linear_compression(*args, index, implementation="xla_materialized")
  assert_within_reference_error(out, same_precision, _f32_reference(args, index))


@pytest.mark.parametrize("implementation", ["xla", "triton", "mosaic_gpu"])
def test_single_user_odd_batch(implementation):
  args, index = _problem(2, jnp.bfloat16, num_users=1, num_candidates=5, empty_users=0)
  _check(implementation, jnp.bfloat16, args, index, interpret=implementation != "xla")


def test_kernels_do_not_mix_candidates():
  """Every candidate row is distinct, so a tile written to a neighbour's rows would show."""
  args, index = _problem(3, jnp.bfloat16, num_candidates=4)
  ref = _f32_reference(args, index)
  for implementation in ("triton", "mosaic_gpu"):
    out = linear_compression(*args, index, implementation=implementation, interpret=True)
    per_cand = [rel_err(out[b], ref[b]) for b in range(4)]
    assert max(per_cand) < 2e-2, (implementation, per_cand)


def _materialized_loss(w_user, w_cand, e_user, e_cand, cand_to_user):
  w = jnp.concatenate([w_user, w_cand], axis=1)
  e = jnp.concatenate([e_user[cand_to_user], e_cand], axis=1)
  out = jnp.einsum("mk,bkn->bmn", w, e, precision="highest")
  return jnp.sum(out * jnp.sin(out))  # a cotangent that differs per element


@pytest.mark.parametrize("implementation", ["xla_materialized", "xla", "triton", "mosaic_gpu"])
def test_gradients_match_jax_grad_of_reference(implementation):
  dtype = jnp.bfloat16 if implementation == "mosaic_gpu" else jnp.float32
  args, index = _problem(4, dtype)

  def loss(*a):
    out = linear_compression(*a, index, implementation=implementation,
                             interpret=implementation in KERNEL_DTYPES).astype(jnp.float32)
    return jnp.sum(out * jnp.sin(out))

  grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
  f32 = [a.astype(jnp.float32) for a in args]
  ref = jax.grad(_materialized_loss, argnums=(0, 1, 2, 3))(*f32, index.cand_to_user)
  tol = 3e-2 if dtype == jnp.bfloat16 else 1e-5
  for name, g, r in zip(("w_user", "w_cand", "e_user", "e_cand"), grads, ref):
    assert g.dtype == dtype
    assert rel_err(g, r) < tol, name


def test_user_with_no_candidates_gets_zero_gradient():
  args, index = _problem(5, jnp.float32, num_users=4, empty_users=2)
  d_e_user = jax.grad(lambda eu: linear_compression(args[0], args[1], eu, args[3], index).sum())(
      args[2])
  empty = np.setdiff1d(np.arange(4), np.asarray(index.cand_to_user))
  assert len(empty) == 2
  np.testing.assert_array_equal(d_e_user[empty], 0)
  assert np.abs(np.asarray(d_e_user)).sum() > 0


@pytest.mark.parametrize("implementation", ["xla", "triton", "mosaic_gpu"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_row_of_a_user_without_candidates_reaches_no_gradient(implementation, bad):
  """The original (the materialized copy) never reads the row of a user without candidates,
  so its gradients are finite; the user GEMM's backward multiplied that row by a zero
  cotangent, and `0 * NaN` made `d_w_user` NaN."""
  args, index = _problem(6, jnp.bfloat16, num_users=4, empty_users=2)
  empty = np.setdiff1d(np.arange(4), np.asarray(index.cand_to_user))
  args = (args[0], args[1], args[2].at[empty].set(bad), args[3])

  def loss(implementation, *args):
    out = linear_compression(*args, index, implementation=implementation,
                             interpret=implementation in KERNEL_DTYPES)
    return out.astype(jnp.float32).sum()

  grads = jax.grad(functools.partial(loss, implementation), argnums=(0, 1, 2, 3))(*args)
  original = jax.grad(functools.partial(loss, "xla_materialized"), argnums=(0, 1, 2, 3))(*args)
  for name, grad, want in zip(["w_user", "w_cand", "e_user", "e_cand"], grads, original):
    assert np.isfinite(np.asarray(want, np.float32)).all(), name
    assert np.isfinite(np.asarray(grad, np.float32)).all(), name
  np.testing.assert_array_equal(grads[2][empty], 0)


@pytest.mark.parametrize("implementation", ["xla", "triton", "mosaic_gpu"])
def test_jit_with_traced_index_and_vmap(implementation):
  dtype = jnp.bfloat16 if implementation == "mosaic_gpu" else jnp.float32
  args, index = _problem(6, dtype)
  fn = functools.partial(linear_compression, implementation=implementation,
                         interpret=implementation in KERNEL_DTYPES)
  as_f32 = lambda x: np.asarray(x, np.float32)
  jitted = jax.jit(fn)
  np.testing.assert_allclose(as_f32(jitted(*args, index)), as_f32(fn(*args, index)),
                             rtol=1e-5, atol=1e-5)
  # Two stacked problems sharing the index; vmap over the leading axis of every operand.
  args2, _ = _problem(7, dtype)
  stacked = [jnp.stack([a, b]) for a, b in zip(args, args2)]
  out = jax.vmap(lambda *a: fn(*a, index))(*stacked)
  np.testing.assert_allclose(as_f32(out[1]), as_f32(fn(*args2, index)), rtol=1e-5, atol=1e-5)


def test_out_of_range_ids_are_clamped_and_checked_mode_raises():
  args, _ = _problem(8, jnp.float32)
  bad = CandidateIndex.from_mapping(jnp.array([0, 9, 1, -3, 2, 1, 0]), num_users=3)
  clamped = CandidateIndex.from_mapping(jnp.array([0, 2, 1, 0, 2, 1, 0]), num_users=3)
  for implementation in ("xla", "triton"):
    out = linear_compression(*args, bad, implementation=implementation,
                             interpret=implementation == "triton")
    np.testing.assert_allclose(out, linear_compression(*args, clamped), rtol=1e-5, atol=1e-5)
  with pytest.raises(checkify.JaxRuntimeError, match="num_users=3"):
    linear_compression(*args, bad, checked=True)
  checked = checkify.checkify(jax.jit(functools.partial(linear_compression, checked=True)))
  err, _ = checked(*args, bad)
  with pytest.raises(checkify.JaxRuntimeError):
    err.throw()


def _replace(args, i, value):
  return args[:i] + (value,) + args[i + 1:]


def test_validation_errors_name_the_argument():
  args, index = _problem(9, jnp.float32)
  w_user, w_cand, e_user, e_cand = args
  cases = [
      (_replace(args, 0, w_user[None]), ValueError, r"w_user must have rank 2"),
      (_replace(args, 1, w_cand[:-1]), ValueError, r"w_cand.shape\[0\] \(M, from w_user\) must be 70"),
      (_replace(args, 2, e_user[:2]), ValueError, r"e_user.shape\[0\] \(U, from index.num_users\) must be 3"),
      (_replace(args, 3, e_cand[:, :-1]), ValueError, r"e_cand.shape\[1\] \(K_cand"),
      (_replace(args, 3, e_cand[:, :, :-1]), ValueError, r"e_cand.shape\[2\] \(N, from e_user\)"),
      (_replace(args, 3, e_cand[:3]), ValueError, r"e_cand.shape\[0\] \(B"),
      (_replace(args, 3, e_cand.astype(jnp.bfloat16)), TypeError, "share one dtype"),
      (_replace(args, 0, w_user.astype(jnp.int32)), TypeError, "w_user must be float32"),
      (_replace(args, 1, w_cand[:, :0]), ValueError, "w_cand must not be empty"),
  ]
  for bad_args, error, match in cases:
    with pytest.raises(error, match=match):
      linear_compression(*bad_args, index)
  with pytest.raises(TypeError, match="index must be a CandidateIndex"):
    linear_compression(*args, index.cand_to_user)
  with pytest.raises(ValueError, match="implementation must be one of"):
    linear_compression(*args, index, implementation="cuda")
  with pytest.raises(TypeError, match="mosaic_gpu.*float32"):
    linear_compression(*args, index, implementation="mosaic_gpu", interpret=True)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU-only error")
def test_named_kernel_without_gpu_raises_instead_of_falling_back():
  args, index = _problem(10, jnp.bfloat16)
  for implementation in ("triton", "mosaic_gpu"):
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
      linear_compression(*args, index, implementation=implementation)


# The published IKBO benchmark shape: B=1024, U=15, M=433, N=256, K_user=1178, K_cand=866.
BENCH_SHAPE = dict(m=433, k_user=1178, k_cand=866, n=256, num_users=15, num_candidates=1024)


def _abstract_h200():
  return jax.sharding.use_abstract_mesh(AbstractMesh(
      (), (), abstract_device=AbstractDevice(
          device_kind="NVIDIA H200", platform="cuda", num_cores=132)))


@pytest.mark.parametrize("k_cand", [866, 872])
def test_mosaic_gpu_forward_and_backward_lower_for_h200_at_benchmark_shape(k_cand, monkeypatch):
  """Real CUDA lowering of the kernel configurations the benchmark runs, without a GPU."""
  from ikbo_jax import platform
  monkeypatch.setattr(platform, "default_platform", lambda: "gpu")
  monkeypatch.setattr(platform, "is_hopper", lambda: True)
  shape = dict(BENCH_SHAPE, k_cand=k_cand)
  specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in (
      (shape["m"], shape["k_user"]), (shape["m"], k_cand),
      (shape["num_users"], shape["k_user"], shape["n"]),
      (shape["num_candidates"], k_cand, shape["n"]))]
  index = CandidateIndex.from_counts(np.full(16, 64))
  index = CandidateIndex.from_mapping(index.cand_to_user % 15, 15)
  d_out = jax.ShapeDtypeStruct((shape["num_candidates"], shape["m"], shape["n"]), jnp.bfloat16)
  op = lambda *a: linear_compression(*a, index, implementation="mosaic_gpu")
  fwd_bwd = lambda d, *a: jax.vjp(op, *a)[1](d)
  with _abstract_h200():
    text = jax.jit(op).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    bwd_text = jax.jit(fwd_bwd).trace(d_out, *specs).lower(lowering_platforms=("cuda",)).as_text()
  assert "ikbo_linear_compression_mosaic_gpu" in text
  assert "ikbo_linear_compression_weight_grad_mosaic_gpu" in bwd_text


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["xla", "triton", "mosaic_gpu"])
@pytest.mark.parametrize("k_cand", [866, 872])
def test_gpu_benchmark_shape(implementation, k_cand):
  rng = np.random.default_rng(11)
  index = random_index(rng, 15, 1023, empty_users=1)  # odd count, one empty user
  args = random_lce_args(11, BENCH_SHAPE["m"], BENCH_SHAPE["k_user"], k_cand, BENCH_SHAPE["n"],
                         15, 1023, jnp.bfloat16)
  _check(implementation, jnp.bfloat16, args, index, interpret=False)


@pytest.mark.gpu
@pytest.mark.big_memory
def test_gpu_mosaic_gradients_at_benchmark_shape():
  """Every cotangent of the Mosaic path within 2x the same-precision XLA error."""
  rng = np.random.default_rng(14)
  index = random_index(rng, 15, 1023, empty_users=1)
  args = random_lce_args(14, BENCH_SHAPE["m"], BENCH_SHAPE["k_user"], BENCH_SHAPE["k_cand"],
                         BENCH_SHAPE["n"], 15, 1023, jnp.bfloat16)
  d_out = jax.random.normal(jax.random.key(15), (1023, BENCH_SHAPE["m"], BENCH_SHAPE["n"]),
                            jnp.bfloat16)
  vjp = lambda impl, a, d: jax.vjp(
      lambda *x: linear_compression(*x, index, implementation=impl), *a)[1](d)
  grads = vjp("mosaic_gpu", args, d_out)
  same_precision = vjp("xla_materialized", args, d_out)
  f32 = vjp("xla_materialized", [a.astype(jnp.float32) for a in args], d_out.astype(jnp.float32))
  for g, s, r in zip(grads, same_precision, f32):
    assert_within_reference_error(g, s, r)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["triton", "mosaic_gpu"])
def test_gpu_small_ragged_shapes(implementation):
  for dtype in KERNEL_DTYPES[implementation]:
    args, index = _problem(12, dtype, num_candidates=9)
    _check(implementation, dtype, args, index, interpret=False)


class TestWithAndWithoutJit(chex.TestCase):
  """chex variants: the op's dispatch and validation hold traced and eagerly."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("xla", "xla_materialized")
  def test_matches_float32_reference(self, implementation):
    args, index = _problem(31, jnp.float32)
    op = self.variant(lambda *a: linear_compression(*a, index, implementation=implementation))
    out = op(*args)
    chex.assert_shape(out, (index.num_candidates, SMALL[0], SMALL[3]))
    chex.assert_trees_all_close(out, _f32_reference(args, index), rtol=1e-5, atol=1e-5)


# Defect: Mosaic GPU linear compression wrong for N <= 64 (a consumer's store
# past a 64-wide dimension landed on the other consumer's columns).
@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k_user, k_cand", [
    (96, 64, 128, 256), (70, 64, 128, 256), (64, 64, 64, 64), (96, 33, 40, 64), (40, 130, 16, 8)])
def test_gpu_lce_mosaic_small_n_and_m(m, n, k_user, k_cand):
  case = sweep.LinearCompressionCase(
      seed=m + n, mapping=sweep.Mapping(20, 300, 2, False), m=m, n=n, k_user=k_user,
      k_cand=k_cand, dtype="bfloat16")
  sweep.assert_passes(case, ("mosaic_gpu",))


@pytest.mark.gpu
def test_gpu_lce_mosaic_two_launch_forward_n64():
  """The two-launch forward (user GEMM in XLA first) at the reported shape."""
  mapping = sweep.Mapping(20, 300, 0, False)
  index = mapping.index(np.random.default_rng(0))
  args = random_lce_args(0, 96, 128, 256, 64, 20, 300, jnp.bfloat16)
  out, _ = linear_compression_mosaic.forward(*args, index.cand_to_user, interpret=False,
                                             single_launch=False)
  same = references.linear_compression(*args, index.cand_to_user)
  f32 = references.linear_compression(*[a.astype(jnp.float32) for a in args],
                                      index.cand_to_user, precision="highest")
  error_rule.assert_within_reference_error("out", out, same, f32, jnp.bfloat16)
