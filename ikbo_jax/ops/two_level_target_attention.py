"""Target attention over two levels of history: an item attends to its user's history and to
its group's history, with one softmax over both.

`out[i] = softmax(scale * q[i] . [k_user[user(i), :kv_user], k_group[group(i), :kv_group]])
@ [v_user[user(i)], v_group[group(i)]]`

On the Mosaic GPU kernel both regions run in one launch, one online softmax over the
user's keys and then the group's (`two_level_target_attention_mosaic.py`). Elsewhere, and in
that path's backward, each region is one-level target attention reading its K/V by index (the
user region by the composed item -> user mapping: no `[G, S_user, ...]` per-group copy of the
user's history exists), returning its output and log-sum-exp; `merge_regions` combines them
exactly: the softmax over both regions is each region's softmax weighted by
`exp(lse_region - lse)`. Every backend of `target_attention` runs that form, with the
gradients of its own backward (the lse cotangent included) and the merge's by autodiff.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ikbo_jax import _dispatch
from ikbo_jax import _validation as checks
from ikbo_jax.ops import two_level_target_attention_mosaic as mosaic
from ikbo_jax.ops.target_attention import Implementation, target_attention
from ikbo_jax.ops.target_attention.api import BACKENDS, check_args, prepare_kv_len
from ikbo_jax.ops.target_attention.params import Params
from ikbo_jax.two_level_index import TwoLevelIndex

_F32 = jnp.float32


def merge_regions(parts):
  """`(out, lse)` of one softmax over several key regions, from each region's `(out, lse)`.

  A region without keys (`lse = -inf`, zero output) adds nothing; a row without keys in any
  region gets zero output and `lse = -inf`, with zero gradients (no `inf - inf`).
  """
  lses = jnp.stack([lse for _, lse in parts])
  # Any shift gives the same result: the largest keeps exp() in range, and is held constant
  # for the derivative.
  top = jax.lax.stop_gradient(jnp.max(lses, axis=0))
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  weights = jnp.exp(lses - top)
  total = jnp.sum(weights, axis=0)
  some_keys = total > 0
  safe_total = jnp.where(some_keys, total, 1.0)
  out = sum(w[..., None] * o.astype(_F32) for w, (o, _) in zip(weights, parts))
  out = out / safe_total[..., None]
  lse = jnp.where(some_keys, top + jnp.log(safe_total), -jnp.inf)
  return out.astype(parts[0][0].dtype), lse


def two_level_target_attention(q, k_user, v_user, k_group, v_group, index: TwoLevelIndex, *,
                               kv_len_user=None, kv_len_group=None, scale: float | None = None,
                               return_lse: bool = False,
                               implementation: Implementation | None = None,
                               checked: bool = False, interpret: bool = False):
  """Each item's queries attend to its user's and its group's histories, one softmax.

  Args:
    q: `[B, T, H, D]` item queries.
    k_user, v_user: `[U, S_user, H, D]` user histories, stored once per user.
    k_group, v_group: `[G, S_group, H, D]` group histories (a campaign's recent
      engagements, say), stored once per group.
    index: the `TwoLevelIndex` mapping items to groups and groups to users.
    kv_len_user: optional `int[U]`, each user's valid history length (default S_user).
    kv_len_group: optional `int[G]`, each group's valid history length (default S_group).
      An item with no valid key in either region gets zero output and `lse = -inf`.
    scale: the logit scale; default `1 / sqrt(D)`.
    return_lse: also return the float32 log-sum-exp over both regions, `[B, T, H]`.
    implementation, checked, interpret: as for `target_attention`, for both regions
      (`checked` also checks the groups' user ids).

  Returns:
    `[B, T, H, D]` in the input dtype, and the lse when `return_lse`.

  >>> import jax, jax.numpy as jnp
  >>> from ikbo_jax import TwoLevelIndex, two_level_target_attention
  >>> index = TwoLevelIndex.from_mappings([0, 1, 1], group_to_user=[0, 0], num_users=1)
  >>> ks = jax.random.split(jax.random.key(0), 5)
  >>> q = jax.random.normal(ks[0], (3, 2, 1, 8))         # 3 items, 2 query tokens
  >>> k_user = v_user = jax.random.normal(ks[1], (1, 16, 1, 8))
  >>> k_group = v_group = jax.random.normal(ks[2], (2, 4, 1, 8))
  >>> two_level_target_attention(q, k_user, v_user, k_group, v_group, index).shape
  (3, 2, 1, 8)
  """
  if not isinstance(index, TwoLevelIndex):
    raise TypeError(f"index must be a TwoLevelIndex, got {type(index).__name__}")
  checks.check_operands(q=(q, ("B", "T", "H", "D")), k_group=(k_group, ("G", "S_group", "H", "D")))
  for name, x in (("k_group", k_group), ("v_group", v_group)):
    checks.check_dim(name, x, 2, q.shape[2], "H, from q")
  checks.check_dim("k_group", k_group, 0, index.num_groups, "G, from index.num_groups")
  check_args(q, k_user, v_user, index.item_to_user, kv_len_user)
  check_args(q, k_group, v_group, index.items, kv_len_group)
  q, k_user, v_user, k_group, v_group = map(jnp.asarray, (q, k_user, v_user, k_group, v_group))
  dtype = checks.check_float_dtypes(q=q, k_user=k_user, v_user=v_user, k_group=k_group,
                                    v_group=v_group)
  interpret = checks.check_flag("interpret", interpret)
  implementation = _dispatch.resolve(BACKENDS, implementation, dtype, interpret=interpret,
                                     head_dim=q.shape[-1]).name
  params = Params(scale=checks.resolve_scale(scale, q.shape[-1]),
                  masked=kv_len_user is not None or kv_len_group is not None,
                  return_lse=checks.check_flag("return_lse", return_lse), interpret=interpret)
  checked = checks.check_flag("checked", checked)
  if checked:
    index.groups.check()
  kv_len_user = prepare_kv_len(kv_len_user, index.item_to_user, k_user.shape[1], checked)
  kv_len_group = prepare_kv_len(kv_len_group, index.items, k_group.shape[1], checked)
  operands = (q, k_user, v_user, k_group, v_group, index, kv_len_user, kv_len_group)
  if implementation == "mosaic_gpu":  # both regions in one launch
    _dispatch.reverse_mode_only("ikbo_jax.two_level_target_attention", q, k_user, v_user,
                                k_group, v_group)
    return mosaic.attention(params, _two_launches, *operands)
  out, lse = _two_launches(params, *operands, implementation=implementation)
  return (out, lse) if params.return_lse else out


def _two_launches(params: Params, q, k_user, v_user, k_group, v_group, index, kv_len_user,
                  kv_len_group, implementation: Implementation = "mosaic_gpu"):
  """`(out, lse)`: each region's one-level attention, merged (lengths already prepared)."""
  common = dict(scale=params.scale, return_lse=True, implementation=implementation,
                interpret=params.interpret)
  user_part = target_attention(q, k_user, v_user, index.item_to_user, kv_len=kv_len_user,
                               **common)
  group_part = target_attention(q, k_group, v_group, index.items, kv_len=kv_len_group,
                                **common)
  return merge_regions([user_part, group_part])
