"""Taking lazy values into a nested function and back out of it.

A custom derivative rule, a `checkpoint` body or a `cond` branch is a function
of arrays that JAX traces on its own tracers. To rewrite inside it, the lazy
operands go in as their arrays (`split`: the leaves of their pytrees, each
array once, so that two broadcasts by one index still share it inside) and
are rebuilt there; the lazy results come out as arrays and a `Structure` that
rebuilds them outside (`export`, `Structure.rebuild`). Integer leaves that a
result shares with the operands (the index of a broadcast) are not returned
but taken from the operands, so the index keeps its identity outside.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray)) and np.ndim(x) >= 0 and not isinstance(
      x, np.generic)


def split(values: Sequence) -> tuple[list, callable]:
  """The distinct arrays of `values` and a function that rebuilds them from new arrays."""
  leaves, treedef = jax.tree.flatten(list(values))
  arrays, slots, seen = [], [], {}
  for leaf in leaves:
    if not _is_array(leaf):  # Python scalars (literals) stay static
      slots.append(("static", leaf))
      continue
    if id(leaf) not in seen:
      seen[id(leaf)] = len(arrays)
      arrays.append(leaf)
    slots.append(("array", seen[id(leaf)]))

  def rebuild(new_arrays):
    return jax.tree.unflatten(treedef, [new_arrays[i] if kind == "array" else i
                                        for kind, i in slots])

  return arrays, rebuild


@dataclasses.dataclass(frozen=True)
class Structure:
  """How a nested function's lazy results are rebuilt from its array results."""

  treedef: object
  slots: tuple  # per leaf: ("out", k), ("in", operand slot) or ("static", value)
  avals: tuple  # (shape, dtype) of each array result

  def rebuild(self, operands: Sequence, results: Sequence) -> list:
    leaves = []
    for kind, i in self.slots:
      leaves.append(results[i] if kind == "out" else operands[i] if kind == "in" else i)
    return jax.tree.unflatten(self.treedef, leaves)


def export(values: Sequence, operands: Sequence, *, materialize=None) -> tuple[list, Structure]:
  """The arrays to return for `values` and the `Structure` that rebuilds them outside.

  Integer leaves that are operands are taken from the operands outside; with
  `materialize`, each value is first made an ordinary array by it.
  """
  if materialize is not None:
    values = [materialize(v) for v in values]
  leaves, treedef = jax.tree.flatten(list(values))
  position = {id(x): i for i, x in enumerate(operands)}
  results, slots = [], []
  for leaf in leaves:
    if not _is_array(leaf):
      slots.append(("static", leaf))
    elif id(leaf) in position and not jnp.issubdtype(leaf.dtype, jnp.inexact):
      slots.append(("in", position[id(leaf)]))
    else:
      slots.append(("out", len(results)))
      results.append(leaf)
  avals = tuple((tuple(np.shape(r)), jnp.dtype(r.dtype)) for r in results)
  return results, Structure(treedef, tuple(slots), avals)
