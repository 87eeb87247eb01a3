"""Target attention on the Mosaic GPU packed-query kernel: interpreter, H200 lowering and GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from ikbo_jax import CandidateIndex, target_attention
from ikbo_jax.testing import sweep
from ikbo_jax.testing.problems import (
    assert_within_reference_error, random_attention_args, random_index)


def _problem(seed, num_users, num_cands, t, s, h, d, dtype=jnp.bfloat16, empty_users=1):
  rng = np.random.default_rng(seed)
  index = random_index(rng, num_users, num_cands, empty_users=empty_users)
  return random_attention_args(seed, num_users, num_cands, t, s, h, d, dtype), index


def _check_forward(args, index, kv_len, **kwargs):
  out, lse = target_attention(*args, index, kv_len=kv_len, return_lse=True,
                              implementation="mosaic_gpu", **kwargs)
  same, same_lse = target_attention(*args, index, kv_len=kv_len, return_lse=True,
                                    implementation="xla_materialized")
  f32, f32_lse = target_attention(*[a.astype(jnp.float32) for a in args], index, kv_len=kv_len,
                                  return_lse=True, implementation="xla_materialized")
  assert out.dtype == args[0].dtype and out.shape == args[0].shape
  assert_within_reference_error(out, same, f32)
  finite = np.isfinite(np.asarray(f32_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(f32_lse)[finite],
                             atol=2 * float(np.max(np.abs(same_lse - f32_lse)[finite])) + 1e-3)
  ids = np.asarray(index.cand_to_user)
  np.testing.assert_array_equal(np.asarray(out)[np.asarray(kv_len)[ids] == 0], 0)


@pytest.mark.parametrize("t", [128, 24])
def test_interpret_forward_packs_any_n_seed(t):
  # 9 candidates of 4 users (one without candidates, odd counts, unsorted);
  # S = 200 is not a multiple of the 128-key block; lengths 0, 1 and S.
  args, index = _problem(t, num_users=4, num_cands=9, t=t, s=200, h=2, d=64)
  kv_len = jnp.array([200, 1, 0, 131])
  _check_forward(args, index, kv_len, interpret=True)


def test_interpret_single_user_head_dim_128_float16():
  args, index = _problem(1, num_users=1, num_cands=3, t=64, s=128, h=1, d=128,
                         dtype=jnp.float16, empty_users=0)
  _check_forward(args, index, jnp.array([97]), interpret=True)


def test_mosaic_gpu_rejects_float32_and_unsupported_head_dims():
  args, index = _problem(3, num_users=2, num_cands=3, t=16, s=64, h=1, d=64)
  with pytest.raises(TypeError, match="bfloat16 and float16"):
    target_attention(*[a.astype(jnp.float32) for a in args], index,
                     implementation="mosaic_gpu", interpret=True)
  args, index = _problem(3, num_users=2, num_cands=3, t=16, s=64, h=1, d=32)
  with pytest.raises(ValueError, match="D=32"):
    target_attention(*args, index, implementation="mosaic_gpu", interpret=True)


def _abstract_h200():
  return jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=AbstractDevice(
      device_kind="NVIDIA H200", platform="cuda", num_cores=132)))


@pytest.mark.parametrize("t,d", [(64, 128), (16, 128), (32, 64), (128, 64)])
def test_lowers_for_h200_at_benchmark_shape(t, d, monkeypatch):
  """Real CUDA lowering (forward, and forward + backward) of the benchmark configuration."""
  from ikbo_jax import platform
  monkeypatch.setattr(platform, "default_platform", lambda: "gpu")
  monkeypatch.setattr(platform, "is_hopper", lambda: True)
  num_cands, num_users, seq_len, heads = 2048, 32, 1024, 2
  q = jax.ShapeDtypeStruct((num_cands, t, heads, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((num_users, seq_len, heads, d), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((num_cands,), jnp.int32)
  lengths = jax.ShapeDtypeStruct((num_users,), jnp.int32)

  def forward(q, k, v, ids, kv_len):
    index = CandidateIndex.from_mapping(ids, num_users)
    return target_attention(q, k, v, index, kv_len=kv_len)

  def forward_backward(q, k, v, ids, kv_len):
    return jax.grad(lambda *a: jnp.sum(forward(*a, ids, kv_len).astype(jnp.float32) ** 2),
                    argnums=(0, 1, 2))(q, k, v)

  def forward_one_cta_per_item(q, k, v, ids, kv_len):
    from ikbo_jax.kernels.mosaic_gpu.target_attention import Config
    from ikbo_jax.ops.target_attention import mosaic_gpu as target_attention_mosaic
    return target_attention_mosaic.aligned_forward(
        q, k, v, CandidateIndex.from_mapping(ids, num_users), kv_len, scale=0.1,
        save_lse=True, config=Config(persistent=False))

  with _abstract_h200():
    for fn in (forward, forward_backward, forward_one_cta_per_item):
      text = jax.jit(fn).trace(q, kv, kv, ids, lengths).lower(
          lowering_platforms=("cuda",)).as_text()
      assert "ikbo_target_attention_mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("t", [16, 32, 64, 128])
def test_gpu_forward_and_gradients_at_benchmark_heads(t):
  """255 candidates of 5 users (one empty), H=2, D=128, S=1024 with jagged lengths."""
  args, index = _problem(10 + t, num_users=5, num_cands=255, t=t, s=1024, h=2, d=128)
  kv_len = jnp.array([1024, 1, 500, 0, 777])
  _check_forward(args, index, kv_len)
  cotangent = jax.random.normal(jax.random.key(t), args[0].shape, jnp.float32)

  def grad_fn(implementation):
    loss = lambda *a: jnp.sum(target_attention(
        *a, index, kv_len=kv_len, implementation=implementation).astype(jnp.float32) * cotangent)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

  grads = grad_fn("mosaic_gpu")(*args)
  same = grad_fn("xla_materialized")(*args)
  f32 = grad_fn("xla_materialized")(*[a.astype(jnp.float32) for a in args])
  for g, s, r in zip(grads, same, f32):
    assert_within_reference_error(g, s, r)
  # dk/dv are summed per user inside one program (no atomics): bitwise repeatable.
  for g, again in zip(grads, grad_fn("mosaic_gpu")(*args)):
    np.testing.assert_array_equal(g, again)


@pytest.mark.parametrize("t", [128])
def test_interpret_persistent_equals_one_cta_per_item(t):
  """Two simulated SMs each running many (tile, head) items equal one CTA per item
  (this also checks that each item computes with its own queries, loaded one item ahead)."""
  from ikbo_jax.kernels.mosaic_gpu.target_attention import Config
  from ikbo_jax.ops.target_attention import mosaic_gpu as target_attention_mosaic
  (q, k, v), index = _problem(20 + t, num_users=4, num_cands=9, t=t, s=256, h=2, d=64)
  kv_len = jnp.array([256, 1, 0, 131])
  out, lse = target_attention_mosaic.aligned_forward(
      q, k, v, index, kv_len, scale=0.125, save_lse=True, config=Config(persistent=False),
      interpret=True)
  ref, ref_lse = target_attention_mosaic.aligned_forward(
      q, k, v, index, kv_len, scale=0.125, save_lse=True, config=Config(), interpret=True)
  # The same arithmetic in two XLA graphs: equal up to rounding (XLA promises no
  # bit patterns across graphs or machines).
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             rtol=2**-7, atol=1e-6)
  np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-6)


def test_interpret_lazy_rescale_within_reference_error():
  """The running max kept until a block's exceeds it by 2**8 (the default) against eager
  rescaling and the float32 reference, with logits spread wide enough (scaled queries) that
  some blocks move the max and others do not."""
  from ikbo_jax.kernels.mosaic_gpu.target_attention import Config
  from ikbo_jax.ops.target_attention import mosaic_gpu as target_attention_mosaic
  (q, k, v), index = _problem(8, num_users=3, num_cands=7, t=32, s=384, h=1, d=64)
  q = (q.astype(jnp.float32) * 4).astype(q.dtype)
  kv_len = jnp.array([384, 200, 0])
  out, lse = target_attention_mosaic.aligned_forward(
      q, k, v, index, kv_len, scale=0.125, save_lse=True, config=Config(), interpret=True)
  _, eager_lse = target_attention_mosaic.aligned_forward(
      q, k, v, index, kv_len, scale=0.125, save_lse=True, config=Config(lazy_rescale=False),
      interpret=True)
  same, f32 = [target_attention(*[a.astype(dtype) for a in (q, k, v)], index, kv_len=kv_len,
                                scale=0.125, implementation="xla")
               for dtype in (q.dtype, jnp.float32)]
  assert_within_reference_error(out, same, f32)
  np.testing.assert_allclose(lse, eager_lse, rtol=1e-5, atol=1e-5)


# The Mosaic GPU backward (dq per query tile, dk/dv per user in one CTA) under
# the interpreter: T that packs and T that spans blocks, S = 1 and S past a
# block, lengths 0, 1 and S, users without candidates, unsorted mappings.
_BACKWARD_CASES = (
    sweep.AttentionCase(0, sweep.Mapping(3, 7, 0, False), 7, 130, 2, 64, (130, 1, 0), "bfloat16"),
    sweep.AttentionCase(1, sweep.Mapping(2, 12, 0, False), 65, 200, 1, 64, (200, 65), "float16"),
    sweep.AttentionCase(2, sweep.Mapping(4, 30, 1, True), 1, 1, 2, 128, (1, 1, 0, 1), "bfloat16"),
)


@pytest.mark.parametrize("case", _BACKWARD_CASES, ids=["t7", "t65", "s1"])
def test_interpret_hopper_backward_within_reference_error(case):
  (result,) = sweep.run_case(case, ("mosaic_gpu",), interpret=True)
  assert result.ok, result.describe()


# The published shape's XLA reference needs 6 GiB at once: more than a gate worker's share
# of an H100 (0.15 of 80 GB, with the worker's other buffers), so it runs with the whole card.
@pytest.mark.gpu
@pytest.mark.parametrize("case", _BACKWARD_CASES + (
    sweep.AttentionCase(3, sweep.Mapping(3, 64, 0, False), 7, 2000, 2, 64, (1, 1500, 2000),
                        "bfloat16"),
    pytest.param(sweep.AttentionCase(4, sweep.Mapping(32, 2048, 0, False), 64, 1024, 2, 128,
                                     (1024,) * 32, "bfloat16"),
                 marks=pytest.mark.big_memory)),
    ids=["t7", "t65", "s1", "one_key", "published"])
def test_gpu_hopper_backward_within_reference_error(case):
  (result,) = sweep.run_case(case, ("mosaic_gpu",))
  assert result.ok, result.describe()
