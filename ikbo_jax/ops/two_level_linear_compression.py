"""Linear compression over two levels of sharing: user -> group -> item, no level copied.

`out[i] = W_user @ E_user[user(i)] + W_group @ E_group[group(i)] + W_item @ E_item[i]`,
i.e. `W @ concat(E_user[user(i)], E_group[group(i)], E_item[i])` along K, computed as three
GEMMs at their own batch sizes:

- `user_res = W_user @ E_user` at batch U (float32);
- `group_res[g] = W_group @ E_group[g] + user_res[group_to_user[g]]` at batch G (float32);
- the item GEMM at batch B, `group_res[item_to_group[i]]` added in its epilogue: the
  one-level kernels' fused gather-add, fed the group level's result in place of the user's.

The backward sums `d_out` per group (float32, in a fixed order: `ops.user_sums`), the
groups' sums per user, and runs each level's two GEMMs at its own batch. A group without
items and a user without groups are never read by the original: their rows reach no
gradient (`linear_compression_xla.residual_backward`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ikbo_jax import _dispatch
from ikbo_jax import _validation as v
from ikbo_jax._padding import pad_to
from ikbo_jax.ops import linear_compression_mosaic as mosaic
from ikbo_jax.ops import linear_compression_xla as xla
from ikbo_jax.ops.linear_compression import BACKENDS, Implementation, triton_residual_forward
from ikbo_jax.ops.user_sums import sum_per_user
from ikbo_jax.two_level_index import TwoLevelIndex

_F32 = jnp.float32


def group_result(w_user, w_group, e_user, e_group, group_to_user, *, precision=None):
  """`W_group @ E_group[g] + W_user @ E_user[user(g)]` in float32, at batch G."""
  user_res = xla.user_result(w_user, e_user, precision=precision)
  return xla.user_result(w_group, e_group, precision=precision) + user_res[group_to_user]


def materialized(w_user, w_group, w_item, e_user, e_group, e_item, item_to_group, item_to_user,
                 *, precision=None, gather=xla.take_rows):
  """The baseline: both levels copied to the items, concatenated along K, one batched GEMM.

  `gather(x, ids)` makes the copies (the test references swap in one whose
  backward sums in float32).
  """
  w = jnp.concatenate([w_user, w_group, w_item], axis=1)
  e = jnp.concatenate([gather(e_user, item_to_user), gather(e_group, item_to_group), e_item],
                      axis=1)
  out = jnp.einsum("mk,bkn->bmn", w, e, precision=precision, preferred_element_type=_F32)
  return out.astype(e_item.dtype)


def _item_forward(implementation: str, interpret: bool, w_item, e_item, group_res,
                  item_to_group):
  match implementation:
    case "xla":
      return xla.residual_decomposed(w_item, e_item, group_res, item_to_group), e_item
    case "triton":
      return triton_residual_forward(w_item, e_item, group_res, item_to_group,
                                     interpret=interpret), e_item
    case "mosaic_gpu":
      return mosaic.residual_forward(w_item, e_item, group_res, item_to_group,
                                     interpret=interpret)
  raise AssertionError(implementation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _two_level(implementation, interpret, w_user, w_group, w_item, e_user, e_group, e_item,
               item_to_group, group_to_user, item_to_user):
  return _two_level_fwd(implementation, interpret, w_user, w_group, w_item, e_user, e_group,
                        e_item, item_to_group, group_to_user, item_to_user)[0]


def _two_level_fwd(implementation, interpret, w_user, w_group, w_item, e_user, e_group, e_item,
                   item_to_group, group_to_user, item_to_user):
  rows = w_item.shape[0]
  if implementation == "mosaic_gpu":
    # The kernel reads the group rows in whole CTA tiles: computed with zero weight rows up
    # to those, the float32 [G, M, N] result needs no padded copy.
    rows = mosaic.residual_rows(rows, e_item.shape[2])
  group_res = group_result(pad_to(w_user, 0, rows), pad_to(w_group, 0, rows), e_user, e_group,
                           group_to_user)
  out, e_item_kept = _item_forward(implementation, interpret, w_item, e_item, group_res,
                                   item_to_group)
  # The Mosaic GPU backward reuses the aligned copy of e_item the forward made.
  return out, (w_user, w_group, w_item, e_user, e_group, e_item_kept, item_to_group,
               group_to_user, item_to_user)


def _two_level_bwd(implementation, interpret, residuals, d_out):
  (w_user, w_group, w_item, e_user, e_group, e_item, item_to_group, group_to_user,
   item_to_user) = residuals
  if implementation == "mosaic_gpu":
    d_w_item, d_e_item = mosaic.candidate_backward(w_item, e_item, d_out, interpret=interpret)
  else:
    d_w_item, d_e_item = xla.candidate_backward(w_item, e_item, d_out)
  num_groups, num_users = e_group.shape[0], e_user.shape[0]
  d_group = sum_per_user(d_out, item_to_group, num_groups)
  d_w_group, d_e_group = xla.residual_backward(
      w_group, e_group, d_group, xla.rows_in_use(item_to_group, num_groups))
  # A group without items sums to zero here; a user reads only through groups with items.
  d_user = sum_per_user(d_group, group_to_user, num_users)
  d_w_user, d_e_user = xla.residual_backward(
      w_user, e_user, d_user, xla.rows_in_use(item_to_user, num_users))
  return d_w_user, d_w_group, d_w_item, d_e_user, d_e_group, d_e_item, None, None, None


_two_level.defvjp(_two_level_fwd, _two_level_bwd)


def two_level_linear_compression(w_user, w_group, w_item, e_user, e_group, e_item,
                                 index: TwoLevelIndex, *,
                                 implementation: Implementation | None = None,
                                 checked: bool = False, interpret: bool = False) -> jax.Array:
  """Shared projection of user, group and item embeddings, with neither shared level copied.

  Computes `out[i] = W_user @ e_user[user(i)] + W_group @ e_group[group(i)] + W_item @
  e_item[i]` with `group = index.items`, `user = index.item_to_user`.

  Args:
    w_user: `[M, K_user]` weight applied to user embeddings.
    w_group: `[M, K_group]` weight applied to group embeddings.
    w_item: `[M, K_item]` weight applied to item embeddings.
    e_user: `[U, K_user, N]` user embeddings, stored once per user.
    e_group: `[G, K_group, N]` group embeddings, stored once per group.
    e_item: `[B, K_item, N]` item embeddings.
    index: the `TwoLevelIndex` mapping items to groups and groups to users.
    implementation: as for `linear_compression`: `"xla_materialized"` (both levels
      copied; plain autodiff), `"xla"`, `"triton"` or `"mosaic_gpu"` (the item GEMM
      fused with the group level's gather-add), or None for the fastest available.
    checked: also check both levels' ids with `checkify.check`; without it,
      out-of-range ids are clamped in every implementation, forward and backward.
    interpret: run a kernel implementation under the Pallas interpreter.

  Returns:
    `[B, M, N]` in the input dtype (float32 accumulation).

  >>> import jax, jax.numpy as jnp
  >>> from ikbo_jax import TwoLevelIndex, two_level_linear_compression
  >>> index = TwoLevelIndex.from_mappings([0, 0, 2, 1], group_to_user=[1, 0, 1], num_users=2)
  >>> ks = jax.random.split(jax.random.key(0), 6)
  >>> out = two_level_linear_compression(
  ...     jax.random.normal(ks[0], (4, 6)), jax.random.normal(ks[1], (4, 3)),
  ...     jax.random.normal(ks[2], (4, 5)), jax.random.normal(ks[3], (2, 6, 8)),
  ...     jax.random.normal(ks[4], (3, 3, 8)), jax.random.normal(ks[5], (4, 5, 8)), index)
  >>> out.shape
  (4, 4, 8)
  """
  _check_args(w_user, w_group, w_item, e_user, e_group, e_item, index)
  dtype = v.check_float_dtypes(w_user=w_user, w_group=w_group, w_item=w_item, e_user=e_user,
                               e_group=e_group, e_item=e_item)
  interpret = v.check_flag("interpret", interpret)
  implementation = _dispatch.resolve(BACKENDS, implementation, dtype, interpret=interpret).name
  if v.check_flag("checked", checked):
    index.check()
  ids = (index.items.clamped_cand_to_user, index.groups.clamped_cand_to_user,
         index.item_to_user.cand_to_user)
  if implementation == "xla_materialized":
    return materialized(w_user, w_group, w_item, e_user, e_group, e_item, ids[0], ids[2])
  _dispatch.reverse_mode_only("ikbo_jax.two_level_linear_compression", w_user, w_group, w_item,
                              e_user, e_group, e_item)
  return _two_level(implementation, interpret, *_dispatch.common_varying_axes(
      w_user, w_group, w_item, e_user, e_group, e_item, *ids))


def _check_args(w_user, w_group, w_item, e_user, e_group, e_item, index) -> None:
  if not isinstance(index, TwoLevelIndex):
    raise TypeError(f"index must be a TwoLevelIndex, got {type(index).__name__}")
  v.check_operands(w_user=(w_user, ("M", "K_user")), w_group=(w_group, ("M", "K_group")),
                   w_item=(w_item, ("M", "K_item")), e_user=(e_user, ("U", "K_user", "N")),
                   e_group=(e_group, ("G", "K_group", "N")), e_item=(e_item, ("B", "K_item", "N")))
  m, n = w_user.shape[0], e_user.shape[2]
  v.check_dim("w_group", w_group, 0, m, "M, from w_user")
  v.check_dim("w_item", w_item, 0, m, "M, from w_user")
  for name, e, w, batch, meaning in (
      ("e_user", e_user, w_user, index.num_users, "U, from index.num_users"),
      ("e_group", e_group, w_group, index.num_groups, "G, from index.num_groups"),
      ("e_item", e_item, w_item, index.num_items, "B, from index.num_items")):
    v.check_dim(name, e, 0, batch, meaning)
    v.check_dim(name, e, 1, w.shape[1], f"K, from w_{name[2:]}")
    v.check_dim(name, e, 2, n, "N, from e_user")
