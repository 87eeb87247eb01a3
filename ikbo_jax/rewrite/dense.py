"""Products: dense layers on broadcasts, on concatenations of user and candidate features, and
pairwise products of such concatenations.

`dot_general` is linear in each operand and acts on the rows of its free axes
independently, so a product whose candidate axis is a free axis of a broadcast
operand is the broadcast of the product at U. A concatenation along a
contracted axis splits the weight (`split_dense`, `linear_compression` for a
3-D stack); a product of two concatenations along free axes is a block matrix
whose user-user block runs at U (`block_product`, a DLRM-style interaction).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import primitives as P

from ikbo_jax import _dispatch
from ikbo_jax.index import CandidateIndex
from ikbo_jax.two_level_index import TwoLevelIndex
from ikbo_jax.ops.linear_compression import linear_compression
from ikbo_jax.ops.two_level_linear_compression import two_level_linear_compression
from ikbo_jax.rewrite import read_rows
from ikbo_jax.rewrite.report import FORWARD_MODE, Decline
from ikbo_jax.rewrite.rules import parts_starts
from ikbo_jax.rewrite.values import Broadcast, Concat, Plain, materialize


def _free_dims(rank, contracting, batch):
  return [d for d in range(rank) if d not in contracting and d not in batch]


def dot_general(rw, eqn, operands):
  lhs, rhs = operands
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  if isinstance(lhs, Concat) and isinstance(rhs, Concat):
    return block_product(rw, eqn, lhs, rhs)
  if isinstance(lhs, Concat) or isinstance(rhs, Concat):
    return split_dense(rw, eqn, lhs, rhs)
  bind = lambda a, b, lead: read_rows.bind(
      eqn, lambda x, y: eqn.primitive.bind(x, y, **eqn.params), [a, b],
      [v.axis if isinstance(v, Broadcast) else None for v in (lhs, rhs)], lead.rows)
  if isinstance(lhs, Broadcast) and isinstance(rhs, Broadcast):
    if (lhs.ids is rhs.ids and lhs.axis in lb and rhs.axis in rb
        and lb.index(lhs.axis) == rb.index(rhs.axis)):
      out = bind(lhs.user, rhs.user, lhs)
      rw.moved(eqn, out, lhs)
      return [lhs.like(out, lb.index(lhs.axis))]
    raise Decline("its operands are broadcasts by different indices or along different axes")
  if isinstance(lhs, Broadcast) and isinstance(rhs, Plain):
    if lhs.axis in lc or lhs.axis in lb:
      raise Decline("the candidate axis is contracted or batched against a candidate value")
    axis = len(lb) + _free_dims(lhs.user.ndim, lc, lb).index(lhs.axis)
    out = bind(lhs.user, rhs.value, lhs)
    rw.moved(eqn, out, lhs)
    return [lhs.like(out, axis)]
  if isinstance(rhs, Broadcast) and isinstance(lhs, Plain):
    if rhs.axis in rc or rhs.axis in rb:
      raise Decline("the candidate axis is contracted or batched against a candidate value")
    axis = (len(lb) + len(_free_dims(np.ndim(lhs.value), lc, lb))
            + _free_dims(rhs.user.ndim, rc, rb).index(rhs.axis))
    out = bind(lhs.value, rhs.user, rhs)
    rw.moved(eqn, out, rhs)
    return [rhs.like(out, axis)]
  return None


def split_dense(rw, eqn, lhs, rhs):
  """A dense layer on `concat([user[ids], cand], k)`: the user part runs at U.

  The weight is split by the concatenation; each level's product (the
  broadcasts by one index, user or group rows) runs at its own batch and is
  added by index. With a 3-D stack concatenated and contracted on axis 1
  against a matrix, this is linear compression and runs as the IKBO op, the
  two-level one for user and group parts of one nested gather.
  """
  stack, weight, stack_is_lhs = (lhs, rhs, True) if isinstance(lhs, Concat) else (rhs, lhs, False)
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  s_contract, w_contract = (lc, rc) if stack_is_lhs else (rc, lc)
  if not isinstance(weight, Plain) or weight.at_b or lb or rb:
    raise Decline("the other operand of the concatenation is not a weight")
  if stack_is_lhs and stack.dimension not in s_contract and 0 not in s_contract:
    return _per_field(rw, eqn, stack, weight)
  if stack.dimension not in s_contract or 0 in s_contract:
    raise Decline("the concatenation axis is not contracted, or the candidate axis is")
  if _dispatch.forward_mode(weight.value, *stack.parts):
    raise Decline(FORWARD_MODE)
  w_axis = w_contract[s_contract.index(stack.dimension)]
  starts = parts_starts(stack)
  w_slice = lambda i: jax.lax.slice_in_dim(weight.value, int(starts[i]), int(starts[i + 1]),
                                           axis=w_axis)
  levels = _levels(stack)
  join = lambda idx, get, axis: _concat([get(i) for i in idx], axis)
  e_levels = [(stack.parts[idx[0]], join(idx, lambda i: stack.parts[i].user, stack.dimension),
               join(idx, w_slice, w_axis)) for idx in levels]
  cand_idx = [i for i, p in enumerate(stack.parts) if not isinstance(p, Broadcast)]
  cand = None
  if cand_idx:
    cand = (join(cand_idx, lambda i: materialize(stack.parts[i]), stack.dimension),
            join(cand_idx, w_slice, w_axis))
  out_aval = eqn.outvars[0].aval
  if (cand is not None and np.ndim(cand[0]) == 3 and stack.dimension == 1
      and np.ndim(weight.value) == 2 and s_contract == (1,)):
    out = _compression(e_levels, cand, w_axis)  # [B, M, N]
    if out is not None:
      out = jnp.transpose(out, (0, 2, 1) if stack_is_lhs else (1, 0, 2))
      rw.report.add("linear_compression" if len(e_levels) == 1
                    else "two_level_linear_compression", eqn)
      return [Plain(out.astype(out_aval.dtype), True)]
  bind = lambda s, w: eqn.primitive.bind(*((s, w) if stack_is_lhs else (w, s)), **eqn.params)
  # Where the stack's rows land in the product: first when it is the left operand, else
  # after the weight's free axes.
  axis = 0 if stack_is_lhs else np.ndim(weight.value) - len(w_contract)
  out = None if cand is None else bind(*cand)
  for lead, e_user, w_user in e_levels:
    user_part = read_rows.bind(eqn, bind, [e_user, w_user], [lead.axis, None], lead.rows)  # at U
    gathered = jnp.take(user_part, lead.ids, axis=axis, mode="clip")
    out = gathered if out is None else out + gathered
  rw.report.add("split_dense", eqn)
  return [Plain(out.astype(out_aval.dtype), True)]


def _per_field(rw, eqn, stack: Concat, weight: Plain):
  """`stack @ w` contracting feature axes only: each field's rows are projected on their own
  (AutoInt's and FiBiNET's per-field projections), so the product is a stack of the parts'
  products, a user part's at U."""
  (lc, _), _ = eqn.params["dimension_numbers"]
  parts = tuple(dot_general(rw, eqn, [p, weight])[0] if isinstance(p, Broadcast) else Plain(
      eqn.primitive.bind(materialize(p), weight.value, **eqn.params), True, p.at_u)
      for p in stack.parts)
  dimension = _free_dims(len(stack.shape), lc, ()).index(stack.dimension)
  return [Concat(parts, stack.ids, dimension)]


def _levels(stack: Concat) -> list[list[int]]:
  """The stack's broadcast parts grouped by index (by identity), in order of appearance."""
  levels = {}
  for i, part in enumerate(stack.parts):
    if isinstance(part, Broadcast):
      levels.setdefault(id(part.ids), []).append(i)
  return list(levels.values())


def _compression(e_levels, cand, w_axis):
  """Linear compression of one level (or of user and group levels) and the candidates, or None.

  Two levels are one nested gather's when the user level's ids are
  `group_to_user[item_to_group]` and the group level's are that `item_to_group`
  over as many group rows: then the two-level op computes the same sums.
  """
  as_mk = (lambda w: w) if w_axis == 1 else (lambda w: w.T)
  e_cand, w_cand = cand
  dtype = e_cand.dtype
  weights = lambda level: as_mk(level[2]).astype(dtype)
  if len(e_levels) == 1:
    (lead, e_user, _), = e_levels
    return linear_compression(weights(e_levels[0]), as_mk(w_cand).astype(dtype),
                              e_user.astype(dtype), e_cand,
                              CandidateIndex.from_mapping(lead.ids, lead.num_users))
  if len(e_levels) != 2:
    return None
  user, group = sorted(e_levels, key=lambda level: level[0].levels is None)
  if user[0].levels is None or group[0].levels is not None:
    return None
  item_to_group, group_to_user = user[0].levels
  if group[0].ids is not item_to_group or group[1].shape[0] != group_to_user.shape[0]:
    return None
  index = TwoLevelIndex(CandidateIndex(item_to_group, group_to_user.shape[0]),
                        CandidateIndex(group_to_user, user[0].num_users),
                        CandidateIndex(user[0].ids, user[0].num_users))
  return two_level_linear_compression(weights(user), weights(group), as_mk(w_cand).astype(dtype),
                                      user[1].astype(dtype), group[1].astype(dtype), e_cand,
                                      index)


def block_product(rw, eqn, lhs: Concat, rhs: Concat):
  """`x @ y` for stacks `x`, `y` of user and candidate parts, batched over candidates.

  Each output element is one product of a row of `x` and a column of `y`, so
  the output is the block matrix of the parts' products; a block of two user
  parts is the broadcast of its product at U. Runs of consecutive parts of one
  kind are joined first, so `[user..., candidate...]` is a 2 x 2 block matrix.
  """
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  if lhs.ids is not rhs.ids or lb[:1] != (0,) or rb[:1] != (0,):
    raise Decline("the two concatenations are not batched over the same candidates")
  if not (lhs.uniform and rhs.uniform):
    raise Decline("a concatenation holds broadcasts by different indices")
  if lhs.dimension in lc + lb or rhs.dimension in rc + rb:
    raise Decline("a concatenation axis is contracted or batched")
  bind = lambda a, b: eqn.primitive.bind(a, b, **eqn.params)
  l_free, r_free = _free_dims(len(lhs.shape), lc, lb), _free_dims(len(rhs.shape), rc, rb)
  l_axis = len(lb) + l_free.index(lhs.dimension)
  r_axis = len(lb) + len(l_free) + r_free.index(rhs.dimension)
  # x @ x^T written as one product of a stack with itself: block (j, i) is block (i, j) turned.
  symmetric = lhs is rhs and lc == rc and lb == rb
  turn = (*range(len(lb)), *range(len(lb) + len(l_free), len(lb) + 2 * len(l_free)),
          *range(len(lb), len(lb) + len(l_free)))
  l_runs, r_runs = _runs(lhs), _runs(rhs)
  blocks = {}
  for i, a in enumerate(l_runs):
    for j, b in enumerate(r_runs):
      if symmetric and j < i:
        blocks[i, j] = jnp.transpose(blocks[j, i], turn)
      elif isinstance(a, Broadcast) and isinstance(b, Broadcast):
        block = read_rows.bind(eqn, bind, [a.user, b.user], [a.axis, b.axis], a.rows)
        rw.moved(eqn, block, a)
        blocks[i, j] = jnp.take(block, lhs.ids, axis=0, mode="clip")
      else:
        blocks[i, j] = bind(materialize(a), materialize(b))
  rows = [_concat([blocks[i, j] for j in range(len(r_runs))], r_axis)
          for i in range(len(l_runs))]
  rw.report.add("block_product", eqn)
  return [Plain(_concat(rows, l_axis).astype(eqn.outvars[0].aval.dtype), True)]


def _runs(stack: Concat):
  """The stack's parts with consecutive user parts (and consecutive others) joined."""
  runs, kinds = [], []
  for part in stack.parts:
    kind = isinstance(part, Broadcast)
    if kinds and kinds[-1] == kind:
      runs[-1].append(part)
    else:
      runs.append([part])
      kinds.append(kind)
  joined = []
  for kind, run in zip(kinds, runs):
    if kind:
      joined.append(run[0].like(_concat([p.user for p in run], stack.dimension)))
    else:
      joined.append(Plain(_concat([materialize(p) for p in run], stack.dimension), True))
  return joined


def _concat(xs, axis):
  return xs[0] if len(xs) == 1 else jax.lax.concatenate(xs, axis)


RULES = {P.dot_general_p: dot_general}
