"""Automatic IKBO: standard JAX code in, broadcast-free code out.

`rewrite(fn, mapping_argnum=..., user_argnums=...)` traces `fn` and returns a
function with the same signature and results in which gathers of user rows by
the mapping (`user[cand_to_user]`, `jnp.take(user, cand_to_user, axis=0)`)
are not materialized: row-wise user work after them runs at batch U, a dense
layer on a concatenation of user and candidate features is split (and is
`ikbo_jax.linear_compression` for a 3-D stack), and `ikbo_jax.rewrite.attention`
over broadcast keys and values is `ikbo_jax.target_attention`. What it does
not understand runs as written. `explain` reports each change.

Example:

>>> import jax, jax.numpy as jnp
>>> from ikbo_jax import rewrite
>>> def model(user, cand_to_user, cand, w):
...   x = jnp.concatenate([jax.nn.relu(user[cand_to_user]), cand], axis=1)
...   return x @ w
>>> user, cand = jnp.ones((3, 8)), jnp.ones((10, 4))
>>> ids, w = jnp.array([0, 1, 2, 0, 1, 2, 0, 1, 2, 0]), jnp.ones((12, 5))
>>> fast = rewrite.rewrite(model, mapping_argnum=1, user_argnums=(0,))
>>> bool(jnp.allclose(fast(user, ids, cand, w), model(user, ids, cand, w)))
True
>>> print(rewrite.explain(model, user, ids, cand, w, mapping_argnum=1, user_argnums=(0,)))
... # doctest: +ELLIPSIS
IKBO rewrite: 1 at_users, 1 broadcast, 1 split_dense; ...
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np

from ikbo_jax.rewrite.marker import attention, flax_attention_fn
from ikbo_jax.rewrite.interpreter import Rewriter
from ikbo_jax.rewrite.report import Change, Report
from ikbo_jax.rewrite.values import Mapping, Plain, materialize

__all__ = ["Change", "Report", "attention", "explain", "flax_attention_fn", "rewrite"]


def rewrite(fn: Callable, *, mapping_argnum: int, user_argnums: Sequence[int] = (),
            candidate_argnums: Sequence[int] | None = None,
            report: Report | None = None) -> Callable:
  """`fn` with broadcasts of user rows by the mapping argument pushed into IKBO form.

  Args:
    fn: a function of arrays (and pytrees of arrays) to rewrite.
    mapping_argnum: the position of `cand_to_user`, an `int[B]` array with ids in
      `[0, U)` (out-of-range ids are clamped, as the IKBO ops do).
    user_argnums: the positions of per-user inputs (leading axis U).
    candidate_argnums: the positions of per-candidate inputs (leading axis B);
      every other argument is batch-free (weights). Without it, any other array
      leaf whose leading axis has size B counts as a candidate input, which is
      safe but may keep a weight of that size from moving to batch U.
    report: if given, each trace appends its changes to it.

  Returns:
    A function with `fn`'s signature and results; it composes with `jax.jit`,
    `jax.grad` (the backward runs through the IKBO ops' own VJPs) and `jax.vmap`.
  """
  if not isinstance(mapping_argnum, int) or isinstance(mapping_argnum, bool):
    raise TypeError(f"mapping_argnum must be an int, got {mapping_argnum!r}")
  if mapping_argnum in user_argnums:
    raise ValueError(f"mapping_argnum={mapping_argnum} is also in user_argnums={user_argnums}")

  @functools.wraps(fn)
  def rewritten(*args):
    if not 0 <= mapping_argnum < len(args):
      raise ValueError(f"mapping_argnum={mapping_argnum} but fn got {len(args)} arguments")
    ids = args[mapping_argnum]
    if np.ndim(ids) != 1 or not np.issubdtype(jax.numpy.asarray(ids).dtype, np.integer):
      raise TypeError(f"argument {mapping_argnum} (the mapping) must be an int[B] array, got "
                      f"{getattr(ids, 'dtype', type(ids).__name__)} of shape {np.shape(ids)}")
    num_candidates = np.shape(ids)[0]
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    interpreted = []
    for i, arg in enumerate(args):
      for leaf in jax.tree.leaves(arg):
        if i == mapping_argnum:
          interpreted.append(Mapping(jax.numpy.asarray(leaf), (num_candidates,)))
        else:
          if candidate_argnums is not None:
            candidate = i in candidate_argnums
          else:
            candidate = (i not in user_argnums and np.ndim(leaf) > 0
                         and np.shape(leaf)[0] == num_candidates)
          interpreted.append(Plain(leaf, candidate))
    rewriter = Rewriter(report if report is not None else Report())
    outs = rewriter.eval_jaxpr(closed.jaxpr, closed.consts, interpreted)
    return jax.tree.unflatten(jax.tree.structure(out_shape), [materialize(o) for o in outs])

  return rewritten


def explain(fn: Callable, *args, mapping_argnum: int, user_argnums: Sequence[int] = (),
            candidate_argnums: Sequence[int] | None = None) -> Report:
  """What `rewrite` changes in `fn` for arguments like `args` (traced abstractly, not run)."""
  report = Report()
  jax.make_jaxpr(rewrite(fn, mapping_argnum=mapping_argnum, user_argnums=user_argnums,
                         candidate_argnums=candidate_argnums, report=report))(*args)
  return report
