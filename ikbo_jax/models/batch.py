"""`RankingBatch`: requests packed into static shapes, the model's input in training and serving."""

from __future__ import annotations

import jax
from flax import struct

from ikbo_jax.index import CandidateIndex
from ikbo_jax.two_level_index import TwoLevelIndex


@struct.dataclass
class RankingBatch:
  """`U` user slots and `B` candidate slots; requests laid out user by user.

  User slot `u` holds one request, candidate slot `b` one of the candidates
  of request `cand_to_user[b]`. Slots past the requests are padding: users
  with no candidates and an empty history, and candidates with the
  out-of-range id `U` (the ops clamp it; their scores are meaningless and
  their labels ignored).

  Attributes:
    user_dense: `float[U, user_dense]` profile features.
    history: `int32[U, S]` item ids of the behaviour history, most recent
      last; positions `>= history_len[u]` are padding (any id).
    history_len: `int32[U]` valid history lengths, in `[0, S]`.
    cand_to_user: `int32[B]` the user slot of each candidate slot (`U`: padding).
    cand_items: `int32[B]` candidate item ids.
    cand_dense: `float[B, cand_dense]` candidate statistics.
    labels: `float[B]` clicks (training; zeros when serving).
    item_to_group: `int32[B]` each candidate's group slot (`G`: padding), or
      None for a model without a group level.
    group_to_user: `int32[G]` each group slot's user slot (`U`: padding).
    group_dense: `float[G, group_dense]` the groups' features.

  With a group level, a real candidate's group belongs to its user
  (`group_to_user[item_to_group[b]] == cand_to_user[b]`), as `pack_requests`
  lays them out: the IKBO build reads the user's part of linear compression
  through the group, attention and the standard build through `cand_to_user`.
  """

  user_dense: jax.Array
  history: jax.Array
  history_len: jax.Array
  cand_to_user: jax.Array
  cand_items: jax.Array
  cand_dense: jax.Array
  labels: jax.Array
  item_to_group: jax.Array | None = None
  group_to_user: jax.Array | None = None
  group_dense: jax.Array | None = None

  @property
  def num_users(self) -> int:
    return self.history.shape[0]

  @property
  def num_candidates(self) -> int:
    return self.cand_items.shape[0]

  def index(self) -> CandidateIndex:
    """The candidate -> user mapping (derived once per step, shared by every layer)."""
    return CandidateIndex.from_mapping(self.cand_to_user, self.num_users)

  @property
  def has_groups(self) -> bool:
    return self.item_to_group is not None

  def two_level_index(self) -> TwoLevelIndex:
    """Candidates -> groups -> users, for a batch with a group level."""
    if not self.has_groups:
      raise ValueError("this batch has no group level (item_to_group is None): it was packed "
                       "for a model with RankerConfig.group_dense=0")
    return TwoLevelIndex.from_mappings(self.item_to_group, self.group_to_user, self.num_users)

  def candidate_mask(self) -> jax.Array:
    """`bool[B]`: which candidate slots hold a real candidate."""
    return self.cand_to_user < self.num_users
