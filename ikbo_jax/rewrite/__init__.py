"""Automatic IKBO: standard JAX code in, broadcast-free code out.

`rewrite(fn, mapping=..., users=...)` traces `fn` and returns a function with
the same signature and results in which gathers of user rows
(`user[cand_to_user]`, `jnp.take(user, ids, axis=0)`, `jnp.repeat(user, r,
axis=0)`, ...) are not materialized: row-wise user work after them runs at
batch U, a dense layer on a concatenation of user and candidate features is
split (and is `ikbo_jax.linear_compression` for a 3-D stack), a pairwise
product of such concatenations computes its user-user block at U, and
`ikbo_jax.rewrite.attention` over broadcast keys and values is
`ikbo_jax.target_attention`. Every change is an identity that holds for every
input, custom derivative rules included; what it does not understand runs as
written. `explain` reports each change and each broadcast it had to make real,
with the reason.

Example:

>>> import jax, jax.numpy as jnp
>>> from ikbo_jax import rewrite
>>> def model(user, cand_to_user, cand, w):
...   x = jnp.concatenate([jax.nn.relu(user[cand_to_user]), cand], axis=1)
...   return x @ w
>>> user, cand = jnp.ones((3, 8)), jnp.ones((10, 4))
>>> ids, w = jnp.array([0, 1, 2, 0, 1, 2, 0, 1, 2, 0]), jnp.ones((12, 5))
>>> fast = rewrite.rewrite(model, mapping="cand_to_user", users="user")
>>> bool(jnp.allclose(fast(user, ids, cand, w), model(user, ids, cand, w)))
True
>>> print(rewrite.explain(model, user, ids, cand, w, mapping=1, users=0))
... # doctest: +ELLIPSIS
IKBO rewrite: 1 at_users, 1 broadcast, 1 entered, 1 split_dense; ...
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ikbo_jax.rewrite.interpreter import Rewriter
from ikbo_jax.ops.marked_attention import attention, flax_attention_fn
from ikbo_jax.rewrite.report import Change, Report
from ikbo_jax.rewrite.arguments import bind, signature_of
from ikbo_jax.rewrite.selectors import as_selectors, describe, select
from ikbo_jax.rewrite.values import Plain, materialize

__all__ = ["Change", "Report", "attention", "explain", "flax_attention_fn", "rewrite"]


# The keywords' names before 2026-12 (argument positions only), accepted for one release.
_RENAMED = {"mapping_argnum": "mapping", "user_argnums": "users",
            "candidate_argnums": "candidates"}


def _renamed(caller: str, selectors: dict, old: dict) -> dict:
  """`selectors` with the old keywords in `old` moved to their new names, warning for each."""
  for name, value in old.items():
    if name not in _RENAMED:
      raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
    new = _RENAMED[name]
    warnings.warn(f"{caller}(..., {name}=...) is deprecated: use {new}= (it takes the same "
                  f"argument positions, and also paths and predicates)", DeprecationWarning,
                  stacklevel=3)
    if selectors[new] is not None:
      raise TypeError(f"{caller}() got both {name}= and its new name {new}=")
    selectors[new] = value
  if selectors["mapping"] is None:
    raise TypeError(f"{caller}() missing the keyword argument 'mapping'")
  return selectors


def rewrite(fn: Callable, *, mapping=None, users=None, candidates=None,
            static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = (),
            report: Report | None = None, **renamed) -> Callable:
  """`fn` with broadcasts of user rows pushed into IKBO form.

  The inputs are named by selectors (`ikbo_jax.rewrite.selectors`): an argument
  position, a dotted path into the arguments' pytrees (`"batch.cand_to_user"`)
  or a predicate `(path, leaf) -> bool`.

  Args:
    fn: a function of arrays and pytrees of arrays (dicts, dataclasses,
      `nnx.State`, ...) to rewrite.
    mapping: selects `cand_to_user`, one `int[B]` array.
    users: selects the per-user inputs (leading axis U).
    candidates: selects the per-candidate inputs (leading axis B); every other
      input is batch-free (weights). Without it, any other array whose leading
      axis has size B counts as a candidate input, which is safe but may keep a
      weight of that size from moving to batch U.
    static_argnums, static_argnames: arguments held constant in the trace whatever
      they are, as `jax.jit`'s. Without them the rewrite traces what `jax.jit` traces
      (JAX and NumPy arrays) and holds every other value constant: Python numbers and
      flags, strings, configuration objects (`ikbo_jax.rewrite.arguments`).
    report: if given, each trace appends its changes to it.
    **renamed: `mapping_argnum`, `user_argnums` and `candidate_argnums`, the
      old names of `mapping`, `users` and `candidates`: deprecated, they warn.

  Returns:
    A function with `fn`'s signature (positional and keyword arguments, defaults)
    and results, for every input (ids out of
    range included: each gather keeps its own out-of-range semantics). It
    composes with `jax.jit`, `jax.grad` (the backward runs through the IKBO
    ops' own VJPs), `jax.vmap`, `nnx.split`/`nnx.merge` and `nnx.jit`; what the call
    writes to NNX objects among the arguments (BatchNorm's statistics, an RNG stream's
    count) is written back to them, as `nnx.jit` does. Forward-mode
    derivatives (`jax.jvp`) of a rewrite that emits IKBO ops raise a
    `TypeError` naming the op: take them of `fn` itself.
  """
  selectors = _renamed("rewrite", dict(mapping=mapping, users=users, candidates=candidates),
                       renamed)
  mapping, candidates = selectors["mapping"], selectors["candidates"]
  users = () if selectors["users"] is None else selectors["users"]
  mapping_selectors = as_selectors("mapping", mapping)
  user_selectors = as_selectors("users", users)
  cand_selectors = None if candidates is None else as_selectors("candidates", candidates)
  if len(mapping_selectors) != 1:
    raise TypeError(f"mapping must be one selector, got {mapping!r}")
  if not callable(mapping) and mapping in user_selectors:
    raise ValueError(f"mapping={mapping!r} is also selected by users={users!r}")

  static_argnums, static_argnames = _static("static_argnums", static_argnums, int), _static(
      "static_argnames", static_argnames, str)
  signature = signature_of(fn)  # once, not at every call

  @functools.wraps(fn)
  def rewritten(*args, **kwargs):
    call = bind(signature, args, kwargs, static_argnums, static_argnames)
    leaves, paths = call.leaves, call.paths
    is_mapping = select(mapping_selectors, paths, leaves)
    hits = [i for i, hit in enumerate(is_mapping) if hit]
    if len(hits) != 1:
      raise ValueError(f"mapping={mapping!r} must select one array of fn's arguments, it "
                       f"selects {len(hits)}: {describe([paths[i] for i in hits])}")
    (where,) = hits
    ids = leaves[where]
    if np.ndim(ids) != 1 or not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
      raise TypeError(f"mapping={mapping!r} ({paths[where][-1]}) must be an int[B] array, got "
                      f"{jnp.result_type(ids)} of shape {np.shape(ids)}")
    is_user = select(user_selectors, paths, leaves)
    if is_user[where]:
      raise ValueError(f"mapping={mapping!r} ({paths[where][-1]}) is also selected by "
                       f"users={users!r}")
    num_candidates = np.shape(ids)[0]
    if cand_selectors is not None:
      is_cand = select(cand_selectors, paths, leaves)
    else:
      is_cand = [np.ndim(x) > 0 and np.shape(x)[0] == num_candidates for x in leaves]
    closed, out_shape = jax.make_jaxpr(lambda *traced: call.call(fn, traced),
                                       return_shape=True)(*leaves)
    interpreted = [Plain(x, at_b=True, mapped=True) if i == where else
                   Plain(x, at_u=True) if is_user[i] else Plain(x, at_b=bool(is_cand[i]))
                   for i, x in enumerate(leaves)]
    rewriter = Rewriter(report if report is not None else Report())
    outs = rewriter.eval_jaxpr(closed.jaxpr, closed.consts, interpreted)
    out, states = jax.tree.unflatten(jax.tree.structure(out_shape),
                                     [materialize(o) for o in outs])
    call.update(states)
    return out

  return rewritten


def _static(name: str, value, kind: type) -> tuple:
  """`static_argnums` / `static_argnames` as a tuple, checked as `jax.jit` would."""
  expected = f"{name} must be {'non-negative ints' if kind is int else 'strs'}, got {value!r}"
  try:
    values = (value,) if isinstance(value, kind) else tuple(value)
  except TypeError:
    raise TypeError(expected) from None
  if any(not isinstance(v, kind) or isinstance(v, bool) or (kind is int and v < 0)
         for v in values):
    raise TypeError(expected)
  return values


def explain(fn: Callable, *args, mapping=None, users=None, candidates=None,
            kwargs: dict | None = None, static_argnums: int | Sequence[int] = (),
            static_argnames: str | Sequence[str] = (), **renamed) -> Report:
  """What `rewrite` changes in `fn` for arguments like `args` and `kwargs` (`fn`'s keyword
  arguments), traced abstractly, not run.

  Every broadcast made real is listed (`Report.materialized`) with the
  primitive that needed it and the reason no rule moved it. The other keywords are
  `rewrite`'s (the old names warn there too); as there, only arrays are traced.
  """
  selectors = _renamed("explain", dict(mapping=mapping, users=users, candidates=candidates),
                       renamed)
  static_argnums = _static("static_argnums", static_argnums, int)
  static_argnames = _static("static_argnames", static_argnames, str)
  report = Report()
  fast = rewrite(fn, **selectors, static_argnums=static_argnums,
                 static_argnames=static_argnames, report=report)
  call = bind(signature_of(fn), args, kwargs or {}, static_argnums, static_argnames)
  jax.make_jaxpr(lambda *traced: call.call(fast, traced))(*call.leaves)
  return report
