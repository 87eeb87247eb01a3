"""What the rewrite knows about each value of the traced function: its batch lineage.

Every jaxpr variable is interpreted as one of:

* `Plain`: an ordinary array, with where it comes from: `at_b` if it depends
  on a candidate input (it may vary along the candidate batch B), `at_u` if it
  depends on a user input, `mapped` if it depends on the declared mapping.
  A value with none of them is batch-free (a weight, a constant).
* `Broadcast`: a value at B that is `take(user, ids, axis, mode="clip")` for
  an integer index vector `ids`: its rows are user rows, never materialized
  unless a consumer needs them. The index is whatever the program gathered
  with, computed as written (the declared mapping, a clamp of it, the
  normalization of negative ids, `jnp.repeat`'s index, ...), so a broadcast is
  exactly the original gather for every input, valid or not.
* `RowConstant`: a value constant along some axes (a bias broadcast to
  `[B, F]`, a mask built from `iota`, a user row repeated `r` times): along
  such an axis it is the same value at U rows as at B.
* `Concat`: a concatenation along a feature axis of broadcasts and other
  values, kept apart for a dense layer that follows it.

A gather of a broadcast's rows is a broadcast too, `take(take(user, ids), i)
= take(user, ids[i])` (two nested levels: items -> groups -> users); it
remembers both levels (`Broadcast.levels`) so that a dense layer over user,
group and item features can run each part at its own batch.

Every value type is a pytree whose leaves are its arrays, so that nested
functions (custom derivative rules, `cond` branches, `checkpoint` bodies) can
take lazy values apart and rebuild them on their own tracers (`closure.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ikbo_jax.rewrite import read_rows


def _pytree(*, data: tuple[str, ...], meta: tuple[str, ...]):
  def register(cls):
    cls = dataclasses.dataclass(frozen=True, eq=False)(cls)
    return jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=list(meta))
  return register


@_pytree(data=("value",), meta=("at_b", "at_u", "mapped", "bounds"))
class Plain:
  value: jax.Array
  at_b: bool = False
  at_u: bool = False
  mapped: bool = False
  bounds: tuple[int, int] | None = None  # static [lo, hi] of an integer value, where known


@_pytree(data=("user", "ids", "rows", "levels"), meta=("axis",))
class Broadcast:
  """`take(user, ids, axis, mode="clip")`: user rows at B; `user.shape[axis]` is U.

  `rows`, where set, is `int[U]`: for each user row, itself if some candidate
  reads it, else the first row some candidate reads, which is `rows[0]` (see
  `read_rows.py`).
  `levels`, where set, is `(item_to_group, group_to_user)` with `ids =
  group_to_user[item_to_group]` (both in range): the broadcast is a gather of
  a gather, and `item_to_group` is the ids of the broadcasts by the same outer
  gather of group rows.
  """

  user: jax.Array
  ids: jax.Array  # int[B]
  axis: int = 0
  rows: jax.Array | None = None
  levels: tuple[jax.Array, jax.Array] | None = None

  @property
  def shape(self) -> tuple[int, ...]:
    s = list(self.user.shape)
    s[self.axis] = self.ids.shape[0]
    return tuple(s)

  @property
  def num_users(self) -> int:
    return self.user.shape[self.axis]

  def materialize(self) -> jax.Array:
    return jnp.take(self.user, self.ids, axis=self.axis, mode="clip")

  def like(self, user: jax.Array, axis: int | None = None) -> Broadcast:
    return Broadcast(user, self.ids, self.axis if axis is None else axis, self.rows, self.levels)

  def at_read_rows(self) -> Broadcast:
    """The same broadcast with every unread user row replaced by a read one."""
    if self.rows is None:
      return self
    return self.like(read_rows.at_read_rows(self.user, self.rows, self.axis))

  def read_rows_only(self) -> Broadcast:
    """The same broadcast with every unread user row zero: a tangent no unread row feeds."""
    if self.rows is None:
      return self
    return self.like(read_rows.masked_tangent(self.user, self.rows, self.axis))


@_pytree(data=("compact",), meta=("shape", "at_u", "at_b"))
class RowConstant:
  """A value that is constant along some axes (a broadcast bias, an iota mask, a mapping
  broadcast along feature axes).

  `compact` has the full rank and size 1 along every axis the value is constant
  on; `shape` is the full shape. `at_u` if it depends on a user input, `at_b`
  if it may vary along the candidate axis (`ids[:, None]` broadcast to `[B, F]`).
  """

  compact: jax.Array
  shape: tuple[int, ...]
  at_u: bool = False
  at_b: bool = False

  def varies_along(self, axis: int) -> bool:
    return self.compact.shape[axis] != 1

  def materialize(self) -> jax.Array:
    return jax.lax.broadcast_in_dim(self.compact, self.shape, tuple(range(len(self.shape))))

  def at_users(self, num_users: int, axis: int) -> jax.Array:
    shape = list(self.shape)
    shape[axis] = num_users
    return jax.lax.broadcast_in_dim(self.compact, tuple(shape), tuple(range(len(shape))))


@_pytree(data=("parts", "ids"), meta=("dimension",))
class Concat:
  """`concatenate(parts, dimension)` at B, kept apart; parts are `Broadcast` (of `ids`) or other."""

  parts: tuple
  ids: jax.Array
  dimension: int

  @property
  def shape(self) -> tuple[int, ...]:
    s = list(part_shape(self.parts[0]))
    s[self.dimension] = sum(part_shape(p)[self.dimension] for p in self.parts)
    return tuple(s)

  def materialize(self) -> jax.Array:
    return jax.lax.concatenate([materialize(p) for p in self.parts], self.dimension)

  @property
  def uniform(self) -> bool:
    """Whether every broadcast part is by `ids` (else some are by other indices)."""
    return all(p.ids is self.ids for p in self.parts if isinstance(p, Broadcast))


LAZY = (Broadcast, RowConstant, Concat)


def part_shape(v) -> tuple[int, ...]:
  return tuple(v.value.shape) if isinstance(v, Plain) else tuple(v.shape)


def materialize(v) -> jax.Array:
  """The ordinary array a value stands for."""
  return v.value if isinstance(v, Plain) else v.materialize()


def _each_broadcast(v, fn):
  """`v` with `fn` applied to each of its broadcasts (itself, or a concatenation's parts)."""
  if isinstance(v, Broadcast):
    return fn(v)
  if isinstance(v, Concat):
    return Concat(tuple(_each_broadcast(p, fn) for p in v.parts), v.ids, v.dimension)
  return v


def at_read_rows(v):
  """`v` with every unread user row of its broadcasts replaced by a read one."""
  return _each_broadcast(v, Broadcast.at_read_rows)


def read_rows_only(v):
  """A tangent `v` with every unread user row of its broadcasts zero."""
  return _each_broadcast(v, Broadcast.read_rows_only)


def at_b(v) -> bool:
  """Whether `v`, as an ordinary array, may vary along a candidate batch axis."""
  return not (isinstance(v, (Plain, RowConstant)) and not v.at_b)


def at_u(v) -> bool:
  """Whether `v` depends on a user input."""
  return isinstance(v, (Broadcast, Concat)) or getattr(v, "at_u", False)


def mapped(v) -> bool:
  """Whether `v` depends on the declared mapping."""
  return isinstance(v, (Broadcast, Concat)) or getattr(v, "mapped", False)


def lineage(operands, outs) -> list[Plain]:
  """`outs` as `Plain` values that inherit the lineage of `operands`."""
  b = any(at_b(v) for v in operands)
  u = any(at_u(v) for v in operands)
  m = any(mapped(v) for v in operands)
  return [Plain(o, b, u, m) for o in outs]
