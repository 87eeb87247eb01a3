"""Packing requests into a `RankingBatch` of static shape: one user slot per request."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ikbo_jax.data.request import Request
from ikbo_jax.models.batch import RankingBatch
from ikbo_jax.models.config import RankerConfig

_DTYPES = dict(user_dense=np.float32, history=np.int32, history_len=np.int32,
               cand_to_user=np.int32, cand_items=np.int32, cand_dense=np.float32,
               labels=np.float32, item_to_group=np.int32, group_to_user=np.int32,
               group_dense=np.float32)


def pack_requests(requests: Sequence[Request], config: RankerConfig, *, num_users: int,
                  num_candidates: int, history_slots: int | None = None,
                  num_groups: int | None = None, out: RankingBatch | None = None
                  ) -> RankingBatch:
  """Lays `requests` out user by user in `num_users` user and `num_candidates` candidate slots.

  Request `r` takes user slot `r` and the candidate slots after those of the
  requests before it, in its own candidate order; the rest is padding (see
  `RankingBatch`). Histories take `history_slots` positions (default
  `config.max_history`). With a group level (`config.has_groups`), request
  `r`'s groups take the group slots after those of the requests before it
  (`num_groups` of them, default `num_candidates`: a request has at most as many
  groups as candidates, so they always fit then). The requests must be
  validated (`Request.validated`) and fit.

  Args:
    out: NumPy arrays of the batch's shapes and dtypes to pack into (all of
      their contents are overwritten), e.g. views of a reused host buffer;
      default: new arrays.

  Returns:
    The batch, as NumPy arrays (the jitted model moves them to the device).
  """
  starts = candidate_offsets(requests)
  if len(requests) > num_users:
    raise ValueError(f"{len(requests)} requests do not fit num_users={num_users} user slots")
  if starts[-1] > num_candidates:
    raise ValueError(f"{int(starts[-1])} candidates do not fit num_candidates="
                     f"{num_candidates} slots")
  c, history_slots = config, history_slots or config.max_history
  longest = max((len(r.history) for r in requests), default=0)
  if longest > history_slots:
    raise ValueError(f"a history of {longest} items does not fit history_slots={history_slots}")
  shapes = dict(user_dense=(num_users, c.user_dense), history=(num_users, history_slots),
                history_len=(num_users,), cand_to_user=(num_candidates,),
                cand_items=(num_candidates,), cand_dense=(num_candidates, c.cand_dense),
                labels=(num_candidates,))
  if c.has_groups:
    num_groups = num_candidates if num_groups is None else num_groups
    if sum(r.num_groups for r in requests) > num_groups:
      raise ValueError(f"{sum(r.num_groups for r in requests)} groups do not fit "
                       f"num_groups={num_groups} group slots")
    shapes.update(item_to_group=(num_candidates,), group_to_user=(num_groups,),
                  group_dense=(num_groups, c.group_dense))
  if out is None:
    out = RankingBatch(**{name: np.zeros(shape, _DTYPES[name]) for name, shape in shapes.items()})
  else:
    for name, shape in shapes.items():
      x = getattr(out, name)
      if x is None or x.shape != shape or x.dtype != _DTYPES[name]:
        actual = "None" if x is None else f"{x.dtype}{list(x.shape)}"
        raise ValueError(f"out.{name} is {actual}; the batch needs "
                         f"{np.dtype(_DTYPES[name])}{list(shape)}")
      x.fill(0)
  pack_users(requests, out.user_dense, out.history, out.history_len)
  pack_candidates(requests, num_users, out.cand_to_user, out.cand_items, out.cand_dense,
                  out.labels)
  if c.has_groups:
    pack_groups(requests, num_users, out.item_to_group, out.group_to_user, out.group_dense)
  return out


def pack_users(requests: Sequence[Request], user_dense: np.ndarray, history: np.ndarray,
               history_len: np.ndarray) -> None:
  """Writes request `r`'s user inputs into row `r` of the given (zeroed) arrays."""
  for u, request in enumerate(requests):
    user_dense[u] = request.user_dense
    history[u, :len(request.history)] = request.history
    history_len[u] = len(request.history)


def pack_candidates(requests: Sequence[Request], num_users: int, cand_to_user: np.ndarray,
                    cand_items: np.ndarray, cand_dense: np.ndarray,
                    labels: np.ndarray | None = None) -> None:
  """Lays the requests' candidates out in order into the given (zeroed) arrays.

  Candidates of request `r` map to user `r`; the slots past them are padding,
  mapped to the out-of-range id `num_users`.
  """
  cand_to_user.fill(num_users)
  starts = candidate_offsets(requests)
  for u, (request, start, stop) in enumerate(zip(requests, starts[:-1], starts[1:])):
    cand_to_user[start:stop] = u
    cand_items[start:stop] = request.cand_items
    cand_dense[start:stop] = request.cand_dense
    if labels is not None and request.labels is not None:
      labels[start:stop] = request.labels


def pack_groups(requests: Sequence[Request], num_users: int, item_to_group: np.ndarray,
                group_to_user: np.ndarray, group_dense: np.ndarray) -> None:
  """Lays the requests' groups out in order; candidates point at their group's slot.

  Group slots past the requests' map to the out-of-range user `num_users`, and
  padding candidates to the out-of-range group `len(group_to_user)`.
  """
  item_to_group.fill(group_to_user.shape[0])
  group_to_user.fill(num_users)
  starts = candidate_offsets(requests)
  first_group = 0
  for u, (request, start) in enumerate(zip(requests, starts[:-1])):
    g = request.num_groups
    group_to_user[first_group:first_group + g] = u
    group_dense[first_group:first_group + g] = request.group_dense
    item_to_group[start:start + request.num_candidates] = first_group + request.cand_groups
    first_group += g


def candidate_offsets(requests: Sequence[Request]) -> np.ndarray:
  """`int[R + 1]`: request `r`'s scores are slots `offsets[r]:offsets[r + 1]` of its batch."""
  return np.concatenate([[0], np.cumsum([r.num_candidates for r in requests])]).astype(np.int64)
