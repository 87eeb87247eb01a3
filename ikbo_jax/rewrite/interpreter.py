"""The jaxpr interpreter: evaluates a traced function with batch lineage, rule by rule.

In the style of `jax.experimental.sparse`'s `sparsify`: the function is traced
to a jaxpr once, then evaluated equation by equation on interpreted values
(`values.py`), with the operands of each equation given to its primitive's
rule. A rule returns the interpreted results, returns None (it does not apply)
or raises `Decline` with a reason; in both of the last cases, and if a rule
fails in any other way, the equation runs exactly as written on materialized
operands and the report says why. Nested `jit`s are evaluated inline; custom
derivative rules, `checkpoint` and `cond` are entered with their semantics
kept (`higher_order.py`), and `scan` bodies with carried broadcasts kept at U
where the body allows it (`scan.py`).

Integer equations on ordinary values are evaluated once per distinct input
(common subexpressions are shared), so that every `x[ids]` of a program, each
of which normalizes the mapping again, gathers with one and the same index,
which later rules recognize by identity.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import source_info_util
from jax.extend import core as jex_core
from jax.extend.core import primitives as P

from ikbo_jax.rewrite import dense, gathers, higher_order, marker, rules, scan, stacked
from ikbo_jax.rewrite.report import Decline, Report
from ikbo_jax.rewrite.values import (LAZY, Broadcast, Concat, Plain, RowConstant, lineage,
                                     materialize)


# Keyed by primitive objects (see `rules.py`).
_MAKERS = frozenset({P.broadcast_in_dim_p, P.iota_p, P.gather_p})
_RULES = {**rules.RULES, **stacked.RULES, **dense.RULES, P.gather_p: gathers.gather}
_HIGHER_ORDER = {**higher_order.RULES, **scan.RULES}
_NOT_SHARED = frozenset({P.rng_uniform_p, P.rng_bit_generator_p, P.random_seed_p,
                         P.random_bits_p})


class Rewriter:
  """Evaluates jaxprs with broadcasts of user rows kept lazy."""

  def __init__(self, report: Report):
    self.report = report
    self.entered: dict = {}  # custom_jvp calls inside their own rules (`higher_order.py`)
    self._memo: dict = {}

  def nested(self, report: Report | None = None, entered: dict | None = None) -> Rewriter:
    """A rewriter for a nested trace: its own shared subexpressions (tracers do not cross)."""
    inner = type(self)(self.report if report is None else report)
    inner.entered = self.entered if entered is None else {**self.entered, **entered}
    return inner

  def eval_jaxpr(self, jaxpr, consts, args):
    env = {}
    read = lambda var: (Plain(var.val) if isinstance(var, jex_core.Literal) else env[var])
    for var, value in zip(jaxpr.constvars, consts):
      env[var] = Plain(value)
    for var, value in zip(jaxpr.invars, args):
      env[var] = value
    for eqn in jaxpr.eqns:
      outs = self.eval_eqn(eqn, [read(v) for v in eqn.invars])
      for var, value in zip(eqn.outvars, outs):
        env[var] = value
    return [read(v) for v in jaxpr.outvars]

  def eval_eqn(self, eqn, operands):
    primitive, name = eqn.primitive, eqn.primitive.name
    lazy = any(isinstance(v, LAZY) for v in operands)
    if primitive is P.jit_p and not marker.is_marker(eqn):
      closed = eqn.params["jaxpr"]
      self.report.context.append(source_info_util.summarize(eqn.source_info))
      try:
        return self.eval_jaxpr(closed.jaxpr, closed.consts, operands)
      finally:
        self.report.context.pop()
    reason = None
    if lazy or primitive in _MAKERS:
      key = self._shared_key(eqn, operands)
      if key is not None and key in self._memo:
        return self._memo[key][0]
      try:
        outs = self._apply_rule(eqn, operands)
      except Decline as declined:
        outs, reason = None, str(declined)
        if not lazy:  # a gather that stays one: the copy it makes is what a broadcast avoids
          self.report.add("materialized", eqn, reason=reason,
                          bytes_saved=-sum(gathers.nbytes(v.aval) for v in eqn.outvars))
      except Exception as error:  # a rule that fails is a bug in the rule, not in the program
        outs, reason = None, f"the {name} rule failed ({type(error).__name__}: {error})"
      if outs is not None:
        if key is not None:
          self._memo[key] = (outs, operands)
        return outs
    return self.default(eqn, operands, reason or f"no rule moves {name} on these operands")

  def _apply_rule(self, eqn, operands):
    if marker.is_marker(eqn):
      return marker.rule(self, eqn, operands)
    rule = _HIGHER_ORDER.get(eqn.primitive) or _RULES.get(eqn.primitive)
    return rule(self, eqn, operands) if rule else None

  def default(self, eqn, operands, reason: str = ""):
    """The equation as written, on ordinary arrays."""
    for v in operands:
      if isinstance(v, (Broadcast, Concat)):
        self.report.add("materialized", eqn, bytes_saved=-_bytes(v), reason=reason)
    key = self._shared_key(eqn, operands)
    if key is not None and key in self._memo:
      return self._memo[key][0]
    arrays = [materialize(v) for v in operands]
    outs = eqn.primitive.bind(*arrays, **eqn.primitive.get_bind_params(eqn.params))
    outs = lineage(operands, outs if eqn.primitive.multiple_results else [outs])
    if len(outs) == 1 and (known := gathers.bounds(eqn, operands)) is not None:
      o = outs[0]
      outs = [Plain(o.value, o.at_b, o.at_u, o.mapped, known)]
    if key is not None:
      self._memo[key] = (outs, operands)  # the operands stay alive: their ids stay unique
    return outs

  def memo(self, tag, value, compute):
    """`compute(value)`, once per `(tag, value)`: derived indices keep one identity."""
    key = (tag, id(value))
    if key not in self._memo:
      self._memo[key] = (compute(value), value)
    return self._memo[key][0]

  def _shared_key(self, eqn, operands):
    """A key under which equal integer equations share one result, or None.

    Integer values are indices: two gathers by equal indices read the same rows only if the
    rewrite can tell the indices equal, so equal equations on the same operands (ordinary or
    constant along some axes) give one result.
    """
    if (eqn.effects or eqn.primitive in _NOT_SHARED or not eqn.outvars or any(
        not (jnp.issubdtype(v.aval.dtype, jnp.integer) or v.aval.dtype == jnp.bool_)
        for v in eqn.outvars)):
      return None
    keys = []
    for v in operands:
      if isinstance(v, RowConstant):
        keys.append(("row_constant", id(v.compact), v.shape, v.at_u, v.at_b))
        continue
      if not isinstance(v, Plain):
        return None
      if not isinstance(v.value, jax.core.Tracer) and np.ndim(v.value) == 0:  # a literal
        keys.append(("literal", np.asarray(v.value).dtype.str, np.asarray(v.value).item()))
      else:
        keys.append(id(v.value))
    try:
      key = ("eqn", eqn.primitive, tuple(sorted(eqn.params.items())), tuple(keys))
      hash(key)
    except TypeError:
      return None
    return key

  def moved(self, eqn, out, like: Broadcast) -> None:
    """Records that `eqn` ran at batch U (with the FLOPs it saved, for products)."""
    flops = 0
    if eqn.primitive is P.dot_general_p:
      (lc, _), _ = eqn.params["dimension_numbers"]
      contracted = math.prod(eqn.invars[0].aval.shape[d] for d in lc)
      flops = 2 * contracted * (math.prod(eqn.outvars[0].aval.shape) - math.prod(out.shape))
    self.report.add("at_users", eqn, flops_saved=flops)


def _bytes(v) -> int:
  """Bytes of the `[B, ...]` copies that making `v` ordinary writes."""
  if isinstance(v, Concat):
    return sum(_bytes(p) for p in v.parts if isinstance(p, Broadcast))
  return math.prod(v.shape) * np.dtype(v.user.dtype).itemsize
