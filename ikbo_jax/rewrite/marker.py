"""The rewrite's rule for marked attention (`ikbo_jax.ops.marked_attention`).

When the marked call's keys and values are broadcasts of user rows by the
mapping, it becomes `ikbo_jax.target_attention`; when its queries are too, it
runs at batch U as written.
"""

from __future__ import annotations

import jax.numpy as jnp

from ikbo_jax import _dispatch
from ikbo_jax.index import CandidateIndex
from ikbo_jax.ops.marked_attention import marked, marked_options
from ikbo_jax.ops.target_attention import target_attention
from ikbo_jax.rewrite.report import FORWARD_MODE, Decline
from ikbo_jax.rewrite.values import Broadcast, Plain, RowConstant


def is_marker(eqn) -> bool:
  return marked_options(eqn) is not None


def rule(rw, eqn, operands):
  causal, scale, implementation = marked_options(eqn)
  q, k, v, *kv_len = operands
  if not (isinstance(k, Broadcast) and isinstance(v, Broadcast) and k.ids is v.ids
          and k.axis == v.axis == 0):
    raise Decline("its keys and values are not broadcasts by one index")
  if kv_len and not (isinstance(kv_len[0], Broadcast) and kv_len[0].ids is k.ids):
    raise Decline("its key lengths are not a broadcast by the keys' index")
  lengths = [kv_len[0].user] if kv_len else []
  if isinstance(q, Broadcast) and q.ids is k.ids and q.axis == 0:  # all user rows: run at U
    # Its backward rule multiplies every row's values by the row's (zero) cotangent, which
    # JAX cannot differentiate forward to move to read rows (`read_rows.py`): unread rows
    # are replaced beforehand. The IKBO op below gives unread users no gradient at all.
    q, k, v = (x.at_read_rows() for x in (q, k, v))
    lengths = [kv_len[0].at_read_rows().user] if kv_len else []
    out = marked(causal, scale, implementation)(q.user, k.user, v.user, *lengths)
    rw.report.add("at_users", eqn)
    return [q.like(out)]
  if causal:
    raise Decline("causal attention of candidate queries over user keys")
  if _dispatch.forward_mode(q, k, v):
    raise Decline(FORWARD_MODE)
  if not isinstance(q, (Plain, RowConstant)):
    raise Decline("its queries are neither candidate values nor user rows of the keys' index")
  q = q.value if isinstance(q, Plain) else q.materialize()
  k_user, v_user = k.user, v.user
  if q.shape[2] != k_user.shape[2]:  # grouped queries: each key head serves a group, as in jax.nn
    group = q.shape[2] // k_user.shape[2]
    k_user, v_user = (jnp.repeat(x, group, axis=2) for x in (k_user, v_user))
  out = target_attention(q, k_user, v_user, CandidateIndex.from_mapping(k.ids, k.num_users),
                         kv_len=lengths[0] if lengths else None, scale=scale)
  rw.report.add("target_attention", eqn)
  return [Plain(out.astype(eqn.outvars[0].aval.dtype), True)]
