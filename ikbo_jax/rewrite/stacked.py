"""Rules for stacked fields: elementwise work and reductions on a `Concat`, part by part.

Ranking models stack user and candidate fields, `stack([user[c2u], ...,
cand], axis=1)`, and then square them, weight them field by field, and sum or
take the maximum across fields (a factorization machine's `sum(v)^2 -
sum(v^2)`, FiBiNET's squeeze, a max-pooled field set). A `Concat` keeps the
stack's parts apart, and each identity used here holds for every input:

- an elementwise op on stacks with the same part boundaries (and on scalars,
  or values constant along the candidate axis, sliced at the boundaries) is
  that op on each part: a user part's runs once per user;
- a reduction along other axes is that reduction of each part;
- a reduction across the stacking axis is the reduction of each part's
  reduction: the same for `and` and `or`; for sums and products the same in
  real arithmetic, derivatives included, with the parts' partial results
  combined in float32 (or wider) and rounded once, as a single reduction
  accumulates. Not so for max and min: where fields tie, a single reduction
  shares the derivative equally among all tied elements, a maximum of the
  parts' maxima among the tied parts first, so those run as written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import primitives as P

from ikbo_jax.rewrite import rules
from ikbo_jax.rewrite.report import Decline
from ikbo_jax.rewrite.values import Broadcast, Concat, Plain, RowConstant, lineage, materialize

# Across the stacking axis: how two parts' reductions combine (max and min do not: ties).
_COMBINE = {P.reduce_sum_p: jax.lax.add, P.reduce_prod_p: jax.lax.mul,
            P.reduce_and_p: jax.lax.bitwise_and, P.reduce_or_p: jax.lax.bitwise_or}
_ROUNDED = (P.reduce_sum_p, P.reduce_prod_p)


def _part_operand(v, stack: Concat, index: int, bounds: list[int]):
  """Operand `v` of an op on `stack`, restricted to the stack's part `index`."""
  if isinstance(v, Concat):
    return v.parts[index]
  if rules.scalar(v):
    return v
  dim, start, stop = stack.dimension, bounds[index], bounds[index + 1]
  if isinstance(v, RowConstant):
    compact = v.compact
    if v.varies_along(dim):
      compact = jax.lax.slice_in_dim(compact, start, stop, axis=dim)
    shape = list(v.shape)
    shape[dim] = stop - start
    return RowConstant(compact, tuple(shape), v.at_u, v.at_b)
  if isinstance(v, Plain) and np.ndim(v.value) == len(stack.shape):
    if np.shape(v.value)[dim] == 1:  # lax's size-1 broadcasting: the same for every field
      return v
    if np.shape(v.value)[dim] == stack.shape[dim]:
      return Plain(jax.lax.slice_in_dim(v.value, start, stop, axis=dim), v.at_b, v.at_u,
                   v.mapped)
  raise Decline("an operand of the stack is neither a stack with its parts, a scalar nor "
                "constant along the candidate axis")


def elementwise(rw, eqn, operands):
  """An elementwise op on stacks: the op on each part (a user part's at U)."""
  stacks = [v for v in operands if isinstance(v, Concat)]
  if not stacks:
    return rules.elementwise(rw, eqn, operands)
  lead = stacks[0]
  bounds = rules.parts_starts(lead)
  if any(s.dimension != lead.dimension or rules.parts_starts(s) != bounds for s in stacks):
    raise Decline("its stacks are split at different fields")
  parts = []
  for index in range(len(lead.parts)):
    part_operands = [_part_operand(v, lead, index, bounds) for v in operands]
    if any(isinstance(v, Broadcast) for v in part_operands):
      (out,) = rules.elementwise(rw, eqn, part_operands)
    else:
      out = lineage(part_operands, [eqn.primitive.bind(*map(materialize, part_operands),
                                                       **eqn.params)])[0]
    parts.append(out)
  return [Concat(tuple(parts), lead.ids, lead.dimension)]


def reduction(rw, eqn, operands):
  """A reduction of a stack: along other axes part by part, across the stacking axis by
  combining the parts' reductions."""
  (v,) = operands[:1]
  if not isinstance(v, Concat) or len(operands) != 1:
    return rules.reduction(rw, eqn, operands)
  axes = tuple(eqn.params["axes"])
  if 0 in axes:
    raise Decline("it reduces over the candidate axis")
  if v.dimension not in axes:
    bind = lambda x: eqn.primitive.bind(x, **eqn.params)
    parts = tuple(_reduced(rw, eqn, p, bind) for p in v.parts)
    return [Concat(parts, v.ids, v.dimension - sum(a < v.dimension for a in axes))]
  if eqn.primitive not in _COMBINE:
    raise Decline("where fields tie, a maximum or minimum of the parts' would share the "
                  "derivative otherwise than one across all fields (or it is argmax, argmin)")
  out_dtype = eqn.outvars[0].aval.dtype
  acc = out_dtype
  if eqn.primitive in _ROUNDED and jnp.issubdtype(out_dtype, jnp.floating):
    acc = jnp.promote_types(out_dtype, jnp.float32)
  reduce = lambda x: eqn.primitive.bind(x.astype(acc), **eqn.params)
  parts = [_reduced(rw, eqn, p, reduce) for p in v.parts]
  combine = _COMBINE[eqn.primitive]
  first = parts[0]
  if all(isinstance(p, Broadcast) and p.ids is first.ids and p.axis == first.axis
         for p in parts):
    total = first.user
    for p in parts[1:]:
      total = combine(total, p.user)
    return [first.like(total.astype(out_dtype))]
  for p in parts:
    if isinstance(p, Broadcast):  # its reduced rows, copied to B to meet a candidate part's
      rw.report.add("materialized", eqn, bytes_saved=-int(np.prod(p.shape)) * np.dtype(
          p.user.dtype).itemsize, reason="the fields' reductions combine at B")
  total = materialize(first)
  for p in parts[1:]:
    total = combine(total, materialize(p))
  return lineage(operands, [total.astype(out_dtype)])


def _reduced(rw, eqn, part, reduce):
  """`reduce` of one part: a user part's at U."""
  if isinstance(part, Broadcast):
    return rules.reduced_rows(rw, eqn, part, reduce)
  return lineage([part], [reduce(materialize(part))])[0]


RULES = {p: elementwise for p in rules.ELEMENTWISE}
RULES.update({p: reduction for p in rules.REDUCTIONS})
