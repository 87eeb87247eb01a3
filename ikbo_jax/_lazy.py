"""Lazy package exports (PEP 562): `import ikbo_jax.x` costs nothing until a name is used.

The command lines (`python -m ikbo_jax.serving --help`, ...) import their
package's `__init__` first; with eager exports that imports jax, flax and the
kernels before the arguments are even parsed. A package lists its exports as
`name -> module`, and the module is imported on first access. Each package
also imports them under `typing.TYPE_CHECKING`, so type checkers and the
architecture test see the real edges.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def exports(package: str, names: dict[str, str]) -> tuple[Callable, Callable]:
  """`(__getattr__, __dir__)` for `package`, which exports `name` from module `names[name]`."""

  def __getattr__(name: str):
    if name not in names:
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr(importlib.import_module(names[name]), name)

  def __dir__() -> list[str]:
    return sorted(names)

  return __getattr__, __dir__
