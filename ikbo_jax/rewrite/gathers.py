"""Gathers of user rows by an index vector are broadcasts; what is known of integer ranges.

A row gather `take(user, idx, axis=0)` of a value without a candidate axis is
a `Broadcast` for any integer index vector `idx`, computed as the program
computes it: the rewrite never assumes what an index is, so a clamp, a shift
or `jnp.repeat`'s index is gathered with exactly as written.

The work moved after it runs on the broadcast's user rows, so those rows must
be exactly what the original computes on, forward and backward:

* out-of-range ids keep the gather's own semantics. "clip" clamps both ways,
  as the IKBO ops do. "promise in bounds" reads the clamped row but its
  transpose drops the candidate's cotangent, and "fill" (`jnp.take`'s
  default) reads a fill value (NaN for floats) and drops it too: those
  candidates read extra rows appended to the user rows, copies of the
  clamped row with their gradient stopped, or the fill row;
* a row no candidate reads (a user without candidates, a padding user) is
  never computed by the original, and a value there may be anything (a zero
  row that a norm divides by, NaN): with a zero cotangent, a non-finite
  derivative there would still put NaN into the weights' gradients. The
  broadcast carries, for each row, a row some candidate reads (`rows`), at
  which the work moved to U is differentiated (`read_rows.py`).

`bounds` infers static ranges of integer values (from `clip`, `min`/`max`
with constants, `iota`, and the `where(i < 0, i + n, i)` that indexing
emits), so that a clamped mapping is known to be in range.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import primitives as P
from jax._src.lax.slicing import GatherScatterMode

from ikbo_jax.rewrite.values import Broadcast, Plain, RowConstant

_INF = math.inf


def gather(rw, eqn, operands):
  operand, indices = operands
  if isinstance(indices, Broadcast):
    return _lookup_of_broadcast_ids(rw, eqn, operand, indices)
  if isinstance(operand, Broadcast) and isinstance(indices, Plain):
    return _gather_of_broadcast(rw, eqn, operand, indices)
  if isinstance(operand, Plain) and isinstance(indices, RowConstant) and not operand.at_b:
    return _take_along_rows(rw, eqn, operand, indices)
  if not (isinstance(operand, Plain) and isinstance(indices, Plain)) or operand.at_b:
    return None
  if not (operand.at_u or indices.mapped):  # an embedding lookup by candidate ids stays one
    return None
  value = operand.value
  keeps_axis = _reads_whole_rows(eqn, np.shape(indices.value), np.shape(value))
  if keeps_axis is None:
    return None
  mode = eqn.params["mode"] if not _within(indices, np.shape(value)[0]) else (
      GatherScatterMode.CLIP)
  return _rows_read(rw, eqn, value, indices.value, lambda i: i[:, 0], mode,
                    keeps_axis=keeps_axis)


def _rows_read(rw, eqn, value, index, ids_of, mode, *, index_tail=(1,), keeps_axis=False):
  """The broadcast of `value`'s rows that the gather `eqn` reads by `index` (`ids_of(index)`:
  one id per candidate), the rows its out-of-range ids read under `mode` appended."""
  num_users = np.shape(value)[0]
  ids, rows = rw.memo(("rows", num_users, mode), index,
                      lambda i: _exact_ids(ids_of(i), num_users, mode))
  # The rows as the gather reads them; the row axis may stay, as a size-1 axis.
  user = jnp.concatenate([value[:, None] if keeps_axis else value,
                          *_extra_rows(eqn, value, mode, index_tail)])
  rw.report.add("broadcast", eqn, bytes_saved=nbytes(eqn.outvars[0].aval))
  return [Broadcast(user, ids, 0, rows)]


def _take_along_rows(rw, eqn, operand: Plain, indices: RowConstant):
  """`take_along_axis(user, broadcast_to(ids[:, None], (B, F)), axis=0)`: whole rows.

  The gather is batched over every feature axis, each element reading its own
  row; an index constant along those axes reads one row per candidate, `ids`,
  element by element as a row gather reads it, out-of-range ids included.
  """
  dn, value = eqn.params["dimension_numbers"], operand.value
  rank, features = np.ndim(value), tuple(range(1, np.ndim(value)))
  if (dn.collapsed_slice_dims != (0,) or dn.start_index_map != (0,) or dn.offset_dims
      or dn.operand_batching_dims != features or dn.start_indices_batching_dims != features
      or tuple(eqn.params["slice_sizes"]) != (1,) * rank
      or indices.shape[1:] != (*np.shape(value)[1:], 1)
      or any(indices.varies_along(d) for d in range(1, rank + 1))):
    return None
  return _rows_read(rw, eqn, value, indices.compact, lambda i: i.reshape(-1),
                    eqn.params["mode"], index_tail=indices.shape[1:])


def _gather_of_broadcast(rw, eqn, inner: Broadcast, indices: Plain):
  """`take(user, ids)[i]` is `take(user, ids[i])`: a gather of broadcast rows, one broadcast.

  The rows that out-of-range `i` read under the outer gather's mode are built
  from the inner broadcast's first and last rows and appended to the user
  rows, so `ids[i]` becomes `group_to_user[item_to_group]` over the extended
  rows: `item_to_group` is exactly what a gather of group rows by `i` would
  use (the same memoized index), which lets a dense layer run the user part at
  U and the group part at G (`dense.split_dense`).
  """
  num_groups = inner.ids.shape[0]
  keeps_axis = _reads_whole_rows(eqn, np.shape(indices.value), inner.shape)
  if inner.axis != 0 or keeps_axis is None or num_groups == 0:
    return None
  mode = eqn.params["mode"] if not _within(indices, num_groups) else GatherScatterMode.CLIP
  item_to_group, _ = rw.memo(("rows", num_groups, mode), indices.value,
                             lambda i: _exact_ids(i[:, 0], num_groups, mode))
  edges = jnp.take(inner.user, inner.ids[jnp.array([0, num_groups - 1])], axis=0, mode="clip")
  extra = _extra_rows(eqn, edges, mode)  # the group rows out-of-range ids read
  group_to_user = rw.memo(("group_to_user", inner.num_users, len(extra)), inner.ids,
                          lambda g: jnp.concatenate([g, inner.num_users + jnp.arange(
                              len(extra), dtype=jnp.int32)]))
  user = jnp.concatenate([inner.user[:, None] if keeps_axis else inner.user, *extra])
  ids = rw.memo(("composed", id(group_to_user)), item_to_group, lambda i: group_to_user[i])
  rw.report.add("broadcast", eqn, bytes_saved=nbytes(eqn.outvars[0].aval))
  return [Broadcast(user, ids, 0, _read_rows(ids, user.shape[0]),
                    (item_to_group, group_to_user))]


def _reads_whole_rows(eqn, indices_shape, value_shape) -> bool | None:
  """Whether the gather reads whole rows `value[indices[:, 0]]`; then whether it keeps their axis.

  `take(user, ids, axis=0)` and `user[ids]` index one axis and collapse it.
  `vmap` of `dynamic_index_in_dim` indexes every axis, with starts of 0 on the
  others, and keeps the row axis: a start on an axis that is sliced whole is
  clamped to 0 in "clip" mode, forward and transpose alike, whatever it is.
  None for any other gather.
  """
  dn, sizes = eqn.params["dimension_numbers"], tuple(eqn.params["slice_sizes"])
  rank, starts = len(value_shape), dn.start_index_map
  if (len(indices_shape) != 2 or indices_shape[1] != len(starts) or not starts
      or starts[0] != 0 or dn.operand_batching_dims or sizes != (1, *value_shape[1:])):
    return None
  if len(starts) > 1 and (eqn.params["mode"] != GatherScatterMode.CLIP
                          or len(set(starts)) != len(starts)):
    return None
  if dn.collapsed_slice_dims == (0,) and dn.offset_dims == tuple(range(1, rank)):
    return False
  if dn.collapsed_slice_dims == () and dn.offset_dims == tuple(range(1, rank + 1)):
    return True
  return None


def _exact_ids(ids, num_users: int, mode):
  """`(ids, rows)` for the user rows with `_extra_rows` appended under `mode`.

  Out-of-range ids point at the extra rows; `rows` picks, for each of those
  user rows, itself if some candidate reads it, else the first row read.
  """
  ids = ids.astype(jnp.int32)
  if mode == GatherScatterMode.CLIP:
    ids, num_rows = jnp.clip(ids, 0, num_users - 1), num_users
  elif mode == GatherScatterMode.FILL_OR_DROP:
    ids = jnp.where((ids >= 0) & (ids < num_users), ids, num_users)
    num_rows = num_users + 1
  else:  # promise in bounds: XLA clamps the read
    ids = jnp.where(ids < 0, num_users, jnp.where(ids >= num_users, num_users + 1, ids))
    num_rows = num_users + 2
  return ids, _read_rows(ids, num_rows)


def _read_rows(ids, num_rows: int):
  """`int[num_rows]`: each row itself if some of `ids` (all in range) reads it, else the first
  row read; so `rows[0]` is the first row read (`read_rows.at_read_rows` takes it from there)."""
  if ids.shape[0] == 0:
    return jnp.arange(num_rows, dtype=jnp.int32)
  read = jnp.zeros((num_rows,), jnp.bool_).at[ids].set(True, unique_indices=False)
  return jnp.where(read, jnp.arange(num_rows, dtype=jnp.int32), jnp.argmax(read).astype(jnp.int32))


def _extra_rows(eqn, value, mode, index_tail=(1,)) -> list:
  """The rows that out-of-range ids read under `mode` (a collapsing gather's), after the user rows.

  A fill gather's is the gather itself at an out-of-range id (an index of one candidate,
  `[1, *index_tail]`), whatever its fill value.
  """
  if mode == GatherScatterMode.CLIP:
    return []
  if mode == GatherScatterMode.FILL_OR_DROP:
    beyond = jnp.full((1, *index_tail), np.shape(value)[0], jnp.int32)
    return [eqn.primitive.bind(value, beyond, **eqn.params)]
  return [jax.lax.stop_gradient(value[:1]), jax.lax.stop_gradient(value[-1:])]


def _lookup_of_broadcast_ids(rw, eqn, operand, indices):
  """`table[ids[mapping]]` with a batch-free table: the lookup runs at U."""
  dn = eqn.params["dimension_numbers"]
  batch_dims = indices.user.ndim - 1  # the last axis of the indices holds the index vector
  if (not isinstance(operand, Plain) or operand.at_b or indices.axis != 0
      or dn.operand_batching_dims or any(d < batch_dims for d in dn.offset_dims)):
    return None
  out = eqn.primitive.bind(operand.value, indices.user, **eqn.params)
  rw.moved(eqn, out, indices)
  return [indices.like(out)]


def _within(indices: Plain, num_users: int) -> bool:
  lo, hi = indices.bounds or (-_INF, _INF)
  return lo >= 0 and hi <= num_users - 1


def nbytes(aval) -> int:
  return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize


def static_scalar(v) -> float | None:
  """The value of a scalar known at trace time, else None."""
  if not isinstance(v, Plain) or isinstance(v.value, jax.core.Tracer) or np.ndim(v.value) != 0:
    return None
  return np.asarray(v.value).item()


_PRESERVING = frozenset({P.broadcast_in_dim_p, P.reshape_p, P.squeeze_p, P.copy_p, P.slice_p,
                        P.dynamic_slice_p, P.transpose_p, P.rev_p, P.concatenate_p})


def bounds(eqn, operands) -> tuple[float, float] | None:
  """The static range of an integer (or boolean, as 0/1) result, where it can be inferred."""
  dtype = eqn.outvars[0].aval.dtype
  if not (jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_):
    return None
  try:
    known = _bounds(eqn, operands)
  except (TypeError, ValueError, OverflowError):  # unknown is always a safe answer
    return None
  return None if known is None or known == (-_INF, _INF) else known


def _range(v) -> tuple[float, float]:
  """`v`'s range; an infinite end is an unknown one."""
  known = static_scalar(v)
  if known is not None:
    return (known, known)
  return getattr(v, "bounds", None) or (-_INF, _INF)


def _bounds(eqn, operands):
  p, range_of = eqn.primitive, _range
  if p is P.iota_p:
    return (0, eqn.params["shape"][eqn.params["dimension"]] - 1)
  if p in _PRESERVING:
    ranges = [range_of(v) for v in operands[:1 if p is not P.concatenate_p else None]]
    return (min(r[0] for r in ranges), max(r[1] for r in ranges))
  if p is P.convert_element_type_p and _widening(eqn.invars[0].aval.dtype,
                                                  eqn.outvars[0].aval.dtype):
    return range_of(operands[0])
  if p is P.clamp_p:
    (lo, _), (x_lo, x_hi), (_, hi) = (range_of(v) for v in operands)
    return (max(lo, min(x_lo, hi)), min(hi, max(x_hi, lo)))
  if p in (P.max_p, P.min_p) and len(operands) == 2:
    (a_lo, a_hi), (b_lo, b_hi) = (range_of(v) for v in operands)
    return (max(a_lo, b_lo), max(a_hi, b_hi)) if p is P.max_p else (min(a_lo, b_lo),
                                                                    min(a_hi, b_hi))
  if p in (P.add_p, P.sub_p):  # these may wrap around: known only if every end is
    (a_lo, a_hi), (b_lo, b_hi) = (range_of(v) for v in operands)
    lo, hi = (a_lo + b_lo, a_hi + b_hi) if p is P.add_p else (a_lo - b_hi, a_hi - b_lo)
    dtype = eqn.outvars[0].aval.dtype
    inside = jnp.iinfo(dtype).min <= lo and hi <= jnp.iinfo(dtype).max
    return (lo, hi) if inside else None
  if p in (P.lt_p, P.ge_p):  # decided when one side's range is entirely on one side of the other
    (a_lo, a_hi), (b_lo, b_hi) = (range_of(v) for v in operands)
    true, false = (a_hi < b_lo, a_lo >= b_hi) if p is P.lt_p else (a_lo >= b_hi, a_hi < b_lo)
    return (1, 1) if true else (0, 0) if false else (0, 1)
  if p is P.select_n_p:
    pred, *cases = operands
    p_lo, p_hi = range_of(pred)
    chosen = [range_of(c) for i, c in enumerate(cases) if p_lo <= i <= p_hi]
    return (min(r[0] for r in chosen), max(r[1] for r in chosen)) if chosen else None
  return None


def _widening(source, target) -> bool:
  if source == jnp.bool_:
    return True
  if not (jnp.issubdtype(source, jnp.integer) and jnp.issubdtype(target, jnp.integer)):
    return False
  s, t = jnp.iinfo(source), jnp.iinfo(target)
  return t.min <= s.min and t.max >= s.max
