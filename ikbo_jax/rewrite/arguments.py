"""A call's arguments as the rewrite sees them: bound to the function's signature, split into the
arrays it traces and the constants it does not, each array named by its paths.

The rewritten function is called as the original is: positional or keyword arguments,
defaults filled in. It traces what `jax.jit` traces, JAX and NumPy arrays (tracers of an
outer transformation included), and holds everything else as a constant of the trace:
Python numbers and flags (`training=True`), strings, configuration objects. A Python value
is known when the call is made, so a trace specialized to it computes what the original
computes for it; under `jax.jit(rewrite(fn), static_argnames=...)` the values `jax.jit`
keeps static arrive as such, and the others arrive as tracers and are traced. `static_argnums`
and `static_argnames` hold an argument constant whatever it is (an array read by Python
control flow, say), as `jax.jit`'s do.

Flax NNX objects among the arguments (modules, optimizers) are traced as their variables,
and what the call writes to them (BatchNorm's running statistics, an RNG stream's count)
is written back to the caller's objects afterwards, as `nnx.jit` does: otherwise every
step of a training loop would reuse one dropout mask and never update its statistics.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Collection, Sequence

import jax
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class BoundCall:
  """One call's arguments: the traced arrays, their paths, and how to rebuild the call.

  Attributes:
    leaves: the arrays the rewrite traces, in the order of the arguments' pytrees.
    paths: per array, its paths by parameter position and by name (`selectors`).
  """

  leaves: list
  paths: list[tuple[str, ...]]
  _arguments: tuple  # (args, kwargs) as bound
  _treedef: jax.tree_util.PyTreeDef
  _all_leaves: list
  _traced: list[bool]
  _python_states: list = dataclasses.field(default_factory=list)  # set by `call`

  def call(self, fn: Callable, leaves: Sequence) -> tuple:
    """`fn` called with these arguments, `leaves` in place of the traced arrays (tracers,
    when tracing): its result, and the arrays of each NNX object among the arguments after
    the call. Their other values (a Python count, say) are kept aside; `update` writes
    both back."""
    replaced, traced = [], iter(leaves)
    for leaf, is_traced in zip(self._all_leaves, self._traced):
      replaced.append(next(traced) if is_traced else leaf)
    args, kwargs = jax.tree.unflatten(self._treedef, replaced)
    out = fn(*args, **kwargs)
    objects = _nnx_objects((args, kwargs))
    self._python_states[:] = [nnx.state(o, lambda _, v: not _holds_array(v)) for o in objects]
    return out, [nnx.state(o, lambda _, v: _holds_array(v)) for o in objects]

  def update(self, states: Sequence) -> None:
    """Writes `states` (`call`'s, evaluated) and the values kept aside into the caller's
    NNX objects."""
    for obj, arrays, values in zip(_nnx_objects(self._arguments), states,
                                   self._python_states, strict=True):
      nnx.update(obj, arrays)
      nnx.update(obj, values)


def _nnx_objects(tree) -> list:
  """The NNX objects (modules, optimizers) in `tree`, outermost ones, in pytree order."""
  is_nnx = lambda x: isinstance(x, nnx.Pytree)
  return [x for x in jax.tree.leaves(tree, is_leaf=is_nnx) if is_nnx(x)]


def _holds_array(variable: nnx.Variable) -> bool:
  return isinstance(variable.get_value(), jax.Array)


def signature_of(fn: Callable) -> inspect.Signature | None:
  """`fn`'s signature, or None for a callable without one (its arguments are taken as given)."""
  try:
    return inspect.signature(fn)
  except (TypeError, ValueError):
    return None


def bind(signature: inspect.Signature | None, args: tuple, kwargs: dict,
         static_argnums: Collection[int] = (), static_argnames: Collection[str] = ()
         ) -> BoundCall:
  """A call's arguments, bound to the function's `signature` (`signature_of`; a `TypeError`
  as Python's if they do not fit it), defaults included."""
  positional_names: list[str] = []
  if signature is not None:
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    args, kwargs = bound.args, bound.kwargs
    positional_names = [p.name for p in signature.parameters.values()
                        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  flat, treedef = jax.tree_util.tree_flatten_with_path((tuple(args), dict(kwargs)))
  leaves, paths, all_leaves, traced = [], [], [], []
  for keys, leaf in flat:
    heads = _heads(keys[0].idx, keys[1], positional_names)
    is_static = (keys[0].idx == 0 and keys[1].idx in static_argnums
                 or any(h in static_argnames for h in heads))
    is_traced = not is_static and isinstance(leaf, (jax.Array, np.ndarray, np.generic))
    all_leaves.append(leaf)
    traced.append(is_traced)
    if is_traced:
      rest = jax.tree_util.keystr(keys[2:], simple=True, separator=".")
      paths.append(tuple(f"{h}.{rest}" if rest else h for h in heads))
      leaves.append(leaf)
  return BoundCall(leaves, paths, (tuple(args), dict(kwargs)), treedef, all_leaves, traced)


def _heads(part: int, key, positional_names: list[str]) -> list[str]:
  """An argument's names: its position and parameter name (positional), or its name."""
  if part == 1:  # a keyword argument
    return [key.key]
  position = key.idx
  return [str(position)] + ([positional_names[position]]
                            if position < len(positional_names) else [])
