"""Per-primitive rules for row-wise work: elementwise ops, shapes, reductions, concatenation.

A rule takes the rewriter, the equation and its interpreted operands, and
returns the interpreted results, or None to fall back to the equation as
written. Each rule moves work to batch U only by an identity that holds for
every input: for a row-wise `f`, `f(take(u, ids)) = take(f(u), ids)` (the same
rows, computed once per user). Products live in `dense.py`, gathers in
`gathers.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lax.lax import split_p, stack_p  # not among jax.extend's primitives
from jax.extend.core import primitives as P

from ikbo_jax.rewrite import read_rows
from ikbo_jax.rewrite.report import Decline
from ikbo_jax.rewrite.values import (Broadcast, Concat, Plain, RowConstant, at_b, at_u,
                                     materialize, part_shape)

# Rules are keyed by primitive objects, as in `jax.experimental.sparse`: a primitive
# renamed or removed by a JAX release fails here, at import, not silently.
ELEMENTWISE = (
    P.abs_p, P.acos_p, P.acosh_p, P.add_p, P.and_p, P.asin_p, P.asinh_p, P.atan_p, P.atan2_p,
    P.atanh_p, P.cbrt_p, P.ceil_p, P.clamp_p, P.convert_element_type_p, P.cos_p, P.cosh_p,
    P.div_p, P.eq_p, P.erf_p, P.erf_inv_p, P.erfc_p, P.exp_p, P.exp2_p, P.expm1_p, P.floor_p,
    P.ge_p, P.gt_p, P.imag_p, P.integer_pow_p, P.is_finite_p, P.le_p, P.lgamma_p, P.log_p,
    P.log1p_p, P.logistic_p, P.lt_p, P.max_p, P.min_p, P.mul_p, P.ne_p, P.neg_p, P.nextafter_p,
    P.not_p, P.or_p, P.pow_p, P.real_p, P.reduce_precision_p, P.rem_p, P.round_p, P.rsqrt_p,
    P.select_n_p, P.sign_p, P.sin_p, P.sinh_p, P.sqrt_p, P.square_p, P.sub_p, P.tan_p,
    P.tanh_p, P.xor_p, P.copy_p,
    # The identity with a zero tangent, row by row: `jax.nn.softmax`, `log_softmax` and
    # `logsumexp` apply it to the row maximum they subtract.
    P.stop_gradient_p)
REDUCTIONS = (P.reduce_sum_p, P.reduce_max_p, P.reduce_min_p, P.reduce_prod_p, P.reduce_and_p,
              P.reduce_or_p, P.argmax_p, P.argmin_p)
CUMULATIVE = (P.cumsum_p, P.cumprod_p, P.cummax_p, P.cummin_p, P.cumlogsumexp_p)


def scalar(v) -> bool:
  return isinstance(v, Plain) and not v.at_b and np.ndim(v.value) == 0


def user_operands(operands, lead: Broadcast):
  """The operands at U for a row-wise op on broadcasts like `lead`, or None."""
  out = []
  for v in operands:
    if isinstance(v, Broadcast) and v.ids is lead.ids and v.axis == lead.axis:
      out.append(v.user)
    elif scalar(v):
      out.append(v.value)
    elif isinstance(v, RowConstant) and not v.varies_along(lead.axis):
      out.append(v.at_users(lead.num_users, lead.axis))
    elif isinstance(v, Plain) and np.ndim(v.value) > lead.axis and np.shape(
        v.value)[lead.axis] == 1:  # lax's size-1 broadcasting: the same for every row
      out.append(v.value)
    else:
      return None
  return out


def _bound(eqn):
  """The equation's primitive with its parameters, as a function of its operands."""
  return lambda *operands: eqn.primitive.bind(*operands, **eqn.params)


def first_broadcast(operands):
  return next((v for v in operands if isinstance(v, Broadcast)), None)


def _compact(v, rank: int):
  """`v` with size 1 along the axes it is constant on, or None if it has no such form."""
  if isinstance(v, RowConstant):
    return v.compact
  if isinstance(v, Plain) and np.ndim(v.value) in (0, rank):
    return v.value if np.ndim(v.value) else jnp.reshape(v.value, (1,) * rank)
  return None


def row_constant_elementwise(rw, eqn, operands):
  """An elementwise op on values constant along some axes is constant along all of them."""
  if not any(isinstance(v, RowConstant) for v in operands):
    return None
  shape = tuple(eqn.outvars[0].aval.shape)
  compacts = [_compact(v, len(shape)) for v in operands]
  if any(c is None for c in compacts):
    return None
  # To one compact shape: not every primitive broadcasts size-1 axes (select_n does not).
  common = tuple(max(np.shape(c)[d] if np.ndim(c) else 1 for c in compacts)
                 for d in range(len(shape)))
  if common == shape:  # constant along no axis: an ordinary value
    return None
  compacts = [c if np.ndim(c) == 0 else
              jax.lax.broadcast_in_dim(c, common, tuple(range(len(common)))) for c in compacts]
  out = eqn.primitive.bind(*compacts, **eqn.params)
  return [RowConstant(out, shape, any(at_u(v) for v in operands),
                      any(at_b(v) for v in operands))]


def iota(rw, eqn, operands):
  shape, dimension = tuple(eqn.params["shape"]), eqn.params["dimension"]
  if len(shape) < 2 or eqn.params.get("sharding") is not None:
    return None
  compact_shape = tuple(n if d == dimension else 1 for d, n in enumerate(shape))
  compact = jax.lax.broadcasted_iota(eqn.params["dtype"], compact_shape, dimension)
  return [RowConstant(compact, shape)]


def elementwise(rw, eqn, operands):
  lead = first_broadcast(operands)
  if lead is None:
    return row_constant_elementwise(rw, eqn, operands)
  users = user_operands(operands, lead)
  if users is None:
    raise Decline("its operands are not all rows of one broadcast, constants along its axis "
                  "or scalars")
  row_axes = [lead.axis if isinstance(v, (Broadcast, RowConstant)) else None for v in operands]
  out = read_rows.bind(eqn, _bound(eqn), users, row_axes, lead.rows)
  rw.moved(eqn, out, lead)
  return [lead.like(out)]


def broadcast_in_dim(rw, eqn, operands):
  (v, *dyn) = operands
  if dyn:
    return None
  shape, dims = tuple(eqn.params["shape"]), tuple(eqn.params["broadcast_dimensions"])
  if isinstance(v, Broadcast):
    axis = dims[v.axis]
    user_shape = list(shape)
    user_shape[axis] = v.num_users
    out = jax.lax.broadcast_in_dim(v.user, tuple(user_shape), dims)
    rw.moved(eqn, out, v)
    return [v.like(out, axis)]
  if not shape or not isinstance(v, (RowConstant, Plain)):
    return None
  source = v.compact if isinstance(v, RowConstant) else v.value
  compact_shape = [1] * len(shape)  # new axes are constant ...
  for src_axis, out_axis in enumerate(dims):  # ... mapped ones keep the source's extent
    compact_shape[out_axis] = np.shape(source)[src_axis]
  if tuple(compact_shape) == shape:  # constant along no axis: an ordinary value
    return None
  compact = jax.lax.broadcast_in_dim(source, tuple(compact_shape), dims)
  return [RowConstant(compact, shape, at_u(v), at_b(v))]


def reshape(rw, eqn, operands):
  v = operands[0]
  new_sizes = tuple(eqn.params["new_sizes"])
  if eqn.params.get("dimensions"):
    return None
  if isinstance(v, RowConstant):
    return _unit_axes_reshaped(v, new_sizes) or _repeated_rows(rw, eqn, v, new_sizes)
  if not isinstance(v, Broadcast):
    return None
  if v.axis != 0 or new_sizes[:1] != v.shape[:1]:
    raise Decline("the reshape does not keep the candidate axis as the leading axis")
  out = jnp.reshape(v.user, (v.num_users, *new_sizes[1:]))
  rw.moved(eqn, out, v)
  return [v.like(out)]


def _unit_axes_reshaped(v: RowConstant, new_sizes):
  """A reshape that only adds or drops size-1 axes keeps a row-constant value row-constant
  (`take_along_axis` adds one to its index); None for any other."""
  kept = [d for d, n in enumerate(v.shape) if n != 1]
  if [v.shape[d] for d in kept] != [n for n in new_sizes if n != 1]:
    return None
  extents = iter(v.compact.shape[d] for d in kept)
  compact = jnp.reshape(v.compact, tuple(next(extents) if n != 1 else 1 for n in new_sizes))
  return [RowConstant(compact, tuple(new_sizes), v.at_u, v.at_b)]


def _repeated_rows(rw, eqn, v: RowConstant, new_sizes):
  """`reshape(broadcast(user[:, None], (U, r, ...)), (U * r, ...))`: each user row `r` times.

  That is `jnp.repeat(user, r, axis=0)` and `jnp.broadcast_to` of a uniform
  ratio: the rows of `take(user, arange(U * r) // r)`, exactly.
  """
  if (len(v.shape) < 2 or not v.at_u or v.at_b or not v.varies_along(0) or v.varies_along(1)
      or new_sizes != (v.shape[0] * v.shape[1], *v.shape[2:])):
    return None
  num_users, ratio = v.shape[0], v.shape[1]
  rows = jax.lax.broadcast_in_dim(v.compact[:, 0], (num_users, *v.shape[2:]),
                                  tuple(range(len(v.shape) - 1)))
  ids = rw.memo(("repeat", num_users, ratio), None,
                lambda _: jnp.arange(num_users * ratio, dtype=jnp.int32) // ratio)
  rw.report.add("broadcast", eqn)
  return [Broadcast(rows, ids, 0)]


def squeeze(rw, eqn, operands):
  v, dims = operands[0], tuple(eqn.params["dimensions"])
  if isinstance(v, RowConstant):
    return [RowConstant(jax.lax.squeeze(v.compact, dims), tuple(eqn.outvars[0].aval.shape),
                        v.at_u, v.at_b)]
  if not isinstance(v, Broadcast):
    return None
  if v.axis in dims:  # B = 1: the one row is the one user row
    raise Decline("the squeezed axis is the candidate axis")
  out = jax.lax.squeeze(v.user, dims)
  rw.moved(eqn, out, v)
  return [v.like(out, v.axis - sum(d < v.axis for d in dims))]


def transpose(rw, eqn, operands):
  v, perm = operands[0], tuple(eqn.params["permutation"])
  if isinstance(v, Concat) and perm[0] == 0:  # a stack turned for a pairwise product
    parts = tuple(_transposed(rw, eqn, p, perm) for p in v.parts)
    return [Concat(parts, v.ids, perm.index(v.dimension))]
  if not isinstance(v, Broadcast):
    return None
  return [_transposed(rw, eqn, v, perm)]


def _transposed(rw, eqn, v, perm):
  if isinstance(v, Broadcast):
    out = jax.lax.transpose(v.user, perm)
    rw.moved(eqn, out, v)
    return v.like(out, perm.index(v.axis))
  array = v.value if isinstance(v, Plain) else v.materialize()
  return Plain(jax.lax.transpose(array, perm), True)


def _keeps_rows(v: Broadcast, eqn) -> bool:
  """Whether a slice, pad or reversal leaves the candidate axis whole and in order."""
  primitive, axis = eqn.primitive, v.axis
  if primitive is P.slice_p:
    strides = eqn.params["strides"] or (1,) * len(v.shape)
    return (eqn.params["start_indices"][axis] == 0 and strides[axis] == 1
            and eqn.params["limit_indices"][axis] == v.shape[axis])
  if primitive is P.pad_p:
    return tuple(eqn.params["padding_config"][axis]) == (0, 0, 0)
  return axis not in eqn.params["dimensions"]  # rev


def along_features(rw, eqn, operands):
  """`slice`, `pad` and `rev` along axes other than the candidate axis run at U."""
  v, *rest = operands
  if not isinstance(v, Broadcast) or not all(scalar(r) for r in rest):
    return None
  if not _keeps_rows(v, eqn):
    raise Decline("it slices, pads or reverses the candidate axis")
  params = dict(eqn.params)
  if eqn.primitive is P.slice_p:
    params["limit_indices"] = tuple(v.num_users if d == v.axis else n
                                    for d, n in enumerate(params["limit_indices"]))
  out = eqn.primitive.bind(v.user, *(r.value for r in rest), **params)
  rw.moved(eqn, out, v)
  return [v.like(out)]


def split(rw, eqn, operands):
  """`split` along a feature axis (`jnp.split` of FiLM parameters): each part is the user
  rows' part, at U."""
  (v,) = operands
  if not isinstance(v, Broadcast):
    return None
  if eqn.params["axis"] == v.axis:
    raise Decline("it splits the candidate axis")
  outs = eqn.primitive.bind(v.user, **eqn.params)
  rw.moved(eqn, outs[0], v)
  return [v.like(out) for out in outs]


def reduction(rw, eqn, operands):
  v = operands[0]
  if not isinstance(v, Broadcast) or len(operands) != 1:
    return None
  if v.axis in eqn.params["axes"]:
    raise Decline("it reduces over the candidate axis")
  return [reduced_rows(rw, eqn, v, _bound(eqn))]


def reduced_rows(rw, eqn, v: Broadcast, reduce) -> Broadcast:
  """`reduce` (the equation's reduction, over axes other than the candidate axis) of a
  broadcast's user rows, at U; padding rows stay harmless in its derivative."""
  axes = eqn.params["axes"]
  out = read_rows.bind(eqn, reduce, [v.user], [v.axis], v.rows)
  rw.moved(eqn, out, v)
  return v.like(out, v.axis - sum(a < v.axis for a in axes))


def cumulative(rw, eqn, operands):
  v = operands[0]
  if not isinstance(v, Broadcast):
    return None
  if eqn.params["axis"] == v.axis:
    raise Decline("it accumulates along the candidate axis")
  out = read_rows.bind(eqn, _bound(eqn), [v.user], [v.axis], v.rows)
  rw.moved(eqn, out, v)
  return [v.like(out)]


def concatenate(rw, eqn, operands):
  lead = first_broadcast(operands)
  if lead is None:
    return None
  dim = eqn.params["dimension"]
  if dim != lead.axis:
    users = user_operands(operands, lead)
    if users is not None:
      out = jax.lax.concatenate(users, dim)
      rw.moved(eqn, out, lead)
      return [lead.like(out)]
  if lead.axis != 0 or dim == 0:
    raise Decline("it concatenates along the candidate axis")
  for v in operands:  # broadcasts by other indices too: a dense layer splits by level
    if isinstance(v, Broadcast) and v.axis != 0:
      raise Decline("it concatenates broadcasts along different axes")
    if isinstance(v, Concat):
      raise Decline("it concatenates a concatenation")
  return [Concat(tuple(operands), lead.ids, dim)]


def stack(rw, eqn, operands):
  """`stack(xs, axis)` is the concatenation of the `xs` with a new size-1 axis."""
  lead, axis = first_broadcast(operands), eqn.params["axis"]
  if lead is None or lead.axis != 0 or axis == 0:
    return None
  expanded = []
  for v in operands:
    if isinstance(v, Broadcast):
      expanded.append(v.like(jnp.expand_dims(v.user, axis)))
    elif isinstance(v, Concat):
      raise Decline("it stacks a concatenation")
    else:
      expanded.append(Plain(jnp.expand_dims(materialize(v), axis), at_b(v), at_u(v)))
  if all(isinstance(v, Broadcast) and v.ids is lead.ids for v in expanded):
    out = jnp.concatenate([v.user for v in expanded], axis)
    rw.moved(eqn, out, lead)
    return [lead.like(out)]
  if any(isinstance(v, Broadcast) and v.ids is not lead.ids for v in expanded):
    raise Decline("it stacks broadcasts by different indices")
  return [Concat(tuple(expanded), lead.ids, axis)]


def checkpoint_name(rw, eqn, operands):
  """`checkpoint_name(rows, name)` of a broadcast: the name goes on the user rows at U.

  A remat policy that saves the named value then keeps U rows instead of B.
  """
  (v,) = operands
  if not isinstance(v, Broadcast):
    return None
  out = eqn.primitive.bind(v.user, **eqn.params)
  rw.moved(eqn, out, v)
  return [v.like(out)]


def parts_sizes(stack: Concat) -> list[int]:
  return [part_shape(p)[stack.dimension] for p in stack.parts]


def parts_starts(stack: Concat) -> list[int]:
  """Where each part begins along the stacking axis, and where the last ends."""
  return [0, *np.cumsum(parts_sizes(stack)).tolist()]


RULES = {p: elementwise for p in ELEMENTWISE}
RULES.update({p: reduction for p in REDUCTIONS})
RULES.update({p: cumulative for p in CUMULATIVE})
RULES.update({P.broadcast_in_dim_p: broadcast_in_dim, P.reshape_p: reshape, P.iota_p: iota,
              P.squeeze_p: squeeze, P.transpose_p: transpose, P.concatenate_p: concatenate,
              P.slice_p: along_features, P.pad_p: along_features, P.rev_p: along_features,
              split_p: split, stack_p: stack, P.name_p: checkpoint_name})
