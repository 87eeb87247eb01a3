"""Two levels of sharing (user -> group -> item): the index and linear compression over three
sources, every implementation (kernels under the interpreters) against the float32 reference."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.experimental import checkify

from ikbo_jax import (CandidateIndex, TwoLevelIndex, linear_compression,
                      two_level_linear_compression)
from ikbo_jax.testing import sweep
from ikbo_jax.testing.problems import rel_err

KERNELS = ("triton", "mosaic_gpu")


def _case(mapping, dtype="bfloat16", seed=0, m=20, n=24, ks=(12, 9, 14)):
  return sweep.TwoLevelLinearCompressionCase(seed, mapping, m, n, *ks, dtype)


# Small shapes with uneven levels: one group, a group per item, groups without items, users
# without groups, sorted and shuffled.
CASES = {
    "uneven_shuffled": _case(sweep.TwoLevelMapping(3, 7, 40, 2, 1, False)),
    "one_group": _case(sweep.TwoLevelMapping(1, 1, 17, 0, 0, False), seed=2),
    "group_per_item": _case(sweep.TwoLevelMapping(2, 13, 13, 0, 0, False), seed=3),
    "float16_many_groups": _case(sweep.TwoLevelMapping(2, 30, 31, 5, 0, False), "float16", 4),
}


@pytest.mark.parametrize("name", ["uneven_shuffled", "one_group", "float16_many_groups"])
def test_xla_paths_within_the_error_rule(name):
  sweep.assert_passes(CASES[name], ("xla_materialized", "xla"))


@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("name", ["uneven_shuffled", "group_per_item"])
def test_interpreted_kernels_within_the_error_rule(implementation, name):
  sweep.assert_passes(CASES[name], (implementation,), interpret=True)


def test_float32_paths_within_the_error_rule():
  case = dataclasses.replace(CASES["uneven_shuffled"], dtype="float32")
  sweep.assert_passes(case, ("xla_materialized", "xla"))
  sweep.assert_passes(case, ("triton",), interpret=True)


@st.composite
def _structures(draw):
  """Mappings of 24 items onto 9 groups onto 5 users (fixed shapes: one compilation), into
  a drawn number of live groups and users: uneven levels, groups without items, users
  without groups, one group, one user."""
  live_users = draw(st.integers(1, 5))
  live_groups = draw(st.integers(1, 9))
  group_to_user = draw(st.lists(st.integers(0, live_users - 1), min_size=9, max_size=9))
  item_to_group = draw(st.lists(st.integers(0, live_groups - 1), min_size=24, max_size=24))
  return draw(st.permutations(item_to_group)), group_to_user, 5


def _args(index, seed=0, m=6, n=5, ks=(4, 3, 7), dtype=jnp.float32):
  keys = jax.random.split(jax.random.key(seed), 6)
  rows = (index.num_users, index.num_groups, index.num_items)
  shapes = [(m, k) for k in ks] + [(r, k, n) for r, k in zip(rows, ks)]
  return tuple(jax.random.normal(key, s).astype(dtype) for key, s in zip(keys, shapes))


@functools.partial(jax.jit, static_argnums=0)
def _vjp(implementation, index, args, cotangent):
  out, pullback = jax.vjp(lambda *a: two_level_linear_compression(
      *a, index, implementation=implementation), *args)
  return out, pullback(cotangent)


@settings(max_examples=20, deadline=None)
@given(_structures())
def test_any_index_structure_matches_the_materialized_op_forward_and_backward(structure):
  index = TwoLevelIndex.from_mappings(*structure[:2], num_users=structure[2])
  args = _args(index)
  cotangent = jax.random.normal(jax.random.key(9), (index.num_items, 6, 5))

  (out, grads), (want, want_grads) = (_vjp(implementation, index, args, cotangent)
                                      for implementation in ("xla", "xla_materialized"))
  assert rel_err(out, want) < 1e-5
  for grad, want_grad in zip(grads, want_grads):
    np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-4)


def test_equals_one_level_compression_with_the_group_level_copied():
  index = TwoLevelIndex.from_mappings([2, 0, 2, 1, 1, 2], group_to_user=[1, 1, 0], num_users=3)
  w_user, w_group, w_item, e_user, e_group, e_item = _args(index)
  two = two_level_linear_compression(w_user, w_group, w_item, e_user, e_group, e_item, index)
  one = linear_compression(w_user, jnp.concatenate([w_group, w_item], axis=1), e_user,
                           jnp.concatenate([e_group[index.items.cand_to_user], e_item], axis=1),
                           index.item_to_user)
  np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", *KERNELS])
def test_rows_the_original_never_reads_reach_no_gradient(implementation):
  """A group without items and a user without groups hold NaN and Inf: the original never
  reads them, so every gradient stays finite and theirs are zero."""
  index = TwoLevelIndex.from_mappings([0, 0, 2, 2, 0], group_to_user=[0, 2, 0, 1], num_users=3)
  args = list(_args(index, dtype=jnp.bfloat16))
  args[4] = args[4].at[jnp.array([1, 3])].set(jnp.array([jnp.nan, jnp.inf], jnp.bfloat16)[:, None, None])
  args[3] = args[3].at[1:].set(jnp.nan)  # user 1 has only group 3 (no items); user 2 none

  def loss(*a):
    out = two_level_linear_compression(*a, index, implementation=implementation,
                                       interpret=implementation in KERNELS)
    return out.astype(jnp.float32).sum()

  grads = jax.grad(loss, argnums=tuple(range(6)))(*args)
  for name, grad in zip(["w_user", "w_group", "w_item", "e_user", "e_group", "e_item"], grads):
    assert np.isfinite(np.asarray(grad, np.float32)).all(), name
  np.testing.assert_array_equal(np.asarray(grads[4], np.float32)[[1, 3]], 0)
  np.testing.assert_array_equal(np.asarray(grads[3], np.float32)[1:], 0)


def test_the_index_composes_the_levels_and_is_a_pytree():
  index = TwoLevelIndex.from_mappings(np.array([1, 0, 1, 3], np.int64), [2, 0, 0, 1],
                                      num_users=3)
  assert index.item_to_user.cand_to_user.tolist() == [0, 2, 0, 1]
  assert index.items.user_counts.tolist() == [1, 2, 0, 1]
  assert index.groups.user_counts.tolist() == [2, 1, 1]
  leaves, tree = jax.tree.flatten(index)
  assert len(leaves) == 12
  again = jax.jit(lambda i: i)(index)
  assert isinstance(again, TwoLevelIndex) and again.num_groups == 4
  args = _args(index)
  jitted = jax.jit(lambda i, *a: two_level_linear_compression(*a, i))(index, *args)
  np.testing.assert_allclose(jitted, two_level_linear_compression(*args, index), rtol=1e-6)


def test_one_group_per_item_is_the_one_level_index():
  one = CandidateIndex.from_mapping(jnp.array([1, 0, 1]), num_users=2)
  two = TwoLevelIndex.one_group_per_item(one)
  assert two.num_groups == 3 and two.item_to_user.cand_to_user.tolist() == [1, 0, 1]


def test_out_of_range_ids_are_clamped_and_checked_mode_raises():
  index = TwoLevelIndex.from_mappings([0, 3], group_to_user=[0, 1], num_users=2)
  clamped = TwoLevelIndex.from_mappings([0, 1], group_to_user=[0, 1], num_users=2)
  args = _args(index)
  np.testing.assert_array_equal(two_level_linear_compression(*args, index),
                                two_level_linear_compression(*args, clamped))
  with pytest.raises(checkify.JaxRuntimeError, match=r"cand_to_user values must lie in \[0, num_users=2\); got min 0, max 3"):
    two_level_linear_compression(*args, index, checked=True)
  bad_users = TwoLevelIndex.from_mappings([0, 1], group_to_user=[0, -1], num_users=2)
  with pytest.raises(checkify.JaxRuntimeError, match="got min -1"):
    bad_users.check()


def test_bad_input_names_the_argument_expected_and_actual():
  index = TwoLevelIndex.from_mappings([0, 1, 1], group_to_user=[0, 0], num_users=1)
  args = _args(index)
  with pytest.raises(TypeError, match="item_to_group must be an integer array, got dtype float32"):
    TwoLevelIndex.from_mappings(np.array([0.0, 1.0], np.float32), [0, 0], num_users=1)
  with pytest.raises(ValueError, match=r"group_to_user must have rank 1 \[num_groups\], got shape \(2, 1\)"):
    TwoLevelIndex.from_mappings([0], [[0], [0]], num_users=1)
  with pytest.raises(ValueError, match="group_to_user is empty"):
    TwoLevelIndex.from_mappings([0], [], num_users=1)
  with pytest.raises(ValueError, match="items maps to 2 groups but groups has 3"):
    TwoLevelIndex(index.items, CandidateIndex.from_mapping(jnp.array([0, 0, 0]), 1),
                  index.item_to_user)
  wrong_groups = args[:4] + (args[4][:1],) + args[5:]
  with pytest.raises(ValueError, match=r"e_group.shape\[0\] \(G, from index.num_groups\) must be 2, got 1"):
    two_level_linear_compression(*wrong_groups, index)
  wrong_k = args[:5] + (args[5][:, :3],)
  with pytest.raises(ValueError, match=r"e_item.shape\[1\] \(K, from w_item\) must be 7, got 3"):
    two_level_linear_compression(*wrong_k, index)
  with pytest.raises(TypeError, match="index must be a TwoLevelIndex, got CandidateIndex"):
    two_level_linear_compression(*args, index.item_to_user)


def test_the_module_matches_copying_both_levels_and_one_dense_map():
  from flax import nnx

  from ikbo_jax.nn import TwoLevelLinearCompression

  layer = TwoLevelLinearCompression(4, 3, 7, 6, rngs=nnx.Rngs(0))
  index = TwoLevelIndex.from_mappings([1, 0, 1, 2, 2], group_to_user=[1, 0, 1], num_users=2)
  _, _, _, e_user, e_group, e_item = _args(index, n=5)

  def copied(w_user, w_group, w_item):
    e = jnp.concatenate([e_user[index.item_to_user.cand_to_user],
                         e_group[index.items.cand_to_user], e_item], axis=1)
    w = jnp.concatenate([w_user, w_group, w_item], axis=1)
    return jnp.einsum("mk,bkn->bmn", w, e, precision="highest")

  weights = (layer.w_user[...], layer.w_group[...], layer.w_item[...])
  np.testing.assert_allclose(layer(e_user, e_group, e_item, index), copied(*weights),
                             rtol=1e-5, atol=1e-5)
  grads = nnx.grad(lambda m: jnp.sum(jnp.sin(m(e_user, e_group, e_item, index))))(layer)
  want = jax.grad(lambda *w: jnp.sum(jnp.sin(copied(*w))), argnums=(0, 1, 2))(*weights)
  for got, w in zip((grads.w_user[...], grads.w_group[...], grads.w_item[...]), want):
    np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-5)


def test_mosaic_gpu_forward_and_backward_lower_for_the_h200_at_the_benchmark_widths(monkeypatch):
  """Real CUDA lowering of the two-level op at the benchmark's widths (G = 128, U = 16),
  without a GPU: the kernels' configurations for K_item = 866 and the padded group rows."""
  from jax.sharding import AbstractDevice, AbstractMesh

  from ikbo_jax import platform
  monkeypatch.setattr(platform, "default_platform", lambda: "gpu")
  monkeypatch.setattr(platform, "is_hopper", lambda: True)
  b, g, u, m, n, ks = 2048, 128, 16, 433, 256, (1178, 512, 866)
  specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in (
      *[(m, k) for k in ks], (u, ks[0], n), (g, ks[1], n), (b, ks[2], n))]
  index = TwoLevelIndex.from_mappings(np.arange(b) % g, np.arange(g) % u, num_users=u)
  op = lambda *a: two_level_linear_compression(*a, index, implementation="mosaic_gpu")
  fwd_bwd = lambda d, *a: jax.vjp(op, *a)[1](d)
  d_out = jax.ShapeDtypeStruct((b, m, n), jnp.bfloat16)
  h200 = AbstractMesh((), (), abstract_device=AbstractDevice(
      device_kind="NVIDIA H200", platform="cuda", num_cores=132))
  with jax.sharding.use_abstract_mesh(h200):
    text = jax.jit(op).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    bwd_text = jax.jit(fwd_bwd).trace(d_out, *specs).lower(lowering_platforms=("cuda",)).as_text()
  assert "ikbo_linear_compression_mosaic_gpu" in text
  assert "ikbo_linear_compression_weight_grad_mosaic_gpu" in bwd_text
  # The group rows are computed at the kernel's padded M, never at M and copied.
  assert "128x448x256xf32" in text and "128x433x256xf32" not in text
