"""Two-level target attention: items over their user's and their group's histories, one
softmax; every implementation (kernels under the interpreters) against the float32 reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ikbo_jax import TwoLevelIndex, target_attention, two_level_target_attention
from ikbo_jax.ops.two_level_target_attention import merge_regions
from ikbo_jax.testing import sweep


def _case(mapping, kv_user, kv_group, dtype="bfloat16", seed=0, t=3, s_user=40, s_group=9,
          heads=2, head_dim=64):
  return sweep.TwoLevelAttentionCase(seed, mapping, t, s_user, s_group, heads, head_dim,
                                     kv_user, kv_group, dtype)


# Lengths of 0 in either region and in both (an item with no key at all), S of 1, a full
# history, uneven levels, sorted and shuffled.
CASES = {
    "uneven": _case(sweep.TwoLevelMapping(3, 6, 20, 1, 1, False), (40, 0, 17),
                    (9, 0, 1, 5, 0, 9)),
    "float16_one_position": _case(sweep.TwoLevelMapping(2, 3, 7, 0, 0, True), (1, 0),
                                  (1, 1, 0), "float16", s_user=1, s_group=1, seed=1,
                                  head_dim=128),
}


@pytest.mark.parametrize("name", list(CASES))
def test_xla_paths_within_the_error_rule(name):
  sweep.assert_passes(CASES[name], ("xla_materialized", "xla"))


@pytest.mark.parametrize("implementation", ["triton", "mosaic_gpu"])
def test_interpreted_kernels_within_the_error_rule(implementation):
  case = dataclasses.replace(CASES["uneven"], mapping=sweep.TwoLevelMapping(2, 3, 6, 1, 0, False),
                             kv_len_user=(40, 3), kv_len_group=(9, 0, 4), n_seed=1, heads=1)
  sweep.assert_passes(case, (implementation,), interpret=True)


def test_the_mosaic_forward_is_one_launch_over_both_regions(monkeypatch):
  from ikbo_jax.kernels.mosaic_gpu import target_attention as kernel
  launches = []
  real = kernel.forward
  monkeypatch.setattr(kernel, "forward", lambda *a, **kw: launches.append(kw) or real(*a, **kw))
  index = TwoLevelIndex.from_mappings([0, 2, 1, 1, 0, 2], group_to_user=[1, 0, 1], num_users=2)
  ks = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(ks[0], (6, 3, 1, 64), jnp.bfloat16)
  k_user, v_user = (jax.random.normal(k, (2, 40, 1, 64), jnp.bfloat16) for k in ks[1:3])
  k_group, v_group = (jax.random.normal(k, (3, 9, 1, 64), jnp.bfloat16) for k in ks[3:5])
  lengths = dict(kv_len_user=jnp.array([40, 3]), kv_len_group=jnp.array([9, 0, 4]))
  args = (q, k_user, v_user, k_group, v_group, index)
  out = two_level_target_attention(*args, **lengths, implementation="mosaic_gpu", interpret=True)
  assert len(launches) == 1 and launches[0]["group"] is not None
  want = two_level_target_attention(*args, **lengths, implementation="xla")
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                             rtol=2e-2, atol=2e-2)


def test_float32_within_the_error_rule():
  sweep.assert_passes(dataclasses.replace(CASES["uneven"], dtype="float32"),
                      ("xla_materialized", "xla"))


def test_with_an_empty_group_history_it_is_one_level_attention_over_the_user():
  index = TwoLevelIndex.from_mappings([0, 1, 1, 0], group_to_user=[1, 0], num_users=2)
  ks = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(ks[0], (4, 2, 1, 16))
  k_user, v_user = (jax.random.normal(k, (2, 8, 1, 16)) for k in ks[1:3])
  k_group, v_group = (jax.random.normal(k, (2, 3, 1, 16)) for k in ks[3:5])
  out = two_level_target_attention(q, k_user, v_user, k_group, v_group, index,
                                   kv_len_group=jnp.zeros(2, jnp.int32))
  one = target_attention(q, k_user, v_user, index.item_to_user)
  np.testing.assert_allclose(out, one, rtol=1e-6, atol=1e-6)


def test_regions_without_keys_merge_to_zero_with_finite_gradients():
  out = jnp.zeros((1, 1, 1, 4))
  parts = [(out, jnp.full((1, 1, 1), -jnp.inf)), (out, jnp.full((1, 1, 1), -jnp.inf))]
  merged, lse = merge_regions(parts)
  assert float(lse[0, 0, 0]) == -np.inf and not merged.any()
  grads = jax.grad(lambda p: merge_regions(p)[0].sum() + 0 * merge_regions(p)[1].sum())(parts)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_no_per_group_copy_of_the_user_history_is_made():
  """The user region is read by the composed item -> user mapping: no `[G, S_user, ...]`
  (nor `[B, S_user, ...]`) tensor appears in the computation, forward or backward."""
  g, b, s_user = 6, 20, 40
  case = CASES["uneven"]
  index = case.mapping.index(np.random.default_rng(0))
  args = [jnp.zeros(shape, jnp.float32) for shape in
          ((b, 3, 2, 64), (3, s_user, 2, 64), (3, s_user, 2, 64), (g, 9, 2, 64), (g, 9, 2, 64))]
  step = lambda *a: jax.grad(lambda *x: two_level_target_attention(
      *x, index, implementation="xla").sum(), argnums=(0, 1, 2, 3, 4))(*a)
  shapes = {tuple(v.aval.shape) for eqn in jax.make_jaxpr(step)(*args).eqns
            for v in eqn.outvars if hasattr(v.aval, "shape")}
  copies = [s for s in shapes if len(s) == 4 and s[0] in (g, b) and s[1] == s_user]
  assert not copies, copies


def test_bad_input_names_the_argument_expected_and_actual():
  index = TwoLevelIndex.from_mappings([0, 1], group_to_user=[0, 0], num_users=1)
  q = jnp.zeros((2, 1, 2, 16))
  k_user = jnp.zeros((1, 4, 2, 16))
  with pytest.raises(ValueError, match=r"k_group.shape\[0\] \(G, from index.num_groups\) must be 2, got 3"):
    two_level_target_attention(q, k_user, k_user, jnp.zeros((3, 4, 2, 16)),
                               jnp.zeros((3, 4, 2, 16)), index)
  with pytest.raises(ValueError, match=r"k_group.shape\[2\] \(H, from q\) must be 2, got 1"):
    two_level_target_attention(q, k_user, k_user, jnp.zeros((2, 4, 1, 16)),
                               jnp.zeros((2, 4, 1, 16)), index)
  with pytest.raises(TypeError, match="index must be a TwoLevelIndex"):
    two_level_target_attention(q, k_user, k_user, k_user, k_user, index.items)


def test_draws_cover_the_promised_space():
  cases = [sweep.draw_two_level_attention_case(s) for s in range(200)]
  assert {0, 1} <= {n for c in cases for n in c.kv_len_user}
  assert {0, 1} <= {n for c in cases for n in c.kv_len_group}
  assert min(c.seq_len_user for c in cases) == 1 and max(c.seq_len_user for c in cases) >= 1024
  assert any(c.mapping.empty_groups for c in cases) and {64, 128} == {c.head_dim for c in cases}


def test_the_module_equals_multi_head_attention_over_both_histories_copied():
  from flax import nnx

  from ikbo_jax.nn import TwoLevelTargetAttention

  attn = TwoLevelTargetAttention(num_heads=2, history_features=12, item_features=10,
                                 qkv_features=32, rngs=nnx.Rngs(0))
  index = TwoLevelIndex.from_mappings([0, 1, 1, 2], group_to_user=[1, 0, 1], num_users=2)
  ks = jax.random.split(jax.random.key(1), 3)
  user_seq = jax.random.normal(ks[0], (2, 7, 12))
  group_seq = jax.random.normal(ks[1], (3, 4, 12))
  tokens = jax.random.normal(ks[2], (4, 3, 10))
  kv_user, kv_group = jnp.array([7, 2]), jnp.array([4, 0, 1])
  out = attn(user_seq, group_seq, tokens, index, kv_len_user=kv_user, kv_len_group=kv_group)

  mha = nnx.MultiHeadAttention(num_heads=2, in_features=10, qkv_features=32, out_features=10,
                               in_kv_features=12, decode=False, rngs=nnx.Rngs(0))
  for name in ("query", "key", "value", "out"):
    getattr(mha, name).kernel[...] = getattr(attn, name).kernel[...]
    getattr(mha, name).bias[...] = getattr(attn, name).bias[...]
  users, groups = index.item_to_user.cand_to_user, index.items.cand_to_user
  history = jnp.concatenate([user_seq[users], group_seq[groups]], axis=1)
  valid = jnp.concatenate([jnp.arange(7) < kv_user[users][:, None],
                           jnp.arange(4) < kv_group[groups][:, None]], axis=1)
  want = mha(tokens, history, mask=valid[:, None, None, :])
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_lowers_for_cuda_in_one_launch_at_benchmark_shape(monkeypatch):
  """Real CUDA lowering of the one-launch forward and its backward at the benchmark's shape."""
  from jax.sharding import AbstractDevice, AbstractMesh

  from ikbo_jax import platform
  monkeypatch.setattr(platform, "default_platform", lambda: "gpu")
  monkeypatch.setattr(platform, "is_hopper", lambda: True)
  b, g, u, t, h, d = 2048, 128, 16, 64, 2, 128
  spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  specs = (spec(b, t, h, d), *[spec(u, 1024, h, d)] * 2, *[spec(g, 256, h, d)] * 2,
           spec(b, dtype=jnp.int32), spec(g, dtype=jnp.int32))

  def forward(q, k_user, v_user, k_group, v_group, item_to_group, group_to_user):
    index = TwoLevelIndex.from_mappings(item_to_group, group_to_user, u)
    return two_level_target_attention(q, k_user, v_user, k_group, v_group, index)

  def forward_backward(*args):
    return jax.grad(lambda *a: jnp.sum(forward(*a, *args[5:]).astype(jnp.float32) ** 2),
                    argnums=(0, 1, 2, 3, 4))(*args[:5])

  mesh = AbstractMesh((), (), abstract_device=AbstractDevice(
      device_kind="NVIDIA H100 80GB HBM3", platform="cuda", num_cores=132))
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(forward).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("ikbo_two_level_target_attention_mosaic_gpu") >= 1
    assert "ikbo_target_attention_mosaic_gpu" not in text  # no per-region launch forward
    text = jax.jit(forward_backward).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert "ikbo_two_level_target_attention_mosaic_gpu" in text
