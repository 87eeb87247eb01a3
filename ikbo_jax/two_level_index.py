"""`TwoLevelIndex`: items -> groups -> users, two nested broadcasts, each a `CandidateIndex`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ikbo_jax.index import CandidateIndex, as_int32


@dataclasses.dataclass(frozen=True)
class TwoLevelIndex:
  """Which group each item belongs to and which user each group belongs to.

  In an ads request, many candidate items share an ad group (or campaign, or
  advertiser), and many groups share the request's user: group features are the
  same for all of a group's items, user features for all of a user's groups. Each
  level is a `CandidateIndex` of its own, so every per-level fact (counts, offsets,
  sort order, `check()`) is derived once, as for one level:

  - `items`: item -> group (`items.cand_to_user` is `item_to_group[B]`,
    `items.num_users` is the number of groups G);
  - `groups`: group -> user (`group_to_user[G]`, `num_users` U);
  - `item_to_user`: the composed mapping, item -> user, for ops that read user
    rows from items directly (a user's history in attention).

  Either mapping may be unsorted and uneven; groups may have no items and users
  no groups. Out-of-range ids are clamped by the ops, as for one level, and
  flagged by `check()`; an item whose group id is out of range maps to the user
  of the group it is clamped to.

  >>> from ikbo_jax import TwoLevelIndex
  >>> index = TwoLevelIndex.from_mappings([0, 0, 2, 1, 2], group_to_user=[1, 0, 1],
  ...                                     num_users=2)
  >>> index.num_items, index.num_groups, index.num_users
  (5, 3, 2)
  >>> index.item_to_user.cand_to_user.tolist()
  [1, 1, 1, 0, 1]
  >>> index.items.user_counts.tolist(), index.groups.user_counts.tolist()
  ([2, 1, 2], [1, 2])
  """

  items: CandidateIndex
  groups: CandidateIndex
  item_to_user: CandidateIndex

  def __post_init__(self):
    for name in ("items", "groups", "item_to_user"):
      if not isinstance(getattr(self, name), CandidateIndex):
        raise TypeError(f"{name} must be a CandidateIndex, got "
                        f"{type(getattr(self, name)).__name__}")
    if self.items.num_users != self.groups.num_candidates:
      raise ValueError(f"items maps to {self.items.num_users} groups but groups has "
                       f"{self.groups.num_candidates} (group_to_user's length)")
    if (self.item_to_user.num_users, self.item_to_user.num_candidates) != (
        self.groups.num_users, self.items.num_candidates):
      raise ValueError("item_to_user must map the items to the groups' users: expected "
                       f"{self.items.num_candidates} items over {self.groups.num_users} users, "
                       f"got {self.item_to_user.num_candidates} over "
                       f"{self.item_to_user.num_users}")

  @classmethod
  def from_mappings(cls, item_to_group, group_to_user, num_users: int) -> TwoLevelIndex:
    """Builds the index from `item_to_group: int[B]` (values in `[0, G)`, G =
    `len(group_to_user)`) and `group_to_user: int[G]` (values in `[0, num_users)`)."""
    group_to_user = as_int32(group_to_user, "group_to_user")
    if group_to_user.ndim != 1:
      raise ValueError(f"group_to_user must have rank 1 [num_groups], got shape "
                       f"{group_to_user.shape}")
    if group_to_user.shape[0] == 0:
      raise ValueError("group_to_user is empty: a batch needs at least one group")
    items = CandidateIndex(as_int32(item_to_group, "item_to_group"), group_to_user.shape[0])
    groups = CandidateIndex(group_to_user, num_users)
    return cls(items, groups, CandidateIndex(
        groups.clamped_cand_to_user[items.clamped_cand_to_user], num_users))

  @classmethod
  def one_group_per_item(cls, index: CandidateIndex) -> TwoLevelIndex:
    """A one-level index as two levels: every item its own group (G = B)."""
    return cls.from_mappings(jnp.arange(index.num_candidates, dtype=jnp.int32),
                             index.cand_to_user, index.num_users)

  @property
  def num_items(self) -> int:
    return self.items.num_candidates

  @property
  def num_groups(self) -> int:
    return self.groups.num_candidates

  @property
  def num_users(self) -> int:
    return self.groups.num_users

  def check(self) -> None:
    """Checks both levels' ids (`CandidateIndex.check`: eagerly raises, under
    `checkify.checkify` records)."""
    self.items.check()
    self.groups.check()


def _flatten(index: TwoLevelIndex):
  return (index.items, index.groups, index.item_to_user), None


def _unflatten(_, children) -> TwoLevelIndex:
  # Transformations rebuild an index from placeholder leaves: skip the checks.
  index = object.__new__(TwoLevelIndex)
  for name, child in zip(("items", "groups", "item_to_user"), children):
    object.__setattr__(index, name, child)
  return index


jax.tree_util.register_pytree_node(TwoLevelIndex, _flatten, _unflatten)
