"""A seeded, randomized correctness sweep of every op and every implementation that claims the inputs.

The cases come from `cases.py` (re-exported here: `sweep.AttentionCase`,
`sweep.draw_case`, ...). `run_case` builds fresh random
inputs, computes the error rule's two references once, and for every
implementation that `ikbo_jax._dispatch` says supports the inputs on this
device checks the forward outputs and the gradient of every float input
(for a random cotangent) with `error_rule.compare`, and that two calls give
the same bits. The GPU tests run a fixed set of cases; `tools/soak.py` runs
as many as a time budget allows and prints the worst per op and implementation.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ikbo_jax import _dispatch
from ikbo_jax.ops import linear_compression as lce_op
from ikbo_jax.ops import self_target_attention as self_target_op
from ikbo_jax.ops import target_attention as target_op
from ikbo_jax.ops import two_level_linear_compression as two_level_op
from ikbo_jax.ops import two_level_target_attention as two_level_attention_op
from ikbo_jax.testing import error_rule, references
from ikbo_jax.testing.cases import (DTYPES, OPS, PEAKS, TINY_SHARE, AttentionCase,
                                    LinearCompressionCase, Mapping, TwoLevelAttentionCase,
                                    TwoLevelLinearCompressionCase, TwoLevelMapping,
                                    draw_attention_case, draw_case,
                                    draw_linear_compression_case,
                                    draw_two_level_attention_case,
                                    draw_two_level_linear_compression_case)

__all__ = ["DTYPES", "OPS", "PEAKS", "TINY_SHARE", "AttentionCase",
           "LinearCompressionCase", "Mapping", "Problem", "Result",
           "TwoLevelAttentionCase", "TwoLevelLinearCompressionCase", "TwoLevelMapping",
           "assert_passes", "draw_attention_case", "draw_case", "draw_linear_compression_case",
           "draw_two_level_attention_case", "draw_two_level_linear_compression_case", "run_case",
           "summarize"]

_HIGHEST = jax.lax.Precision.HIGHEST


def __getattr__(name: str):
  # The Mosaic GPU backward was an extra path here until it became `mosaic_gpu`'s own.
  if name == "HOPPER_BACKWARD":
    warnings.warn("sweep.HOPPER_BACKWARD is deprecated: the Mosaic GPU backward is now the "
                  "'mosaic_gpu' implementation's own; use 'mosaic_gpu'",
                  DeprecationWarning, stacklevel=2)
    return "mosaic_gpu"
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass(frozen=True)
class Result:
  """One implementation on one case: every output's comparison and the repeatability."""

  case: (LinearCompressionCase | TwoLevelLinearCompressionCase | AttentionCase
         | TwoLevelAttentionCase)
  implementation: str
  comparisons: tuple[error_rule.Comparison, ...]
  repeatable: bool  # the forward, and the gradients where the backward promises it
  reported_only: tuple[str, ...] = ()  # outputs measured but not held to the rule

  @property
  def ok(self) -> bool:
    return self.repeatable and all(c.ok for c in self.comparisons
                                   if c.name not in self.reported_only)

  def describe(self) -> str:
    lines = [f"{self.case.op} / {self.implementation}: {self.case}"]
    lines += [("  ok   " if c.ok else "  info " if c.name in self.reported_only else "  FAIL ")
              + c.describe() for c in self.comparisons]
    lines.append(f"  repeatable: {self.repeatable}")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Problem:
  """One case's inputs and how to run them.

  Attributes:
    args: the float inputs (differentiated).
    cotangents: one per output, for the VJP.
    run: `implementation -> fn(*args)`.
    reference: `precision -> fn(*args)`, the XLA reference.
    backends: the op's declared backends (what `_dispatch` resolves).
    facts: what the backends' limits look at (e.g. `head_dim`).
    names: the outputs' names; `grad_names` the gradients', in `args` order.
  """

  args: tuple
  cotangents: tuple | jax.Array
  run: Callable[[str], Callable]
  reference: Callable[[object], Callable]
  backends: tuple
  facts: dict
  names: tuple[str, ...]
  grad_names: tuple[str, ...]


def _normal(key, shape, dtype, scale=1.0):
  return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def _interpreted(impl: str, interpret: bool, backends) -> dict:
  """The `interpret=` keyword for a kernel implementation run under the interpreter."""
  kernels = {b.name for b in backends if b.is_kernel}
  return {"interpret": True} if interpret and impl in kernels else {}


def _lce_problem(case: LinearCompressionCase, interpret: bool) -> Problem:
  keys = jax.random.split(jax.random.key(case.seed), 5)
  b, u = case.mapping.num_candidates, case.mapping.num_users
  shapes = ((case.m, case.k_user), (case.m, case.k_cand), (u, case.k_user, case.n),
            (b, case.k_cand, case.n))
  fan_in = case.k_user + case.k_cand
  args = tuple(_normal(key, s, case.dtype, 1 / np.sqrt(fan_in) if len(s) == 2 else 1.0)
               for key, s in zip(keys, shapes))
  cotangent = _normal(keys[4], (b, case.m, case.n), case.dtype)
  index = case.mapping.index(np.random.default_rng(case.seed))

  def run(impl):
    return lambda *a: lce_op.linear_compression(*a, index, implementation=impl,
                                                **_interpreted(impl, interpret, lce_op.BACKENDS))

  def reference(precision):
    return lambda *a: references.linear_compression(*a, index.cand_to_user, precision=precision)

  return Problem(args=args, cotangents=cotangent, run=run, reference=reference,
                 backends=lce_op.BACKENDS, facts={}, names=("out",),
                 grad_names=("d_w_user", "d_w_cand", "d_e_user", "d_e_cand"))


def _two_level_problem(case: TwoLevelLinearCompressionCase, interpret: bool) -> Problem:
  keys = jax.random.split(jax.random.key(case.seed), 7)
  u, g, b = case.mapping.num_users, case.mapping.num_groups, case.mapping.num_items
  ks = (case.k_user, case.k_group, case.k_item)
  shapes = [(case.m, k) for k in ks] + [(rows, k, case.n) for rows, k in zip((u, g, b), ks)]
  scale = 1 / np.sqrt(sum(ks))
  args = tuple(_normal(key, s, case.dtype, scale if len(s) == 2 else 1.0)
               for key, s in zip(keys, shapes))
  cotangent = _normal(keys[6], (b, case.m, case.n), case.dtype)
  index = case.mapping.index(np.random.default_rng(case.seed))

  def run(impl):
    return lambda *a: two_level_op.two_level_linear_compression(
        *a, index, implementation=impl, **_interpreted(impl, interpret, lce_op.BACKENDS))

  def reference(precision):
    return lambda *a: references.two_level_linear_compression(
        *a, index.items.cand_to_user, index.item_to_user.cand_to_user, precision=precision)

  return Problem(args=args, cotangents=cotangent, run=run, reference=reference,
                 backends=lce_op.BACKENDS, facts={}, names=("out",),
                 grad_names=("d_w_user", "d_w_group", "d_w_item", "d_e_user", "d_e_group",
                             "d_e_item"))


def _two_level_attention_problem(case: TwoLevelAttentionCase, interpret: bool) -> Problem:
  keys = jax.random.split(jax.random.key(case.seed), 7)
  m, t, h, d = case.mapping, case.n_seed, case.heads, case.head_dim
  index = m.index(np.random.default_rng(case.seed))
  kv_user = jnp.asarray(case.kv_len_user, jnp.int32)
  kv_group = jnp.asarray(case.kv_len_group, jnp.int32)
  shapes = ((m.num_items, t, h, d), *[(m.num_users, case.seq_len_user, h, d)] * 2,
            *[(m.num_groups, case.seq_len_group, h, d)] * 2)
  args = tuple(_normal(key, shape, case.dtype) for key, shape in zip(keys, shapes))
  cotangents = (_normal(keys[5], shapes[0], case.dtype),
                jax.random.normal(keys[6], (m.num_items, t, h), jnp.float32))

  def run(impl):
    return lambda *a: two_level_attention_op.two_level_target_attention(
        *a, index, kv_len_user=kv_user, kv_len_group=kv_group, return_lse=True,
        implementation=impl, **_interpreted(impl, interpret, target_op.BACKENDS))

  def reference(precision):
    return lambda *a: references.two_level_target_attention(
        *a, index.item_to_user.cand_to_user, index.items.cand_to_user, kv_user, kv_group,
        scale=1 / np.sqrt(d), precision=precision)

  return Problem(args=args, cotangents=cotangents, run=run, reference=reference,
                 backends=target_op.BACKENDS, facts=dict(head_dim=d), names=("out", "lse"),
                 grad_names=("dq", "dk_user", "dv_user", "dk_group", "dv_group"))


def _peaked(case: AttentionCase, key, index, q, k):
  """`q, k` with each user's key 0 and its candidates' queries moved along one random direction.

  The logit of key 0 grows by about `peak^2 sqrt(D)` over the others', so most
  of each row's weight sits on one key (the case where `ds = p (dp - delta)`
  cancels).
  """
  if not case.peak:
    return q, k
  direction = case.peak * jax.random.normal(key, (k.shape[0], *k.shape[2:]), jnp.float32)
  return q + direction[index.clamped_cand_to_user][:, None], k.at[:, 0].set(direction)


def _attention_problem(case: AttentionCase, interpret: bool) -> Problem:
  keys = jax.random.split(jax.random.key(case.seed), 7)
  b, u = case.mapping.num_candidates, case.mapping.num_users
  t, s, h, d = case.n_seed, case.seq_len, case.heads, case.head_dim
  index = case.mapping.index(np.random.default_rng(case.seed))
  kv_len = jnp.asarray(case.kv_len, jnp.int32)
  scale = 1 / np.sqrt(d)
  peak_key = jax.random.fold_in(jax.random.key(case.seed), 7)
  q, k = _peaked(case, peak_key, index, _normal(keys[0], (b, t, h, d), jnp.float32),
                 _normal(keys[1], (u, s, h, d), jnp.float32))
  q, k, v = q.astype(case.dtype), k.astype(case.dtype), _normal(keys[2], (u, s, h, d), case.dtype)
  lse_cotangent = jax.random.normal(keys[3], (b, t, h), jnp.float32)
  if not case.lse_cotangent:
    lse_cotangent = jnp.zeros_like(lse_cotangent)
  if case.causal is None:
    def run(impl):
      return lambda *a: target_op.target_attention(
          *a, index, kv_len=kv_len, return_lse=True, implementation=impl,
          **_interpreted(impl, interpret, target_op.BACKENDS))

    def reference(precision):
      return lambda *a: references.target_attention(
          *a, index.cand_to_user, kv_len, scale=scale, precision=precision)

    return Problem(args=(q, k, v),
                   cotangents=(_normal(keys[4], q.shape, case.dtype), lse_cotangent),
                   run=run, reference=reference, backends=target_op.BACKENDS,
                   facts=dict(head_dim=d), names=("out", "lse"), grad_names=("dq", "dk", "dv"))
  q_user = _normal(keys[5], (u, s, h, d), case.dtype)

  def run(impl):
    return lambda *a: self_target_op.self_target_attention(
        *a, index, kv_len=kv_len, causal=case.causal, implementation=impl,
        **_interpreted(impl, interpret, self_target_op.BACKENDS))

  def reference(precision):
    return lambda *a: references.self_target_attention(
        *a, index.cand_to_user, kv_len, scale=scale, causal=case.causal, precision=precision)

  cotangents = (_normal(keys[6], q_user.shape, case.dtype), _normal(keys[4], q.shape, case.dtype))
  return Problem(args=(q_user, q, k, v), cotangents=cotangents, run=run, reference=reference,
                 backends=self_target_op.BACKENDS, facts=dict(head_dim=d),
                 names=("out_user", "out_cand"), grad_names=("dq_user", "dq_cand", "dk", "dv"))


def _repeatable_outputs(case, implementation: str, num_outputs: int) -> int:
  """How many leading outputs (forward, then gradients) must be bitwise repeatable.

  Every forward must be, and every gradient of the IKBO paths: their per-user
  sums run in a fixed order (`ikbo_jax.ops.user_sums`, the kernels' per-user
  loops). Not held to it: the `xla_materialized` baseline (plain autodiff,
  whose scatter-add adds with atomics on a GPU) and the self + target kernel's
  user side, which runs cuDNN's backward.
  """
  forward = 1 if case.op.endswith("linear_compression") else 2
  if implementation == "xla_materialized":
    return forward
  if case.op == "self_target_attention" and implementation == "mosaic_gpu":
    return forward
  return num_outputs


def _reported_only(case, implementation: str) -> tuple[str, ...]:
  """The materialized baseline's user-side gradients, from 16-bit inputs.

  `xla_materialized` is plain autodiff through the broadcast, the computation
  models run today: its user-side gradients are a scatter-add in the input
  dtype, several times less accurate than the float32 per-user sums the
  reference (and every IKBO path) uses. They are the baseline, not a path
  under test, so they are reported but not held to the rule.
  """
  if implementation != "xla_materialized" or case.dtype == "float32":
    return ()
  return {"linear_compression": ("d_w_user", "d_e_user"),
          "two_level_linear_compression": ("d_w_user", "d_e_user", "d_w_group", "d_e_group"),
          "two_level_target_attention": ("dk_user", "dv_user", "dk_group", "dv_group"),
          }.get(case.op, ("dk", "dv"))


# The share of dv's norm below which attention's dq and dk are not judged on their own norm.
_CANCELLED_SCALE = 0.01


def _error_scales(names, f32) -> dict:
  """A floor on the norm attention's dq and dk are judged against: 1% of dv's.

  dq and dk cancel to (nearly) zero where the softmax is (nearly) one-hot, so
  their own norm would divide rounding noise by ~0. dv has no such
  cancellation. The floor is a small share of it: judged on dv's whole norm,
  a dq of a peaked softmax (often 10-100x smaller) could be 10-100x worse than
  the reference and pass.
  """
  dvs = [i for i, name in enumerate(names) if name.startswith("dv")]
  if not dvs:
    return {}
  dv_norm = float(np.sqrt(sum(np.linalg.norm(np.asarray(f32[i], np.float64)) ** 2
                              for i in dvs)))
  return {name: _CANCELLED_SCALE * dv_norm for name in names if name.startswith(("dq", "dk"))}


def _forward_and_grads(fn, args, cotangents) -> list:
  """The outputs, then the gradient of each argument, as one flat list."""
  out, vjp = jax.vjp(fn, *args)
  return jax.tree.leaves((out, vjp(cotangents)))


def run_case(case, implementations: tuple[str, ...] | None = None,
             interpret: bool = False) -> list[Result]:
  """Checks each implementation that supports `case` on this device (or those named).

  With `interpret`, the named kernel implementations run under the Pallas
  interpreter (CPU tests).
  """
  build = {"linear_compression": _lce_problem,
           "two_level_linear_compression": _two_level_problem,
           "two_level_target_attention": _two_level_attention_problem,
           }.get(case.op, _attention_problem)
  problem = build(case, interpret)
  supported = _dispatch.supported(problem.backends, case.dtype, interpret, **problem.facts)
  chosen = supported if implementations is None else tuple(
      i for i in implementations if i in supported)
  if not chosen:
    return []
  args, cotangents = problem.args, problem.cotangents
  upcast = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
  f32 = jax.jit(functools.partial(_forward_and_grads, problem.reference(_HIGHEST)))(
      upcast(args), upcast(cotangents))
  same = jax.jit(functools.partial(_forward_and_grads, problem.reference(None)))(
      args, cotangents)
  names = problem.names + problem.grad_names
  scales = _error_scales(names, f32)
  results = []
  for impl in chosen:
    step = functools.partial(_forward_and_grads, problem.run(impl))
    # Under `jit` the Mosaic GPU interpreter's kernels wait on each other forever
    # on a 2-core host (seen with jax 0.11.2); run eagerly, they finish.
    step = step if interpret else jax.jit(step)
    got = step(args, cotangents)
    # The interpreter replays each kernel's arithmetic in program order: a second
    # call there checks nothing the GPU run does not (and doubles the CPU time).
    again = got if interpret else step(args, cotangents)
    comparisons = tuple(
        error_rule.compare(name, x, s, r, case.dtype, scales.get(name, 0.0))
        for name, x, s, r in zip(names, got, same, f32))
    checked = _repeatable_outputs(case, impl, len(names))
    repeatable = all(np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
                     for a, b in zip(got[:checked], again[:checked]))
    results.append(Result(case, impl, comparisons, repeatable, _reported_only(case, impl)))
  return results


def assert_passes(case, implementations: tuple[str, ...], interpret: bool = False) -> None:
  """`run_case` on exactly `implementations`, raising with every failure described."""
  results = run_case(case, implementations, interpret=interpret)
  assert {r.implementation for r in results} == set(implementations), (
      f"not every implementation ran: {[r.implementation for r in results]}")
  failures = [r.describe() for r in results if not r.ok]
  assert not failures, "\n".join(failures)


def summarize(results: list[Result]) -> dict:
  """Per op and implementation: cases, failures, repeatability and the worst ratio per output."""
  summary = {}
  for result in results:
    entry = summary.setdefault(f"{result.case.op}/{result.implementation}", dict(
        cases=0, failures=0, not_repeatable=0, worst_ratio={}, worst_row_excess={}))
    entry["cases"] += 1
    entry["failures"] += not result.ok
    entry["reported_only"] = list(result.reported_only)
    entry["not_repeatable"] += not result.repeatable
    for c in result.comparisons:
      entry["worst_ratio"][c.name] = max(entry["worst_ratio"].get(c.name, 0.0), c.ratio)
      entry["worst_row_excess"][c.name] = max(
          entry["worst_row_excess"].get(c.name, -np.inf), c.worst_row_excess)
  return summary
