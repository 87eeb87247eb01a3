"""`Build`: which forward pass of a `Ranker` runs, as one type (no jax import: CLIs parse it)."""

from __future__ import annotations

import enum


class Build(enum.StrEnum):
  """Which forward pass of a `Ranker` runs (the parameters are the same).

  `IKBO` passes the mapping to the IKBO layers (user side at batch U);
  `STANDARD` copies the user inputs to the candidate batch first. A `StrEnum`,
  so `Build("ikbo")` parses a command line and a build prints as its name.
  """

  IKBO = "ikbo"
  STANDARD = "standard"

  @classmethod
  def parse(cls, value: str | Build) -> Build:
    """`value` as a `Build`, or a ValueError naming the choices."""
    try:
      return cls(value)
    except ValueError:
      raise ValueError(f"build must be one of {[b.value for b in cls]}, got {value!r}") from None
