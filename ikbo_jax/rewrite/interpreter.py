"""The jaxpr interpreter: evaluates a traced function with batch lineage, rule by rule.

In the style of `jax.experimental.sparse`'s `sparsify`: the function is traced
to a jaxpr once, then evaluated equation by equation on interpreted values
(`values.py`), with the operands of each equation given to its primitive's
rule (`rules.py`). Nested `jit`s and `custom_jvp`/`custom_vjp` calls whose
operands carry broadcasts are evaluated inline, so their insides can move to
batch U; everything without a rule (including `scan`, `cond`, `while`) gets its
broadcasts made real and runs exactly as written.
"""

from __future__ import annotations

import math

import numpy as np
from jax.extend import core as jex_core

from ikbo_jax.rewrite import marker, rules
from ikbo_jax.rewrite.report import Report
from ikbo_jax.rewrite.values import (Broadcast, Concat, Mapping, Negative, Plain, RowConstant,
                                     Shifted, at_b, materialize)

_LAZY = (Broadcast, Concat, Mapping, Negative, Shifted, RowConstant)
_MAKERS = ("broadcast_in_dim", "iota")


class Rewriter:
  """Evaluates jaxprs with broadcasts of one mapping kept lazy."""

  def __init__(self, report: Report):
    self.report = report
    self.num_users: int | None = None

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
    # Constants along the batch axis are tracked from where they are made.
    if any(isinstance(v, _LAZY) for v in operands) or eqn.primitive.name in _MAKERS:
      outs = self._apply_rules(eqn, operands)
      if outs is not None:
        return outs
    return self.default(eqn, operands)

  def _apply_rules(self, eqn, operands):
    name = eqn.primitive.name
    if name in ("jit", "pjit"):
      if marker.is_marker(eqn):
        outs = marker.rule(self, eqn, operands)
        if outs is not None:
          return outs
      closed = eqn.params["jaxpr"]
      return self.eval_jaxpr(closed.jaxpr, closed.consts, operands)
    if name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
      # Inline: the ops inside move to batch U. The custom derivative rule is
      # lost for this call; the primal ops' own derivatives are used instead
      # (for activations such as relu they differ at measure-zero points only).
      closed = eqn.params.get("call_jaxpr") or eqn.params["fun_jaxpr"]
      return self.eval_jaxpr(closed.jaxpr, closed.consts, operands)
    rule = rules.RULES.get(name)
    outs = rule(self, eqn, operands) if rule else None
    if outs is None and any(isinstance(v, (Mapping, Negative, Shifted)) for v in operands):
      outs = rules.mapping_ops(self, eqn, operands)
    return outs

  def default(self, eqn, operands):
    """The equation as written, on ordinary arrays."""
    for v in operands:
      if isinstance(v, (Broadcast, Concat)):
        self.report.add("materialized", eqn, bytes_saved=-_bytes(v))
    arrays = [materialize(v) for v in operands]
    outs = eqn.primitive.bind(*arrays, **eqn.primitive.get_bind_params(eqn.params))
    outs = outs if eqn.primitive.multiple_results else [outs]
    candidate = any(at_b(v) for v in operands)
    return [Plain(o, candidate) for o in outs]

  def moved(self, eqn, out, like: Broadcast) -> None:
    """Records that `eqn` ran at batch U (with the FLOPs it saved, for products)."""
    flops = 0
    if eqn.primitive.name == "dot_general":
      (lc, _), _ = eqn.params["dimension_numbers"]
      contracted = math.prod(eqn.invars[0].aval.shape[d] for d in lc)
      flops = 2 * contracted * (math.prod(eqn.outvars[0].aval.shape) - math.prod(out.shape))
    self.report.add("at_users", eqn, flops_saved=flops)


def _bytes(v) -> int:
  """Bytes of the `[B, ...]` copies that making `v` ordinary writes."""
  if isinstance(v, Concat):
    return sum(_bytes(p) for p in v.parts if isinstance(p, Broadcast))
  return math.prod(v.shape) * np.dtype(v.user.dtype).itemsize
