"""`lax.scan`: the body is rewritten, and a carried broadcast stays at U where the body keeps it.

A carry stays lazy (user rows carried at U, say) only if the body returns it in the form it
entered with: the same kind of value, float leaves of the same shapes and dtypes, and the very
same integer leaves (the index of a broadcast is loop-invariant: it is closed over, not carried).
Ordinary carries enter the body with the union of the lineage they start with and the lineage
the body returns them with, so what a rule inside learns of a carry holds on every iteration.
Both are found by a fixed point: the body is traced, a carry whose result breaks its form is made
ordinary (or its lineage widened) and the body is traced again. Each retry demotes a carry or
widens a flag, so it ends within a few traces. Scanned inputs enter as ordinary slices and
stacked outputs leave ordinary: `lax.scan` stacks arrays, not broadcasts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import primitives as P

from ikbo_jax.rewrite.report import Decline, Report
from ikbo_jax.rewrite.values import LAZY, Plain, at_b, at_u, mapped, materialize


class _FormChanged(Exception):
  """Raised inside a trace of the body: carry `index` must enter as `form` instead."""

  def __init__(self, index: int, form):
    super().__init__(index)
    self.index, self.form = index, form


def _flags(v) -> tuple[bool, bool, bool]:
  return at_b(v), at_u(v), mapped(v)


def _ordinary(v, flags=None) -> Plain:
  """`v` as an ordinary array with `flags` (its own lineage by default); bounds are dropped."""
  return Plain(materialize(v), *(flags or _flags(v)))


def _is_fixed(leaf) -> bool:
  """Integer leaves of a lazy carry (indices) are closed over, not carried."""
  return not jnp.issubdtype(leaf.dtype, jnp.inexact)


@functools.cache
def _stacked_marker():
  """How a standard scan marks an output stacked along the scanned axis."""
  eqn = jax.make_jaxpr(lambda xs: jax.lax.scan(lambda c, x: (c, 2 * x), 0.0, xs))(
      jnp.zeros(1)).jaxpr.eqns[0]
  return list(eqn.params["ft_out"].unpack()[1])[0]


def _carried(v, form) -> list:
  """The arrays `lax.scan` carries for value `v` of `form`."""
  if isinstance(form, tuple):
    return [materialize(v)]
  return [leaf for leaf in jax.tree.leaves(v) if not _is_fixed(leaf)]


def _enter(arrays, form):
  """The value of `form` that the body sees for the carried `arrays`."""
  if isinstance(form, tuple):
    return Plain(arrays[0], *form)
  leaves, treedef = jax.tree.flatten(form)
  it = iter(arrays)
  return jax.tree.unflatten(treedef, [leaf if _is_fixed(leaf) else next(it) for leaf in leaves])


def _values(arrays, init, forms) -> list:
  """The carries' values for the flat carried `arrays` (`init` gives each carry's count)."""
  values, at = [], 0
  for v, form in zip(init, forms):
    n = len(_carried(v, form))
    values.append(_enter(arrays[at:at + n], form))
    at += n
  return values


def _check(i: int, out, form) -> None:
  """Raises `_FormChanged` if the body returns carry `i` in another form than `form`."""
  if isinstance(form, tuple):
    widened = tuple(a or b for a, b in zip(form, _flags(out)))
    if widened != form:
      raise _FormChanged(i, widened)
    return
  leaves, treedef = jax.tree.flatten(form)
  out_leaves, out_treedef = jax.tree.flatten(out)
  if out_treedef != treedef or any(
      (a is not b) if _is_fixed(a) else (jnp.shape(a) != jnp.shape(b) or a.dtype != b.dtype)
      for a, b in zip(leaves, out_leaves)):
    raise _FormChanged(i, tuple(a or b for a, b in zip(_flags(form), _flags(out))))


def scan(rw, eqn, operands):
  # The operands' groups (consts, carries, scanned inputs) and the outputs' (carries, stacked).
  ft_in = [list(group) for group in eqn.params["ft_in"].unpack()]
  ft_out = [list(group) for group in eqn.params["ft_out"].unpack()]
  if any(leaf is not None for group in ft_in for leaf in group) or any(
      leaf != _stacked_marker() for leaf in ft_out[1]):
    raise Decline("a scan with other than stacked inputs and outputs runs as written")
  n_consts, n_carry = len(ft_in[0]), len(ft_in[1])
  consts = operands[:n_consts]
  init = list(operands[n_consts:n_consts + n_carry])
  xs = [_ordinary(v) for v in operands[n_consts + n_carry:]]
  body = eqn.params["jaxpr"]
  # Per carry: the lazy value it starts as (a lazy form), or the lineage flags of an ordinary one.
  forms = [v if isinstance(v, LAZY) else _flags(v) for v in init]

  def attempt(report):
    y_flags = []

    def step(carry_arrays, x_arrays):
      carry = _values(carry_arrays, init, forms)
      xs_in = [Plain(x, *_flags(v)) for x, v in zip(x_arrays, xs)]
      outs = rw.nested(report).eval_jaxpr(body.jaxpr, body.consts, [*consts, *carry, *xs_in])
      carry_out, ys = outs[:n_carry], outs[n_carry:]
      for i, (out, form) in enumerate(zip(carry_out, forms)):
        _check(i, out, form)
      y_flags[:] = [_flags(y) for y in ys]
      new_carry = [a for out, form in zip(carry_out, forms) for a in _carried(out, form)]
      return ([a.astype(b.dtype) for a, b in zip(new_carry, carry_arrays)],
              [materialize(y) for y in ys])

    init_arrays = [a for v, form in zip(init, forms) for a in _carried(v, form)]
    final, stacked = jax.lax.scan(step, init_arrays, [x.value for x in xs],
                                  length=eqn.params["length"], reverse=eqn.params["reverse"],
                                  unroll=eqn.params["unroll"])
    return final, stacked, y_flags

  while True:  # each retry demotes a carry or widens a flag: a few at most
    report = Report(context=list(rw.report.context))
    try:
      final, stacked, y_flags = attempt(report)
      break
    except _FormChanged as changed:
      start = init[changed.index]
      forms[changed.index] = changed.form
      init[changed.index] = _ordinary(start, tuple(
          a or b for a, b in zip(changed.form, _flags(start))))
  rw.report.changes.extend(report.changes)
  demoted = sum(isinstance(f, tuple) and isinstance(v, LAZY)
                for f, v in zip(forms, operands[n_consts:n_consts + n_carry]))
  rw.report.add("entered", eqn, reason=f"{demoted} carries made ordinary" if demoted else "")
  return [*_values(final, init, forms), *(Plain(y, *flags) for y, flags in zip(stacked, y_flags))]


RULES = {P.scan_p: scan}
