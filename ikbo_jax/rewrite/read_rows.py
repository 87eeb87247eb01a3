"""Work moved to batch U, differentiated only where the original computes it.

Work moved after a broadcast runs on every user row, but the original computes
only the rows some candidate reads. An unread row (a padding user, a user
whose candidates were all filtered out) may hold anything: a zero row that a
norm divides by, a count whose `log` is -inf, NaN. Its value never reaches an
output, since no candidate gathers it, but a derivative there can: its
cotangent is zero, and zero times a non-finite partial is NaN, which a weight's
gradient then sums over rows.

So each such op (`bind`) computes its value as written, on all rows, and its
derivative at the rows some candidate reads: every unread row is replaced by a
read row (`Broadcast.rows`) before the op is differentiated there. On a read
row that replacement is the identity, so the derivative is the original's; on
an unread row it is a derivative the original computed elsewhere, finite
where the original's is, and its zero cotangent keeps it out of every sum.
Its tangent is zero as well, chosen by `where` (`masked_tangent`): where the
read row's partial is infinite, the unread row's product of it with a zero
cotangent is NaN, and a tangent gathered from the read row would add that NaN
to the read row's gradient (an infinity in the original); `where` drops it.
A program that is not differentiated does no extra work: the replacement runs
only inside the derivative rule, whose value (computed at the read rows too)
differs from the op's only on rows that no candidate reads.

A custom derivative rule is entered the same way (`higher_order.py`).
Attention run at U has its own backward rule, which JAX cannot differentiate
forward inside such a rule, so its operands are replaced in the value itself
(`Broadcast.at_read_rows`, in `marker.py`); the IKBO ops give users without
candidates no gradient at all and take the rows as they are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def bind(eqn, fn, arrays, row_axes, rows):
  """`fn(*arrays)`, differentiated at read rows only.

  `row_axes` gives, per array, the axis holding user rows (None for any other
  operand: a weight, a scalar); `rows` is the broadcasts' `rows`. `eqn` is the
  equation `fn` computes: its result types decide whether there is a derivative.
  """
  if rows is None or not _differentiable(eqn, arrays):
    return fn(*arrays)

  @jax.custom_jvp
  def call(rows, *xs):
    del rows  # the value is computed as written; the rows matter to the derivative only
    return fn(*xs)

  @call.defjvp
  def call_jvp(primals, tangents):
    rows, *xs = primals
    # An unread row's tangent is zero, chosen by `where`: its cotangent, a zero times a
    # partial taken at another row's values (NaN where that partial is infinite), is
    # dropped rather than added anywhere. The value comes at the read rows as well: it
    # differs from `fn(*xs)` only on rows nothing reads, and the op runs once.
    at_read = [at_read_rows(x, rows, axis) for x, axis in zip(xs, row_axes)]
    read_only = [masked_tangent(t, rows, axis) for t, axis in zip(tangents[1:], row_axes)]
    return jax.jvp(fn, at_read, read_only)

  return call(rows, *arrays)


def at_read_rows(x, rows, axis):
  """`x` with every row that no candidate reads replaced by the first read row, `rows[0]`.

  A `where` with one row, not a gather by `rows`: the same values, and a chain of
  such ops differentiated one after another fuses without gathers of gathers (which
  XLA's CPU fusion emitter has failed to compile).
  """
  if axis is None or x.dtype == jax.dtypes.float0:
    return x
  first_read = jax.lax.dynamic_index_in_dim(x, rows[0], axis, keepdims=True)
  return jnp.where(_read_mask(rows, x.ndim, axis), x, first_read)


def masked_tangent(t, rows, axis):
  """`t` with the rows that no candidate reads set to zero (`rows[r] != r`)."""
  if axis is None or t.dtype == jax.dtypes.float0:
    return t
  return jnp.where(_read_mask(rows, t.ndim, axis), t, jnp.zeros((), t.dtype))


def _read_mask(rows, ndim: int, axis: int):
  """`bool`, broadcastable along `axis` of a rank-`ndim` array: whether a candidate reads the row."""
  read = rows == jnp.arange(rows.shape[0], dtype=rows.dtype)
  shape = [1] * ndim
  shape[axis] = rows.shape[0]
  return read.reshape(shape)


def _differentiable(eqn, arrays) -> bool:
  """Whether a derivative can flow: a float operand and float results."""
  return (any(jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in arrays)
          and all(jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in eqn.outvars))
