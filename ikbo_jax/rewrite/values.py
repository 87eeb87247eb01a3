"""What the rewrite knows about each value of the traced function: its batch lineage.

Every jaxpr variable is interpreted as one of:

* `Plain`: an ordinary array. `at_b` says whether it may have rows at the
  candidate batch B (it depends on a candidate input); a plain value with
  `at_b=False` is batch-free (weights, constants) or lives at the user batch.
* `Mapping`: the declared `cand_to_user` (possibly normalized the way indexing
  normalizes negative ids, reshaped to `[B, 1]` or converted): a gather by it
  is a broadcast of user rows.
* `Shifted`, `Negative`: `mapping + c` and `mapping < 0`, the other branch
  and the predicate of that normalization.
* `Broadcast`: a value at B that is `take(user, mapping, axis)`: its rows are
  user rows, never materialized unless a consumer needs them.
* `RowConstant`: a batch-free value constant along some axes (a bias
  broadcast to `[B, F]`, a mask built from `iota`): along such an axis it is
  the same value at U rows as at B.
* `Concat`: a concatenation along a feature axis of broadcasts and candidate
  values, kept apart for a dense layer that follows it (linear compression).

The rewrite assumes that every id of the mapping lies in `[0, U)`: where the
original code would fill (`jnp.take`) or wrap (negative indexing) an
out-of-range id, the rewritten code clamps it, as the IKBO ops do.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Plain:
  value: jax.Array
  at_b: bool = False


@dataclasses.dataclass(frozen=True)
class Mapping:
  ids: jax.Array  # int[B], the declared mapping
  shape: tuple[int, ...]  # its shape here: (B,) or (B, 1)


@dataclasses.dataclass(frozen=True)
class Shifted:
  """`mapping + offset`: with a `Mapping` the two branches of negative-id wrapping."""

  ids: jax.Array
  offset: jax.Array
  shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Negative:
  """`mapping < 0`: the predicate of negative-id wrapping (all false for valid ids)."""

  ids: jax.Array
  shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Broadcast:
  """`take(user, ids, axis)`: user rows at B; `user.shape[axis]` is U."""

  user: jax.Array
  ids: jax.Array
  axis: int = 0

  @property
  def shape(self) -> tuple[int, ...]:
    s = list(self.user.shape)
    s[self.axis] = self.ids.shape[0]
    return tuple(s)

  def materialize(self) -> jax.Array:
    return jnp.take(self.user, self.ids, axis=self.axis, mode="clip")

  def like(self, user: jax.Array, axis: int | None = None) -> Broadcast:
    return Broadcast(user, self.ids, self.axis if axis is None else axis)


@dataclasses.dataclass(frozen=True)
class RowConstant:
  """A batch-free value that is constant along some axes (a broadcast bias, an iota mask).

  `compact` has the full rank and size 1 along every axis the value is constant
  on; `shape` is the full shape.
  """

  compact: jax.Array
  shape: tuple[int, ...]

  def varies_along(self, axis: int) -> bool:
    return self.compact.shape[axis] != 1

  def materialize(self) -> jax.Array:
    return jax.lax.broadcast_in_dim(self.compact, self.shape, tuple(range(len(self.shape))))

  def at_users(self, num_users: int, axis: int) -> jax.Array:
    shape = list(self.shape)
    shape[axis] = num_users
    return jax.lax.broadcast_in_dim(self.compact, tuple(shape), tuple(range(len(shape))))


@dataclasses.dataclass(frozen=True)
class Concat:
  """`concatenate(parts, dimension)` at B, kept apart; parts are `Broadcast` or `Plain`."""

  parts: tuple
  dimension: int
  ids: jax.Array

  def materialize(self) -> jax.Array:
    return jax.lax.concatenate([materialize(p) for p in self.parts], self.dimension)


def materialize(v) -> jax.Array:
  """The ordinary array a value stands for."""
  if isinstance(v, Plain):
    return v.value
  if isinstance(v, Mapping):
    return v.ids.reshape(v.shape)
  if isinstance(v, Shifted):
    return (v.ids + v.offset).reshape(v.shape)
  if isinstance(v, Negative):
    return (v.ids < 0).reshape(v.shape)
  return v.materialize()


def at_b(v) -> bool:
  """Whether `v`, as an ordinary array, may vary along a candidate batch axis."""
  return not (isinstance(v, RowConstant) or (isinstance(v, Plain) and not v.at_b))
