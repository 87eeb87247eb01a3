"""Splitting an IKBO batch over devices by request, so that no candidate's user lives elsewhere.

Data parallelism for IKBO shards the user batch and the candidate batch *together*:
shard `d` holds whole users and all of their candidates, and its mapping counts
users from zero. Every IKBO op then runs per shard (inside `jax.shard_map`, or
per device in serving) with no collective at all: a user tensor never crosses
devices. `plan_shards` chooses the split, balancing candidates (the work) over
shards; `ShardPlan` moves arrays into and out of the shard layout, in which the
leading axis is `num_shards` equal blocks, ready for a `NamedSharding` over
that axis.

>>> import numpy as np
>>> plan = plan_shards(np.array([0, 0, 0, 1, 2, 2]), num_users=3, num_shards=2)
>>> plan.users_per_shard, plan.candidates_per_shard
(2, 3)
>>> plan.local_cand_to_user.reshape(2, 3)  # user 0 alone; users 1 and 2 together
array([[0, 0, 0],
       [0, 1, 1]], dtype=int32)
>>> plan.restore(plan.candidates(np.arange(6)))
array([0, 1, 2, 3, 4, 5])
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ShardPlan:
  """Where each user and candidate of a batch goes when split over `num_shards` devices.

  Attributes:
    num_shards: how many shards (devices along the data axis).
    users_per_shard: user slots of each shard.
    candidates_per_shard: candidate slots of each shard.
    user_source: `int[num_shards * users_per_shard]`: the batch's user in each slot,
      -1 for padding.
    cand_source: `int[num_shards * candidates_per_shard]`: the batch's candidate in each
      slot, -1 for padding.
    local_cand_to_user: `int32[num_shards * candidates_per_shard]`: each slot's user
      within its shard; padding candidates get `users_per_shard`, out of range, which
      the IKBO ops clamp and `RankingBatch.candidate_mask` excludes.
  """

  num_shards: int
  users_per_shard: int
  candidates_per_shard: int
  user_source: np.ndarray
  cand_source: np.ndarray
  local_cand_to_user: np.ndarray

  def users(self, x, fill=0) -> np.ndarray:
    """User rows of `x` (leading axis: the batch's users) in the shard layout."""
    return _take_rows(x, self.user_source, fill)

  def candidates(self, x, fill=0) -> np.ndarray:
    """Candidate rows of `x` (leading axis: the batch's candidates) in the shard layout."""
    return _take_rows(x, self.cand_source, fill)

  def restore(self, y) -> np.ndarray:
    """Candidate rows of a result in the shard layout, back in the batch's candidate order."""
    y = np.asarray(y)
    if y.shape[0] != self.cand_source.shape[0]:
      raise ValueError(f"y has {y.shape[0]} rows; the shard layout has "
                       f"{self.cand_source.shape[0]} candidate slots")
    real = self.cand_source >= 0
    out = np.empty((int(real.sum()), *y.shape[1:]), y.dtype)
    out[self.cand_source[real]] = y[real]
    return out


def plan_shards(cand_to_user, num_users: int, num_shards: int, *,
                users_per_shard: int | None = None,
                candidates_per_shard: int | None = None) -> ShardPlan:
  """Splits users (each with all its candidates) over shards, balancing candidate counts.

  Users are placed largest first, each on the shard with the fewest candidates
  that still has a free user slot (the longest-processing-time rule: the
  busiest shard holds at most 4/3 of the optimum). Within a shard users and
  candidates keep the batch's order.

  Args:
    cand_to_user: `int[B]`, each candidate's user in `[0, num_users)`.
    num_users: the batch's users `U`.
    num_shards: the number of shards, at least 1.
    users_per_shard: user slots per shard (default: the fewest that fit, so the
      layout's shape depends on the batch; pass it for a static shape).
    candidates_per_shard: candidate slots per shard (default: the fewest that fit).

  Raises:
    ValueError: naming the argument, for ids out of range or slots too few.
  """
  ids = np.asarray(cand_to_user)
  if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"cand_to_user must be a 1-D int array, got {ids.dtype}{list(ids.shape)}")
  if not (isinstance(num_shards, int) and num_shards >= 1):
    raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
  if not (isinstance(num_users, int) and num_users >= 1):
    raise ValueError(f"num_users must be a positive int, got {num_users!r}")
  if ids.size and (ids.min() < 0 or ids.max() >= num_users):
    raise ValueError(f"cand_to_user must lie in [0, num_users={num_users}), got ids in "
                     f"[{ids.min()}, {ids.max()}]")
  counts = np.bincount(ids, minlength=num_users)
  per_shard_users = users_per_shard or -(-num_users // num_shards)
  if per_shard_users * num_shards < num_users:
    raise ValueError(f"users_per_shard={users_per_shard} x num_shards={num_shards} slots "
                     f"cannot hold num_users={num_users}")

  shard_of = np.empty(num_users, np.int64)
  load, taken = np.zeros(num_shards, np.int64), np.zeros(num_shards, np.int64)
  for user in sorted(range(num_users), key=lambda u: (-counts[u], u)):
    open_shards = np.flatnonzero(taken < per_shard_users)
    shard = open_shards[np.argmin(load[open_shards])]
    shard_of[user] = shard
    load[shard] += counts[user]
    taken[shard] += 1

  per_shard_cands = candidates_per_shard or max(int(load.max()), 1)
  if load.max() > per_shard_cands:
    raise ValueError(f"candidates_per_shard={candidates_per_shard} is too few: the balanced "
                     f"split puts {int(load.max())} candidates on one shard")
  user_source = np.full(num_shards * per_shard_users, -1, np.int64)
  cand_source = np.full(num_shards * per_shard_cands, -1, np.int64)
  local = np.full(num_shards * per_shard_cands, per_shard_users, np.int32)
  local_user = np.empty(num_users, np.int64)
  for shard in range(num_shards):
    users = np.flatnonzero(shard_of == shard)
    user_source[shard * per_shard_users:][:len(users)] = users
    local_user[users] = np.arange(len(users))
    cands = np.flatnonzero(shard_of[ids] == shard)
    cand_source[shard * per_shard_cands:][:len(cands)] = cands
    local[shard * per_shard_cands:][:len(cands)] = local_user[ids[cands]]
  return ShardPlan(num_shards, per_shard_users, per_shard_cands, user_source, cand_source, local)


def _take_rows(x, source: np.ndarray, fill) -> np.ndarray:
  x = np.asarray(x)
  out = x[np.maximum(source, 0)]
  out[source < 0] = fill
  return out
