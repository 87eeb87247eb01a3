"""`check_rewrite`: `rewrite(fn)` computes what `fn` computes, forward and every gradient.

The one equality every rewrite test and the property-based test over generated
programs apply: under `jax.jit`, the rewritten function's outputs equal the
original's, and so does the gradient of a non-linear scalar of the outputs
with respect to every floating-point leaf of the arguments (pytrees included),
to `rtol` per element plus `atol` on the tensor's scale (work moved to batch U
may sum in another order). Non-finite values must sit in the same places, with the
same sign where both are infinite; there NaN and an infinity may trade places
(`assert_same_up_to_order`): a user's cotangents are summed before a moved op's
partial multiplies them, where the original multiplies each candidate's, so an
infinite partial gives `inf * (c0 + c1)` for `inf * c0 + inf * c1`, which is NaN
where some `c` is zero or the products' signs differ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ikbo_jax import rewrite as rewrite_lib


def _float_leaves(args):
  leaves, tree = jax.tree.flatten(tuple(args))
  where = [i for i, x in enumerate(leaves) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
  return leaves, tree, where


def outputs_and_gradients(fn, args):
  """`fn(*args)` under `jax.jit`, and the gradient of `sum(sin(outputs))` by each float leaf."""
  leaves, tree, where = _float_leaves(args)

  def loss(floats):
    full = list(leaves)
    for i, x in zip(where, floats):
      full[i] = x
    outs = [o for o in jax.tree.leaves(fn(*jax.tree.unflatten(tree, full)))
            if jnp.issubdtype(o.dtype, jnp.floating)]
    return sum(jnp.sum(jnp.sin(o.astype(jnp.float32))) for o in outs)

  outs = jax.jit(fn)(*args)
  grads = jax.jit(jax.grad(loss))([leaves[i] for i in where]) if where else []
  return outs, grads


def check_rewrite(fn, args, *, mapping, users=(), candidates=None, rtol: float = 1e-5,
                  atol: float = 1e-5) -> rewrite_lib.Report:
  """Asserts that `rewrite(fn)` equals `fn` on `args`; returns the rewrite's report."""
  where = dict(mapping=mapping, users=users, candidates=candidates)
  fast = rewrite_lib.rewrite(fn, **where)
  report = rewrite_lib.explain(fn, *args, **where)
  got_out, got_grads = outputs_and_gradients(fast, args)
  want_out, want_grads = outputs_and_gradients(fn, args)
  pairs = list(zip(jax.tree.leaves(got_out), jax.tree.leaves(want_out)))
  pairs += list(zip(got_grads, want_grads))
  assert jax.tree.structure(got_out) == jax.tree.structure(want_out)
  for k, (got, want) in enumerate(pairs):
    kind = "output" if k < len(pairs) - len(got_grads) else "gradient"
    assert_same_up_to_order(got, want, rtol=rtol, atol=atol, err_msg=f"{kind} {k}\n{report}")
  return report


def assert_same_up_to_order(got, want, *, rtol: float, atol: float, err_msg: str = ""):
  """`got` equals `want` up to the order of sums and products (see the module docstring).

  Finite entries agree to `rtol` plus `atol` on the scale of `want`'s largest finite
  entry; `got` is non-finite exactly where `want` is, and where both are infinite
  they have the same sign.
  """
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if got.shape != want.shape:
    raise AssertionError(f"shape {got.shape}, expected {want.shape}\n{err_msg}")
  finite = np.isfinite(want)
  where_differs = np.flatnonzero(np.isfinite(got) != finite)
  if where_differs.size:
    i = where_differs[0]
    raise AssertionError(f"{where_differs.size} entries finite on one side only, first at flat "
                         f"index {i}: got {got.flat[i]}, expected {want.flat[i]}\n{err_msg}")
  both_inf = np.isinf(got) & np.isinf(want)
  if np.any(np.sign(got[both_inf]) != np.sign(want[both_inf])):
    raise AssertionError(f"infinities of opposite sign\n{err_msg}")
  scale = max(1.0, float(np.abs(want[finite]).max(initial=0.0)))
  np.testing.assert_allclose(got[finite], want[finite], rtol=rtol, atol=atol * scale,
                             err_msg=err_msg)
