"""Rules for primitives that hold functions: custom derivatives, `checkpoint`, `cond`.

Each is entered only in a way that keeps what it means:

* `custom_jvp`: the call becomes a new `custom_jvp` whose primal is the
  rewritten primal and whose rule is the user's rule, evaluated by the rewrite
  on the same lazy operands (at read rows, `read_rows.py`) and tangents
  (unread rows zero). It is used only where the rule's results have the same
  form as the primal's (a broadcast's tangent is a broadcast by the same
  index), so the tangent at B is exactly the user's rule's tangent; otherwise,
  and for rules with symbolic zeros, the call runs as written.
* `custom_vjp`: the user's backward takes cotangents at B, which the rewritten
  call could not give it, so the call runs as written.
* `checkpoint` (`jax.checkpoint`, `nnx.remat`): the body is rewritten and
  wrapped again with the same policy.
* `cond` (and `switch`): every branch is rewritten; results that do not have
  one form in all branches are made ordinary inside the branches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import primitives as P

from ikbo_jax.rewrite import closure
from ikbo_jax.rewrite.report import Decline, Report
from ikbo_jax.rewrite.values import at_read_rows, materialize, Plain, read_rows_only


def _plain(v):
  return Plain(materialize(v), True)


def custom_jvp_call(rw, eqn, operands):
  if eqn.params.get("symbolic_zeros"):
    raise Decline("the custom_jvp rule takes symbolic zeros")
  if any(not jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in eqn.outvars):
    raise Decline("the custom_jvp function has integer results")
  closed = eqn.params["call_jaxpr"]
  key = (str(closed.jaxpr), tuple(str(v.aval) for v in eqn.invars))
  if key in rw.entered:  # the call inside its own rule (`ans = f(x)`)
    return rw.entered[key](operands)
  arrays, rebuild = closure.split(operands)
  jvp_closed, differentiable = _jvp_jaxpr(eqn)

  def primal_values(report, xs):
    return rw.nested(report).eval_jaxpr(closed.jaxpr, closed.consts, rebuild(xs))

  def jvp_values(report, xs, dxs, itself):
    primals = [at_read_rows(v) for v in rebuild(xs)]  # see read_rows.py
    tangents = [read_rows_only(v) for v in rebuild(
        [dx if jnp.issubdtype(x.dtype, jnp.inexact) else x for x, dx in zip(xs, dxs)])]
    outs = rw.nested(report, {key: itself}).eval_jaxpr(
        jvp_closed.jaxpr, jvp_closed.consts, primals + [tangents[i] for i in differentiable])
    return outs[:len(eqn.outvars)], outs[len(eqn.outvars):]

  # The forms of the results, traced abstractly, decide whether the rule can be kept at U.
  forms = {}
  by_primal = lambda ops: rw.nested(Report()).eval_jaxpr(closed.jaxpr, closed.consts, ops)

  def primal_form(*xs):
    results, forms["primal"] = closure.export(primal_values(Report(), xs), xs)
    return results

  def jvp_form(*xs):
    p, t = jvp_values(Report(), xs, xs, by_primal)
    p_results, forms["jvp_primal"] = closure.export(p, xs)
    t_results, forms["tangent"] = closure.export(t, xs)
    return p_results, t_results

  jax.eval_shape(primal_form, *arrays)
  jax.eval_shape(jvp_form, *arrays)
  if not forms["primal"] == forms["jvp_primal"] == forms["tangent"]:
    raise Decline("the custom_jvp rule's results do not have the primal's form at U")
  structure = forms["primal"]

  @jax.custom_jvp
  def call(*xs):
    return closure.export(primal_values(rw.report, xs), xs)[0]

  def call_lazy(ops):
    xs, _ = closure.split(ops)
    return structure.rebuild(xs, call(*xs))

  @call.defjvp
  def call_jvp(xs, dxs):
    p, t = jvp_values(Report(), xs, dxs, call_lazy)
    return closure.export(p, xs)[0], closure.export(t, xs)[0]

  rw.report.add("entered", eqn)
  return structure.rebuild(arrays, call(*arrays))


def _jvp_jaxpr(eqn):
  """The jaxpr of `jax.jvp` of the call as written (its rule inlined), over float operands."""
  avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
  differentiable = [i for i, a in enumerate(avals) if jnp.issubdtype(a.dtype, jnp.inexact)]
  params = eqn.primitive.get_bind_params(eqn.params)

  def jvp_of_call(*args):
    primals, tangents = args[:len(avals)], args[len(avals):]

    def call(*floats):
      full = list(primals)
      for i, x in zip(differentiable, floats):
        full[i] = x
      return eqn.primitive.bind(*full, **params)

    return jax.jvp(call, [primals[i] for i in differentiable], list(tangents))

  closed = jax.make_jaxpr(jvp_of_call)(*avals, *[avals[i] for i in differentiable])
  return closed, differentiable


def custom_vjp_call(rw, eqn, operands):
  raise Decline("a custom_vjp's backward rule takes cotangents at B; the call runs as written")


def checkpoint(rw, eqn, operands):
  jaxpr = eqn.params["jaxpr"]
  arrays, rebuild = closure.split(operands)
  structure = {}

  def body(*xs):
    outs = rw.nested().eval_jaxpr(jaxpr, (), rebuild(xs))
    results, structure["out"] = closure.export(outs, xs)
    return results

  results = jax.checkpoint(body, prevent_cse=eqn.params["prevent_cse"],
                           policy=eqn.params["policy"])(*arrays)
  rw.report.add("entered", eqn)
  return structure["out"].rebuild(arrays, results)


def cond(rw, eqn, operands):
  index, *rest = operands
  if not isinstance(index, Plain):
    raise Decline("the branch index is not an ordinary scalar")
  branches = eqn.params["branches"]
  arrays, rebuild = closure.split(rest)

  def branch_fn(closed, report, as_plain):
    def fn(*xs):
      outs = rw.nested(report).eval_jaxpr(closed.jaxpr, closed.consts, rebuild(xs))
      return closure.export(outs, xs, materialize=_plain if as_plain else None)
    return fn

  structures = []
  for c in branches:
    captured = {}

    def form(*xs, c=c, captured=captured):
      results, captured["s"] = branch_fn(c, Report(), False)(*xs)
      return results

    jax.eval_shape(form, *arrays)
    structures.append(captured["s"])
  as_plain = any(s != structures[0] for s in structures)
  chosen = {}

  def run(c):
    def fn(*xs):
      results, chosen["s"] = branch_fn(c, rw.report, as_plain)(*xs)
      return results
    return fn

  results = jax.lax.switch(index.value, [run(c) for c in branches], *arrays)
  rw.report.add("entered", eqn, reason="results made ordinary in the branches" if as_plain else "")
  return chosen["s"].rebuild(arrays, results)


RULES = {P.custom_jvp_call_p: custom_jvp_call, P.custom_vjp_call_p: custom_vjp_call,
         P.remat_p: checkpoint, P.cond_p: cond}
