"""`CandidateIndex`: the candidate -> user mapping, and the metadata kernels derive from it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify


@dataclasses.dataclass(frozen=True)
class CandidateIndex:
  """Which user each candidate belongs to, plus schedule metadata computed once.

  `cand_to_user[b]` is the user (request) of candidate `b`. The mapping may be
  unsorted and users may have no candidates. `num_users` is static (it fixes the
  shapes of user tensors); the mapping values are traced, so one compiled model
  serves every request with the same `(num_candidates, num_users)`.

  Several layers of one model reuse the same index, so the derived fields
  (`user_counts`, `user_offsets`, `sort_order`: per-user counts and offsets,
  the order that sorts candidates by user) are computed once here, in XLA,
  and not inside every op. They are derived from `cand_to_user` whenever an
  index is built, `dataclasses.replace` included, so they cannot go stale.

  Ids wider than int32 are saturated, not wrapped, when stored as int32: an
  out-of-range id stays out of range, so `check()` reports it and the ops'
  fast paths clamp it to `[0, num_users)`.

  Example:

  >>> import dataclasses
  >>> import jax.numpy as jnp
  >>> from ikbo_jax import CandidateIndex
  >>> index = CandidateIndex.from_counts([2, 0, 3])
  >>> index.cand_to_user.tolist()
  [0, 0, 2, 2, 2]
  >>> index.user_counts.tolist(), index.user_offsets.tolist()
  ([2, 0, 3], [0, 2, 2, 5])
  >>> CandidateIndex.from_mapping(jnp.array([1, 0, 1]), num_users=2).sort_order.tolist()
  [1, 0, 2]
  >>> dataclasses.replace(index, cand_to_user=jnp.array([2, 2, 2, 0, 0])).user_counts.tolist()
  [2, 0, 3]
  """

  cand_to_user: jax.Array
  num_users: int
  user_counts: jax.Array = dataclasses.field(init=False)
  user_offsets: jax.Array = dataclasses.field(init=False)
  sort_order: jax.Array = dataclasses.field(init=False)

  def __post_init__(self):
    num_users = _static_positive_int(self.num_users, "num_users")
    cand_to_user = self.cand_to_user
    if np.ndim(cand_to_user) != 1:
      raise ValueError(
          f"cand_to_user must have rank 1 [num_candidates], got shape {np.shape(cand_to_user)}")
    if np.shape(cand_to_user)[0] == 0:
      raise ValueError("cand_to_user is empty: a batch needs at least one candidate")
    cand_to_user = as_int32(cand_to_user, "cand_to_user")
    # Out-of-range ids would fall outside every segment; clamp so that the
    # derived metadata stays well formed (ops clamp the same way).
    clamped = jnp.clip(cand_to_user, 0, num_users - 1)
    user_counts = jnp.zeros((num_users,), jnp.int32).at[clamped].add(1)
    derived = dict(
        cand_to_user=cand_to_user,
        num_users=num_users,
        user_counts=user_counts,
        user_offsets=jnp.concatenate(
            [jnp.zeros((1,), jnp.int32), jnp.cumsum(user_counts, dtype=jnp.int32)]),
        sort_order=jnp.argsort(clamped, stable=True).astype(jnp.int32))
    for name, value in derived.items():
      object.__setattr__(self, name, value)

  @classmethod
  def from_mapping(cls, cand_to_user, num_users: int) -> CandidateIndex:
    """Builds the index from `cand_to_user: int[B]` with values in `[0, num_users)`.

    Out-of-range values are not checked here (the values may be traced); see
    `check()` and the checked mode of the ops.
    """
    return cls(cand_to_user, num_users)

  @classmethod
  def from_counts(cls, user_counts, num_candidates: int | None = None) -> CandidateIndex:
    """Builds a sorted index from per-user candidate counts `int[U]`.

    Candidates are laid out user by user: the first `user_counts[0]` belong to
    user 0, and so on. With concrete counts, `num_candidates` defaults to their
    sum and must equal it. With traced counts (a serving step that fixes the
    batch size), `num_candidates` is required and is the static batch size:
    positions past the counts' sum are padding candidates, given the
    out-of-range id `U` (so `check()` flags them and the ops clamp them to the
    last user; discard their outputs), and if the counts sum to more, the
    candidates past `num_candidates` are dropped.
    """
    if isinstance(user_counts, jax.core.Tracer):
      if num_candidates is None:
        raise ValueError("num_candidates must be given when user_counts is traced")
      num_candidates = _static_positive_int(num_candidates, "num_candidates")
      if not jnp.issubdtype(user_counts.dtype, jnp.integer):
        raise TypeError(f"user_counts must be integers, got dtype {user_counts.dtype}")
    else:
      counts_np = np.asarray(user_counts)
      if counts_np.ndim != 1:
        raise ValueError(f"user_counts must have rank 1 [num_users], got shape {counts_np.shape}")
      if counts_np.size and not np.issubdtype(counts_np.dtype, np.integer):
        raise TypeError(f"user_counts must be integers, got {counts_np.tolist()} "
                        f"(dtype {counts_np.dtype})")
      if (counts_np < 0).any():
        raise ValueError(f"user_counts must be non-negative, got {counts_np.tolist()}")
      total = int(counts_np.sum())
      if num_candidates is None:
        num_candidates = total
      elif _static_positive_int(num_candidates, "num_candidates") != total:
        raise ValueError(f"num_candidates={num_candidates} but user_counts sum to {total}")
    user_counts = jnp.asarray(user_counts).astype(jnp.int32)
    num_users = user_counts.shape[0]
    # One extra "user" U absorbs the padding positions past the counts' sum.
    cand_to_user = jnp.repeat(
        jnp.arange(num_users + 1, dtype=jnp.int32),
        jnp.concatenate([user_counts, jnp.full((1,), num_candidates, jnp.int32)]),
        total_repeat_length=num_candidates)
    return cls(cand_to_user, num_users)

  @property
  def num_candidates(self) -> int:
    return self.cand_to_user.shape[0]

  @property
  def clamped_cand_to_user(self) -> jax.Array:
    """The mapping with out-of-range ids clamped to `[0, num_users)`: what fast paths use."""
    return jnp.clip(self.cand_to_user, 0, self.num_users - 1)

  def check(self) -> None:
    """Checks that every id lies in `[0, num_users)`.

    Eagerly this raises `checkify.JaxRuntimeError` at once; inside a function
    transformed by `jax.experimental.checkify.checkify` it records the error.
    """
    ids = self.cand_to_user
    checkify.check(
        jnp.all((ids >= 0) & (ids < self.num_users)),
        f"cand_to_user values must lie in [0, num_users={self.num_users}); "
        "got min {lo}, max {hi}",
        lo=jnp.min(ids), hi=jnp.max(ids))


_DATA_FIELDS = ("cand_to_user", "user_counts", "user_offsets", "sort_order")


def _flatten(index: CandidateIndex):
  return tuple(getattr(index, f) for f in _DATA_FIELDS), index.num_users


def _unflatten(num_users: int, data) -> CandidateIndex:
  # Transformations rebuild an index from its (possibly traced or placeholder)
  # leaves: restore the fields as they were rather than deriving them again.
  index = object.__new__(CandidateIndex)
  for name, value in zip(_DATA_FIELDS, data):
    object.__setattr__(index, name, value)
  object.__setattr__(index, "num_users", num_users)
  return index


jax.tree_util.register_pytree_node(CandidateIndex, _flatten, _unflatten)


def as_int32(x, name: str):
  """Integer `x` (array-like or a JAX array) as an int32 JAX array.

  Values past int32's range saturate rather than wrap. NumPy input is
  saturated before it becomes a JAX array, since without 64-bit mode JAX
  itself would wrap it on the way in.
  """
  xp = jnp if isinstance(x, jax.Array) else np
  x = xp.asarray(x)
  if x.size == 0:  # an empty list comes in as float64
    return jnp.zeros(x.shape, jnp.int32)
  if not xp.issubdtype(x.dtype, xp.integer):
    raise TypeError(f"{name} must be an integer array, got dtype {x.dtype}")
  if x.dtype != np.int32:
    x = xp.clip(x, *_int32_range(x.dtype)).astype(np.int32)
  return jnp.asarray(x)


def _int32_range(dtype) -> tuple[int, int]:
  """int32's range, narrowed to what `dtype` can hold (so both bounds are valid in it)."""
  info, own = np.iinfo(np.int32), np.iinfo(dtype)
  return max(int(info.min), int(own.min)), min(int(info.max), int(own.max))


def _static_positive_int(value, name: str) -> int:
  if (isinstance(value, (jax.core.Tracer, bool, np.bool_))
      or not isinstance(value, (int, np.integer))):
    raise TypeError(f"{name} must be a static Python int, got {type(value).__name__}")
  if value <= 0:
    raise ValueError(f"{name} must be positive, got {value}")
  return int(value)
