"""Per-user sums of candidate rows in float32, in a fixed order: the same bits on every call.

The backward of every IKBO op sums candidate rows per user (the transpose of
the broadcast). XLA's scatter-add (`jax.ops.segment_sum`, `x.at[ids].add`)
adds duplicate ids with atomics on a GPU, in whatever order the threads
arrive, so two identical calls can differ in the last bits. Here no
floating-point sum ever depends on arrival order:

- up to `ONE_HOT_MAX_USERS` users, one GEMM with a one-hot matrix (a fixed
  reduction order, and the fastest form there: 0.056 ms against 0.164 ms for
  the scatter-add at the published linear-compression shape on the H200,
  `benchmarks/results/lce_diagnostics_h200.json`);
- beyond that, `add_sorted_chunk`: rows in the index's sort order, a chunk at
  a time, each chunk's rows of one user summed by a small one-hot GEMM and
  added to the total with a scatter whose ids are all distinct (so even an
  atomic add has one writer per element).

A one-hot GEMM multiplies every row by every user's 0 or 1, and `0 * NaN` is
NaN: one non-finite candidate row would reach every user's sum. So only when
some sum and some value are not finite (`lax.cond`) does the GEMM run again on
the finite values, and counts of the NaN, +Inf and -Inf per user and element
put back what a plain sum of that user's rows gives there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
ONE_HOT_MAX_USERS = 256
# Rows per step of the sorted sweep: the one-hot GEMM's cost grows with it, the steps' count shrinks.
SORTED_CHUNK = 64


def one_hot_sum(one_hot, x):
  """`einsum("sc,c...->s...", one_hot, x)` in float32, for a 0/1 `one_hot`.

  A non-finite value of `x` reaches only the sums whose rows hold it.
  """
  gemm = lambda v: jnp.einsum("sc,c...->s...", one_hot.astype(v.dtype), v,
                              preferred_element_type=_F32, precision=_HIGHEST)

  def with_non_finite():
    finite = jnp.isfinite(x)
    total = gemm(jnp.where(finite, x, jnp.zeros((), x.dtype)))
    holds = lambda mask: gemm(mask.astype(_F32)) > 0
    nan, pos, neg = holds(jnp.isnan(x)), holds(x == jnp.inf), holds(x == -jnp.inf)
    return jnp.where(nan | (pos & neg), jnp.nan,
                     jnp.where(pos, jnp.inf, jnp.where(neg, -jnp.inf, total)))

  # The sums are checked before x, which is read only where a sum is not finite: a
  # non-finite value of x makes its user's sum non-finite (a 1 times NaN or Inf, added to
  # anything, stays NaN or Inf), so finite sums are the plain GEMM's, and the [U, ...]
  # sums cost far less to read than the [B, ...] rows. Non-finite sums of finite rows (an
  # overflow) are the plain GEMM's too.
  total = gemm(x)
  return jax.lax.cond(
      jnp.all(jnp.isfinite(total)), lambda: total,
      lambda: jax.lax.cond(jnp.all(jnp.isfinite(x)), lambda: total, with_non_finite))


def add_sorted_chunk(total, rows, ids):
  """`total[u] += sum of rows[i] with ids[i] == u`, for `ids` sorted ascending.

  Args:
    total: `float32[U, ...]`, the running sums.
    rows: `[C, ...]` (any float dtype), one chunk of candidate rows.
    ids: `int32[C]`, sorted; ids outside `[0, U)` (padding) are dropped.

  Each run of equal ids becomes one segment, summed by a `[C, C]` one-hot GEMM
  at full float32 precision; the segments' ids are distinct, so the final
  scatter has one writer per element.
  """
  chunk = ids.shape[0]
  starts = jnp.concatenate([jnp.ones((1,), bool), ids[1:] != ids[:-1]])
  segment = jnp.cumsum(starts) - 1
  one_hot = (segment[None, :] == jnp.arange(chunk)[:, None]).astype(_F32)
  sums = one_hot_sum(one_hot, rows.astype(_F32))
  (first,) = jnp.nonzero(starts, size=chunk, fill_value=-1)
  # Unused segments get distinct ids past U, dropped like the padding's.
  num_users = total.shape[0]
  first_id = ids[first]
  real = (first >= 0) & (first_id >= 0) & (first_id < num_users)
  segment_ids = jnp.where(real, first_id, num_users + 1 + jnp.arange(chunk))
  return total.at[segment_ids].add(sums, mode="drop", unique_indices=True)


def sum_per_user(x, cand_to_user, num_users: int):
  """`out[u] = sum_{b: cand_to_user[b] = u} x[b]` in float32, bit-identical across calls.

  `cand_to_user` must lie in `[0, U)`.
  """
  if num_users <= ONE_HOT_MAX_USERS:
    return one_hot_sum(jax.nn.one_hot(cand_to_user, num_users, dtype=x.dtype, axis=0), x)
  order = jnp.argsort(cand_to_user, stable=True)
  ids = in_chunks(cand_to_user[order], SORTED_CHUNK, fill=num_users)
  rows = in_chunks(x[order], SORTED_CHUNK)
  total = jnp.zeros((num_users, *x.shape[1:]), _F32)
  total, _ = jax.lax.scan(lambda acc, chunk: (add_sorted_chunk(acc, *chunk), None), total,
                          (rows, ids))
  return total


def in_chunks(x, chunk: int, fill=0):
  """`[B, ...]` padded with `fill` to whole chunks, as `[num_chunks, chunk, ...]`."""
  padded = -(-x.shape[0] // chunk) * chunk
  x = jnp.pad(x, [(0, padded - x.shape[0])] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
  return x.reshape(padded // chunk, chunk, *x.shape[1:])
