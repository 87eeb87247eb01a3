"""Naming the mapping, the user inputs and the candidate inputs anywhere in a function's arguments.

A selector is one of:

* an `int`: a whole positional argument (every array in its pytree);
* a `str`: a path of parameter name (or position) and pytree keys joined by
  dots, as `jax.tree_util.keystr(..., simple=True, separator=".")` writes
  them: `"cand_to_user"`, `"batch.cand_to_user"`, `"batch.history"`,
  `"1.user_dense"`, `"state.embed.embedding.value"`. A path selects the leaf
  it names and every leaf under it;
* a callable `(path: str, leaf) -> bool`, for anything else (`lambda path, x:
  path.endswith("_user")`).

`users` and `candidates` take one selector or a sequence of them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

from ikbo_jax.rewrite import arguments

Selector = int | str | Callable


def leaf_paths(fn: Callable, args: tuple) -> tuple[list, list[tuple[str, ...]]]:
  """Deprecated: `arguments.bind(arguments.signature_of(fn), args, {})`'s `leaves` and
  `paths` (the arrays the rewrite traces, and their paths by parameter position and name)."""
  warnings.warn("rewrite.selectors.leaf_paths is deprecated; use "
                "rewrite.arguments.bind(signature_of(fn), args, kwargs), which takes keyword "
                "arguments too",
                DeprecationWarning, stacklevel=2)
  call = arguments.bind(arguments.signature_of(fn), tuple(args), {})
  return call.leaves, call.paths


def matches(selector: Selector, paths: tuple[str, ...], leaf) -> bool:
  if isinstance(selector, bool):
    raise TypeError(f"a selector must be an int, a str or a callable, got {selector!r}")
  if isinstance(selector, int):
    return paths[0].split(".")[0] == str(selector)
  if isinstance(selector, str):
    return any(p == selector or p.startswith(selector + ".") for p in paths)
  if callable(selector):
    return bool(selector(paths[-1], leaf))
  raise TypeError(f"a selector must be an int, a str or a callable, got {selector!r}")


def as_selectors(name: str, value) -> tuple:
  """`value` as a tuple of selectors, checked."""
  selectors = (value,) if isinstance(value, (int, str)) or callable(value) else tuple(value)
  for s in selectors:
    if isinstance(s, bool) or not (isinstance(s, (int, str)) or callable(s)):
      raise TypeError(f"{name} must be selectors (int, str or callable), got {s!r}")
  return selectors


def select(selectors: Sequence[Selector], paths, leaves) -> list[bool]:
  return [any(matches(s, p, x) for s in selectors) for p, x in zip(paths, leaves)]


def describe(paths: Sequence[tuple[str, ...]]) -> str:
  return ", ".join(repr(p[-1]) for p in paths) or "none"
