"""Parameters cast once, when the served program only ever reads them cast.

A model that keeps float32 parameters and computes in bfloat16 (flax's
`param_dtype` and `dtype`) casts every parameter on every call: at the
benchmark preset that is ~277 MB read and ~138 MB written per call, and the
result never changes between calls. `hoist_casts` traces the served function
and finds each parameter whose every use is one `convert_element_type` (the
same target and options at each use). That cast is done once, here, by the same
primitive, and the program takes the cast value where the cast's result was:
the program's output depends on such a parameter only through the cast, so
this is the same computation. A parameter with any other use (read at its own
precision as well, cast two ways, an output, used inside a nested program) is
left as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
from jax.extend import core as jex_core

_CONVERT = "convert_element_type"


@dataclasses.dataclass(frozen=True)
class Hoisted:
  """A function of (params, *args) with some parameters' casts done ahead of the call.

  Attributes:
    fn: `fn(params, *args)`, where `params` is `prepare`'s list, not the original tree.
    casts: per parameter leaf, the `convert_element_type` options hoisted, or None.
  """

  fn: Callable
  casts: tuple[dict | None, ...]

  def prepare(self, params, cache: dict | None = None) -> list[jax.Array]:
    """The leaves of `params` (the tree `hoist_casts` traced), each cast where hoisted.

    `cache` (a dict kept across calls) shares each cast leaf among programs of one model.
    """
    cache = {} if cache is None else cache
    leaves = []
    for position, (leaf, cast) in enumerate(zip(jax.tree.leaves(params), self.casts)):
      if cast is not None:
        key = (position, tuple(sorted(cast.items())))
        if key not in cache:
          cache[key] = jex_core.primitives.convert_element_type_p.bind(leaf, **cast)
        leaf = cache[key]
      leaves.append(leaf)
    return leaves


def jit_hoisted(fn: Callable, params, *args, cache: dict | None = None,
                donate_argnums: tuple[int, ...] = ()) -> tuple[Callable, list[jax.Array]]:
  """`jax.jit` of `fn(params, *args)` with its parameters' casts hoisted, and the
  parameter leaves the jitted function takes in place of `params` (see `Hoisted.prepare`)."""
  hoisted = hoist_casts(fn, params, *args)
  return (jax.jit(hoisted.fn, donate_argnums=donate_argnums),
          hoisted.prepare(params, cache))


def hoist_casts(fn: Callable, params, *args) -> Hoisted:
  """`fn(params, *args)` with the casts of parameters that are only read cast done once.

  `args` may be arrays or `jax.ShapeDtypeStruct`s (only their shapes are traced).

  >>> import jax.numpy as jnp
  >>> f = lambda p, x: x @ p["w"].astype(jnp.bfloat16) + p["b"]
  >>> params = {"b": jnp.ones(2), "w": jnp.ones((3, 2))}
  >>> hoisted = hoist_casts(f, params, jnp.ones((1, 3), jnp.bfloat16))
  >>> [c is not None for c in hoisted.casts]  # b is read as it is, w only cast
  [False, True]
  >>> [p.dtype.name for p in hoisted.prepare(params)]
  ['float32', 'bfloat16']
  """
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(params, *args)
  jaxpr, count = closed.jaxpr, len(jax.tree.leaves(params))
  uses: dict = {v: [] for v in jaxpr.invars[:count]}
  for eqn in jaxpr.eqns:
    for v in eqn.invars:
      if not isinstance(v, jex_core.Literal) and v in uses:
        uses[v].append(eqn)
  outputs = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
  invars, casts, dropped, renamed = list(jaxpr.invars), [], set(), {}
  for position, v in enumerate(jaxpr.invars[:count]):
    cast = _only_cast(uses[v], v in outputs)
    casts.append(None if cast is None else dict(cast))
    if cast is not None:
      # The first cast's result stands for the parameter: every cast is the same one.
      invars[position] = uses[v][0].outvars[0]
      for eqn in uses[v]:
        dropped.add(id(eqn))
        renamed[eqn.outvars[0]] = invars[position]
  rename = lambda vs: [v if isinstance(v, jex_core.Literal) else renamed.get(v, v) for v in vs]
  eqns = [eqn.replace(invars=rename(eqn.invars)) for eqn in jaxpr.eqns if id(eqn) not in dropped]
  program = jex_core.ClosedJaxpr(
      jaxpr.replace(invars=invars, eqns=eqns, outvars=rename(jaxpr.outvars)), closed.consts)
  run, out_tree = jex_core.jaxpr_as_fun(program), jax.tree.structure(out_shape)

  def hoisted(leaves: Sequence[jax.Array], *call_args):
    return jax.tree.unflatten(out_tree, run(*leaves, *jax.tree.leaves(call_args)))

  return Hoisted(hoisted, tuple(casts))


def _only_cast(uses: list, is_output: bool) -> dict | None:
  """The one cast that is every use of a parameter, or None."""
  if is_output or not uses or any(eqn.primitive.name != _CONVERT for eqn in uses):
    return None
  first = uses[0].params
  return first if all(eqn.params == first for eqn in uses[1:]) else None
