"""The rewrite on two nested broadcasts: `group[item_to_group]` and `user[group_to_user][item_to_group]`.

Hypothesis draws the index structure (groups without items, users without
groups, unsorted mappings, out-of-range ids at either level), how each level is
gathered (indexing, `jnp.take`'s fill, clip) and the layer over the three
levels; the rewritten program must give the original's outputs and every
gradient, and a 3-D stack must run as the two-level op wherever the two
gathers share their item index. CI runs a fixed, derandomized set; the long
profile runs on demand:

    IKBO_TWO_LEVEL_EXAMPLES=500 IKBO_TWO_LEVEL_SEED=1 python -m pytest -q \
        tests/test_rewrite_two_level.py
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from ikbo_jax import rewrite
from ikbo_jax.testing.rewrite_check import check_rewrite

WHERE = dict(mapping="item_to_group", users=("user", "group", "group_to_user"),
             candidates=("item",))
N = 4  # the embedding width of a 3-D stack
EXAMPLES = int(os.environ.get("IKBO_TWO_LEVEL_EXAMPLES", "20"))
SEED = int(os.environ.get("IKBO_TWO_LEVEL_SEED", "0"))


def _gather(style: str, x, ids):
  if style == "index":  # `x[ids]`: promise in bounds
    return x[ids]
  if style == "fill":
    return jnp.take(x, ids, axis=0)
  return jnp.take(x, ids, axis=0, mode="clip")


def _program(outer: str, inner: str, layer: str, group_work: bool):
  """`fn(user, group, group_to_user, item_to_group, item, w)` over the three levels."""

  def fn(user, group, group_to_user, item_to_group, item, w):
    at_groups = _gather(inner, user, group_to_user)  # user rows at G
    if group_work:
      at_groups = jnp.tanh(at_groups)
    u = _gather(outer, at_groups, item_to_group)
    g = _gather(outer, group, item_to_group)
    if layer == "compression":  # [B, K, N] stacked, contracted with [K, M]
      return jnp.einsum("bkn,km->bmn", jnp.concatenate([u, item, g], axis=1), w[:, 0])
    flat = lambda x: x.reshape(x.shape[0], -1)
    x = jnp.concatenate([flat(g), flat(item), jax.nn.relu(flat(u))], axis=1)
    return jax.nn.relu(x @ w.reshape(x.shape[1], -1))  # [K N, M]
  return fn


@st.composite
def _problems(draw):
  num_users, num_groups = draw(st.integers(1, 4)), draw(st.integers(1, 6))
  num_items = draw(st.integers(1, 12))
  lo, hi = (-2, 2) if draw(st.booleans()) else (0, 0)  # out-of-range ids, or none
  group_to_user = draw(st.lists(st.integers(lo, num_users - 1 + hi), min_size=num_groups,
                                max_size=num_groups))
  item_to_group = draw(st.lists(st.integers(lo, num_groups - 1 + hi), min_size=num_items,
                                max_size=num_items))
  if draw(st.booleans()):
    item_to_group = sorted(item_to_group)
  rng = np.random.default_rng(draw(st.integers(0, 2**16)))
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  k_user, k_group, k_item = 2, 3, 2
  args = (normal(num_users, k_user, N), normal(num_groups, k_group, N),
          jnp.asarray(group_to_user, jnp.int32), jnp.asarray(item_to_group, jnp.int32),
          normal(num_items, k_item, N), normal(k_user + k_group + k_item, N, 5))
  return args


@seed(SEED)
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          derandomize="IKBO_TWO_LEVEL_SEED" not in os.environ,
          suppress_health_check=list(HealthCheck))
@given(_problems(), st.sampled_from(["index", "fill", "clip"]),
       st.sampled_from(["index", "fill", "clip"]), st.sampled_from(["compression", "dense"]),
       st.booleans())
def test_two_nested_broadcasts_rewrite_to_the_same_computation(problem, outer, inner, layer,
                                                               group_work):
  args = problem
  fn = _program(outer, inner, layer, group_work)
  report = check_rewrite(fn, args, rtol=1e-5, atol=1e-5, **WHERE)
  assert report.count("materialized") == 0, report
  kind = "two_level_linear_compression" if layer == "compression" else "split_dense"
  assert report.count(kind) == 1, report


def test_the_two_level_op_computes_each_level_at_its_own_batch():
  """No gather of user or group rows to the items is left but the op's own."""
  fn = _program("index", "index", "compression", group_work=True)
  rng = np.random.default_rng(0)
  args = (jnp.asarray(rng.normal(size=(3, 2, N)), jnp.float32),
          jnp.asarray(rng.normal(size=(8, 3, N)), jnp.float32),
          jnp.asarray([0, 0, 1, 1, 1, 2, 2, 2], jnp.int32),
          jnp.asarray(rng.integers(0, 8, 64), jnp.int32),
          jnp.asarray(rng.normal(size=(64, 2, N)), jnp.float32),
          jnp.asarray(rng.normal(size=(7, N, 5)), jnp.float32))
  jaxpr = jax.make_jaxpr(rewrite.rewrite(fn, **WHERE))(*args)
  big_gathers = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "gather"
                 and e.outvars[0].aval.shape[0] == 64 and e.outvars[0].aval.ndim > 1]
  assert not big_gathers, big_gathers
  assert "two_level_linear_compression" in str(rewrite.explain(fn, *args, **WHERE))


@pytest.mark.parametrize("mapping", ["item_to_group", "group_to_user"])
def test_a_product_of_two_levels_that_is_not_one_nested_gather_runs_split(mapping):
  """A user part gathered by the items' users directly and a group part: two one-level parts."""

  def fn(user, group, item_to_user, item_to_group, item, w):
    x = jnp.concatenate([user[item_to_user], group[item_to_group], item], axis=1)
    return jnp.einsum("bkn,km->bmn", x, w)

  rng = np.random.default_rng(1)
  args = (jnp.asarray(rng.normal(size=(3, 2, N)), jnp.float32),
          jnp.asarray(rng.normal(size=(5, 3, N)), jnp.float32),
          jnp.asarray(rng.integers(0, 3, 10), jnp.int32),
          jnp.asarray(rng.integers(0, 5, 10), jnp.int32),
          jnp.asarray(rng.normal(size=(10, 2, N)), jnp.float32),
          jnp.asarray(rng.normal(size=(7, 5)), jnp.float32))
  where = dict(mapping="item_to_group", users=("user", "group")) if mapping == "item_to_group" \
      else dict(mapping="item_to_user", users=("user", "group"))
  report = check_rewrite(fn, args, **where)
  assert report.count("two_level_linear_compression") == 0


def test_attention_over_the_users_history_read_through_groups_is_target_attention():
  """Keys, values and lengths gathered user -> group -> item: one IKBO attention, no copy."""

  def fn(k_user, v_user, lengths, group_to_user, item_to_group, q):
    at_items = lambda x: x[group_to_user][item_to_group]
    return rewrite.attention(q, at_items(k_user), at_items(v_user), at_items(lengths))

  rng = np.random.default_rng(2)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  args = (normal(3, 6, 1, 8), normal(3, 6, 1, 8), jnp.asarray([6, 0, 2], jnp.int32),
          jnp.asarray([0, 2, 2, 1, 0], jnp.int32), jnp.asarray(rng.integers(0, 5, 9), jnp.int32),
          normal(9, 2, 1, 8))
  report = check_rewrite(fn, args, mapping="item_to_group",
                         users=("k_user", "v_user", "lengths", "group_to_user"), candidates=("q",))
  assert report.count("target_attention") == 1 and not report.count("materialized"), report
