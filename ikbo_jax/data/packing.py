"""Packing requests into a `RankingBatch` of static shape: one user slot per request."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ikbo_jax.data.request import Request
from ikbo_jax.models.batch import RankingBatch
from ikbo_jax.models.config import RankerConfig

_DTYPES = dict(user_dense=np.float32, history=np.int32, history_len=np.int32,
               cand_to_user=np.int32, cand_items=np.int32, cand_dense=np.float32,
               labels=np.float32)


def pack_requests(requests: Sequence[Request], config: RankerConfig, *, num_users: int,
                  num_candidates: int, history_slots: int | None = None,
                  out: RankingBatch | None = None) -> RankingBatch:
  """Lays `requests` out user by user in `num_users` user and `num_candidates` candidate slots.

  Request `r` takes user slot `r` and the candidate slots after those of the
  requests before it, in its own candidate order; the rest is padding (see
  `RankingBatch`). Histories take `history_slots` positions (default
  `config.max_history`). The requests must be validated (`Request.validated`)
  and fit.

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
  if out is None:
    out = RankingBatch(**{name: np.zeros(shape, _DTYPES[name]) for name, shape in shapes.items()})
  else:
    for name, shape in shapes.items():
      x = getattr(out, name)
      if x.shape != shape or x.dtype != _DTYPES[name]:
        raise ValueError(f"out.{name} is {x.dtype}{list(x.shape)}; the batch needs "
                         f"{np.dtype(_DTYPES[name])}{list(shape)}")
      x.fill(0)
  pack_users(requests, out.user_dense, out.history, out.history_len)
  pack_candidates(requests, num_users, out.cand_to_user, out.cand_items, out.cand_dense,
                  out.labels)
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


def candidate_offsets(requests: Sequence[Request]) -> np.ndarray:
  """`int[R + 1]`: request `r`'s scores are slots `offsets[r]:offsets[r + 1]` of its batch."""
  return np.concatenate([[0], np.cumsum([r.num_candidates for r in requests])]).astype(np.int64)
