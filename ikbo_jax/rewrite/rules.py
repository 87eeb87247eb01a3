"""Per-primitive rules: how each primitive treats broadcast (user-row) operands.

A rule takes the rewriter, the equation and its interpreted operands, and
returns the interpreted results, or None to fall back to the default (the
operands made ordinary, the primitive bound as written). Rules only ever
move work to batch U when the result is provably the same rows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ikbo_jax.rewrite.values import (Broadcast, Concat, Mapping, Negative, Plain, RowConstant,
                                     Shifted)

ELEMENTWISE = frozenset("""
abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type cos cosh
div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow is_finite le lgamma log log1p
logistic lt max min mul ne neg nextafter not or pow real reduce_precision rem round rsqrt select_n
sign sin sinh sqrt square sub tan tanh xor copy copy_p
""".split())
REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax "
                       "argmin".split())
CUMULATIVE = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())


def _scalar(v) -> bool:
  return isinstance(v, Plain) and not v.at_b and np.ndim(v.value) == 0


def _user_operands(rw, operands, ids, axis):
  """The operands at U for an op on broadcasts of `ids` along `axis`, or None."""
  out = []
  for v in operands:
    if isinstance(v, Broadcast) and v.ids is ids and v.axis == axis:
      out.append(v.user)
    elif _scalar(v):
      out.append(v.value)
    elif isinstance(v, RowConstant) and not v.varies_along(axis):
      out.append(v.at_users(rw.num_users, axis))
    elif isinstance(v, Plain) and not v.at_b and np.ndim(v.value) > axis and np.shape(
        v.value)[axis] == 1:  # lax's size-1 broadcasting (a bias reshaped to [1, F])
      out.append(v.value)
    else:
      return None
  return out


def _first_broadcast(operands):
  return next((v for v in operands if isinstance(v, Broadcast)), None)


def _compact(v, rank: int):
  """`v` with size 1 along the axes it is constant on, if batch-free, else None."""
  if isinstance(v, RowConstant):
    return v.compact
  if isinstance(v, Plain) and not v.at_b and np.ndim(v.value) in (0, rank):
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
  compacts = [c if np.ndim(c) == 0 else jax.lax.broadcast_in_dim(c, common, tuple(range(len(common))))
              for c in compacts]
  out = eqn.primitive.bind(*compacts, **eqn.params)
  return [RowConstant(out, shape)]


def iota(rw, eqn, operands):
  shape, dimension = tuple(eqn.params["shape"]), eqn.params["dimension"]
  if len(shape) < 2 or eqn.params.get("sharding") is not None:
    return None
  compact_shape = tuple(n if d == dimension else 1 for d, n in enumerate(shape))
  compact = jax.lax.broadcasted_iota(eqn.params["dtype"], compact_shape, dimension)
  return [RowConstant(compact, shape)]


def elementwise(rw, eqn, operands):
  lead = _first_broadcast(operands)
  if lead is None:
    return row_constant_elementwise(rw, eqn, operands)
  users = _user_operands(rw, operands, lead.ids, lead.axis)
  if users is None:
    return None
  out = eqn.primitive.bind(*users, **eqn.params)
  rw.moved(eqn, out, lead)
  return [lead.like(out)]


def mapping_ops(rw, eqn, operands):
  """Index normalization: `select_n(ids < 0, ids, ids + U)`, reshapes and casts of the mapping."""
  name, first = eqn.primitive.name, operands[0]
  if name == "add" and isinstance(first, Mapping) and _scalar(operands[1]):
    return [Shifted(first.ids, operands[1].value, first.shape)]
  if (name == "lt" and isinstance(first, Mapping) and _scalar(operands[1])
      and not isinstance(operands[1].value, jax.core.Tracer) and operands[1].value == 0):
    return [Negative(first.ids, first.shape)]
  # `where(ids < 0, ids + c, ids)` is `ids` for valid (non-negative) ids.
  if name == "select_n" and len(operands) == 3:
    pred, on_false, on_true = operands
    if (isinstance(pred, Negative) and isinstance(on_false, Mapping)
        and isinstance(on_true, Shifted) and on_false.shape == on_true.shape == pred.shape):
      return [on_false]
  # Clamping to the valid range keeps a valid mapping what it is (`jnp.clip`, `mode="clip"`).
  if name == "clamp" and isinstance(operands[1], Mapping) and _scalar(operands[0]) and _scalar(
      operands[2]):
    return [operands[1]]
  if name in ("max", "min") and len(operands) == 2:
    ids = [v for v in operands if isinstance(v, Mapping)]
    if len(ids) == 1 and any(_scalar(v) for v in operands):
      return ids
  if isinstance(first, Mapping):
    shape = tuple(eqn.outvars[0].aval.shape)
    if name == "convert_element_type" and jnp.issubdtype(eqn.params["new_dtype"], jnp.integer):
      return [first]
    if name in ("broadcast_in_dim", "reshape") and shape in ((first.ids.shape[0],),
                                                           (first.ids.shape[0], 1)):
      return [Mapping(first.ids, shape)]
  return None


def _lookup_of_broadcast_ids(rw, eqn, operand, indices):
  """`table[ids[mapping]]` with a batch-free table: the lookup runs at U."""
  dn = eqn.params["dimension_numbers"]
  batch_dims = indices.user.ndim - 1  # the last axis of the indices holds the index vector
  if (indices.axis != 0 or dn.operand_batching_dims
      or any(d < batch_dims for d in dn.offset_dims)):
    return None
  out = eqn.primitive.bind(operand.value, indices.user, **eqn.params)
  rw.moved(eqn, out, indices)
  return [indices.like(out)]


def gather(rw, eqn, operands):
  operand, indices = operands
  if isinstance(indices, Broadcast) and isinstance(operand, Plain) and not operand.at_b:
    return _lookup_of_broadcast_ids(rw, eqn, operand, indices)
  dn = eqn.params["dimension_numbers"]
  if not (isinstance(indices, Mapping) and indices.shape == (indices.ids.shape[0], 1)
          and isinstance(operand, Plain) and not operand.at_b):
    return None
  rank = np.ndim(operand.value)
  if (dn.collapsed_slice_dims != (0,) or dn.start_index_map != (0,)
      or dn.offset_dims != tuple(range(1, rank)) or dn.operand_batching_dims
      or tuple(eqn.params["slice_sizes"]) != (1, *np.shape(operand.value)[1:])):
    return None
  rw.num_users = np.shape(operand.value)[0]
  result = Broadcast(operand.value, indices.ids, 0)
  rw.report.add("broadcast", eqn, bytes_saved=_nbytes(eqn.outvars[0].aval))
  return [result]


def broadcast_in_dim(rw, eqn, operands):
  (v, *dyn) = operands
  if dyn:
    return None
  shape, dims = tuple(eqn.params["shape"]), tuple(eqn.params["broadcast_dimensions"])
  if shape and (isinstance(v, RowConstant) or (isinstance(v, Plain) and not v.at_b)):
    source = v.compact if isinstance(v, RowConstant) else v.value
    compact_shape = [1] * len(shape)  # new axes are constant ...
    for src_axis, out_axis in enumerate(dims):  # ... mapped ones keep the source's extent
      compact_shape[out_axis] = np.shape(source)[src_axis]
    compact = jax.lax.broadcast_in_dim(source, tuple(compact_shape), dims)
    return [RowConstant(compact, shape)]
  if isinstance(v, Broadcast):
    axis = dims[v.axis]
    user_shape = list(shape)
    user_shape[axis] = v.user.shape[v.axis]
    out = jax.lax.broadcast_in_dim(v.user, tuple(user_shape), dims)
    rw.moved(eqn, out, v)
    return [v.like(out, axis)]
  return mapping_ops(rw, eqn, operands)


def reshape(rw, eqn, operands):
  v = operands[0]
  if not isinstance(v, Broadcast) or v.axis != 0 or eqn.params.get("dimensions"):
    return mapping_ops(rw, eqn, operands)
  new_sizes = tuple(eqn.params["new_sizes"])
  if new_sizes[:1] != v.shape[:1]:  # rows must stay rows
    return None
  out = jnp.reshape(v.user, (v.user.shape[0], *new_sizes[1:]))
  rw.moved(eqn, out, v)
  return [v.like(out)]


def transpose(rw, eqn, operands):
  v = operands[0]
  if not isinstance(v, Broadcast):
    return None
  perm = tuple(eqn.params["permutation"])
  out = jax.lax.transpose(v.user, perm)
  rw.moved(eqn, out, v)
  return [v.like(out, perm.index(v.axis))]


def reduction(rw, eqn, operands):
  v = operands[0]
  if not isinstance(v, Broadcast) or len(operands) != 1:
    return None
  axes = tuple(eqn.params["axes"])
  if v.axis in axes:
    return None
  out = eqn.primitive.bind(v.user, **eqn.params)
  rw.moved(eqn, out, v)
  return [v.like(out, v.axis - sum(a < v.axis for a in axes))]


def cumulative(rw, eqn, operands):
  v = operands[0]
  if not isinstance(v, Broadcast) or eqn.params["axis"] == v.axis:
    return None
  out = eqn.primitive.bind(v.user, **eqn.params)
  rw.moved(eqn, out, v)
  return [v.like(out)]


def concatenate(rw, eqn, operands):
  lead = _first_broadcast(operands)
  if lead is None:
    return None
  dim = eqn.params["dimension"]
  if dim != lead.axis:
    users = _user_operands(rw, operands, lead.ids, lead.axis)
    if users is not None:
      out = jax.lax.concatenate(users, dim)
      rw.moved(eqn, out, lead)
      return [lead.like(out)]
  if lead.axis != 0 or dim == 0:
    return None
  parts = []
  for v in operands:
    if isinstance(v, Broadcast):
      if v.ids is not lead.ids or v.axis != 0:
        return None
      parts.append(v)
    elif isinstance(v, (Plain, RowConstant)):
      parts.append(v)
    else:
      return None
  return [Concat(tuple(parts), dim, lead.ids)]


def _free_dims(rank, contracting, batch):
  return [d for d in range(rank) if d not in contracting and d not in batch]


def dot_general(rw, eqn, operands):
  lhs, rhs = operands
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  if isinstance(lhs, Concat) or isinstance(rhs, Concat):
    return split_dense(rw, eqn, lhs, rhs)
  free = lambda v: isinstance(v, Plain) and not v.at_b
  bind = lambda a, b: eqn.primitive.bind(a, b, **eqn.params)
  if isinstance(lhs, Broadcast) and isinstance(rhs, Broadcast):
    if (lhs.ids is rhs.ids and lhs.axis in lb and rhs.axis in rb
        and lb.index(lhs.axis) == rb.index(rhs.axis)):
      out = bind(lhs.user, rhs.user)
      rw.moved(eqn, out, lhs)
      return [lhs.like(out, lb.index(lhs.axis))]
    return None
  if isinstance(lhs, Broadcast) and free(rhs) and lhs.axis not in lc and lhs.axis not in lb:
    axis = len(lb) + _free_dims(lhs.user.ndim, lc, lb).index(lhs.axis)
    out = bind(lhs.user, rhs.value)
    rw.moved(eqn, out, lhs)
    return [lhs.like(out, axis)]
  if isinstance(rhs, Broadcast) and free(lhs) and rhs.axis not in rc and rhs.axis not in rb:
    axis = (len(lb) + len(_free_dims(np.ndim(lhs.value), lc, lb))
            + _free_dims(rhs.user.ndim, rc, rb).index(rhs.axis))
    out = bind(lhs.value, rhs.user)
    rw.moved(eqn, out, rhs)
    return [rhs.like(out, axis)]
  return None


def split_dense(rw, eqn, lhs, rhs):
  """A dense layer on `concat([user[ids], cand], k)`: the user half runs at U.

  With a 3-D stack concatenated and contracted on axis 1 against a matrix,
  this is linear compression and runs as the IKBO op; otherwise the weight is
  split by the concatenation and the user product is added by index.
  """
  from ikbo_jax.index import CandidateIndex
  from ikbo_jax.ops.linear_compression import linear_compression

  stack, weight, stack_is_lhs = (lhs, rhs, True) if isinstance(lhs, Concat) else (rhs, lhs, False)
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  s_contract, w_contract = (lc, rc) if stack_is_lhs else (rc, lc)
  if (not isinstance(weight, Plain) or weight.at_b or lb or rb
      or stack.dimension not in s_contract or 0 in s_contract):
    return None
  w_axis = w_contract[s_contract.index(stack.dimension)]
  sizes = [p.shape[stack.dimension] if isinstance(p, Broadcast)
           else np.shape(_array(p))[stack.dimension] for p in stack.parts]
  starts = np.concatenate([[0], np.cumsum(sizes)])
  w_slice = lambda i: jax.lax.slice_in_dim(weight.value, int(starts[i]), int(starts[i + 1]),
                                           axis=w_axis)
  user_idx = [i for i, p in enumerate(stack.parts) if isinstance(p, Broadcast)]
  cand_idx = [i for i, p in enumerate(stack.parts) if not isinstance(p, Broadcast)]
  concat = lambda xs, axis: xs[0] if len(xs) == 1 else jax.lax.concatenate(xs, axis)
  e_user = concat([stack.parts[i].user for i in user_idx], stack.dimension)
  w_user = concat([w_slice(i) for i in user_idx], w_axis)
  e_cand = concat([_array(stack.parts[i]) for i in cand_idx], stack.dimension)
  w_cand = concat([w_slice(i) for i in cand_idx], w_axis)
  out_aval = eqn.outvars[0].aval
  if (np.ndim(e_cand) == 3 and stack.dimension == 1 and np.ndim(weight.value) == 2
      and s_contract == (1,)):
    as_mk = (lambda w: w) if w_axis == 1 else (lambda w: w.T)
    dtype = e_cand.dtype
    out = linear_compression(as_mk(w_user).astype(dtype), as_mk(w_cand).astype(dtype),
                             e_user.astype(dtype), e_cand,
                             CandidateIndex.from_mapping(stack.ids, rw.num_users))  # [B, M, N]
    out = jnp.transpose(out, (0, 2, 1) if stack_is_lhs else (1, 0, 2))
    rw.report.add("linear_compression", eqn)
    return [Plain(out.astype(out_aval.dtype), True)]
  bind = lambda s, w: eqn.primitive.bind(*((s, w) if stack_is_lhs else (w, s)), **eqn.params)
  user_part = bind(e_user, w_user)  # at U: its rows are users
  # Where the stack's rows land in the product: first when it is the left operand, else
  # after the weight's free axes.
  axis = 0 if stack_is_lhs else np.ndim(weight.value) - len(w_contract)
  out = jnp.take(user_part, stack.ids, axis=axis, mode="clip") + bind(e_cand, w_cand)
  rw.report.add("split_dense", eqn)
  return [Plain(out.astype(out_aval.dtype), True)]


def _array(v):
  return v.value if isinstance(v, Plain) else v.materialize()


def _nbytes(aval) -> int:
  return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize


RULES = {name: elementwise for name in ELEMENTWISE}
RULES.update({name: reduction for name in REDUCTIONS})
RULES.update({name: cumulative for name in CUMULATIVE})
RULES.update(gather=gather, broadcast_in_dim=broadcast_in_dim, reshape=reshape, iota=iota,
             transpose=transpose, concatenate=concatenate, dot_general=dot_general)
