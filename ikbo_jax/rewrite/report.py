"""`Report`: what a rewrite changed, where in the user's code, what it saved, and what it could not."""

from __future__ import annotations

import dataclasses

from jax._src import source_info_util


class Decline(Exception):
  """A rule's reason for leaving an equation as written (recorded with the materialization)."""


FORWARD_MODE = ("forward-mode autodiff is tracing it and IKBO ops have reverse-mode derivatives "
                "only: it runs as written")


@dataclasses.dataclass(frozen=True)
class Change:
  """One decision of the rewrite.

  `kind` is one of: "broadcast" (a gather of user rows, kept lazy; its copy's
  bytes count as saved), "at_users" (an op run at batch U instead of B),
  "linear_compression", "two_level_linear_compression" (user and group parts
  of a nested gather, each at its own batch), "split_dense" (a dense layer on
  a concat, each broadcast level's part at its own batch), "block_product" (a product of two concats, user-user block at U),
  "target_attention", "entered" (a custom derivative rule, `checkpoint` or
  `cond` rewritten inside with its semantics kept), "materialized" (a
  broadcast made real because a consumer needs it; its bytes count against,
  and `reason` says which rule declined and why).
  """

  kind: str
  primitive: str
  where: str
  bytes_saved: int = 0
  flops_saved: int = 0
  reason: str = ""


@dataclasses.dataclass
class Report:
  changes: list[Change] = dataclasses.field(default_factory=list)
  # Where the library functions being evaluated were called from (their own equations
  # have no source line of the user's).
  context: list[str] = dataclasses.field(default_factory=list, repr=False)

  def add(self, kind: str, eqn, *, bytes_saved: int = 0, flops_saved: int = 0,
          reason: str = "") -> None:
    where = source_info_util.summarize(eqn.source_info) if eqn is not None else ""
    where = where or next((w for w in reversed(self.context) if w), "?")
    name = eqn.primitive.name if eqn is not None else "-"
    self.changes.append(Change(kind, name, where, int(bytes_saved), int(flops_saved), reason))

  def count(self, kind: str) -> int:
    return sum(c.kind == kind for c in self.changes)

  @property
  def materialized(self) -> list[Change]:
    """Every broadcast made real, with the primitive that needed it and why no rule applied."""
    return [c for c in self.changes if c.kind == "materialized"]

  @property
  def bytes_saved(self) -> int:
    return sum(c.bytes_saved for c in self.changes)

  @property
  def flops_saved(self) -> int:
    return sum(c.flops_saved for c in self.changes)

  def __str__(self) -> str:
    kinds = sorted({c.kind for c in self.changes})
    lines = [f"IKBO rewrite: {', '.join(f'{self.count(k)} {k}' for k in kinds) or 'no changes'}; "
             f"{self.bytes_saved / 1e6:.2f} MB of copies and {self.flops_saved / 1e6:.2f} "
             "MFLOP avoided"]
    moved: dict[tuple[str, str], list[Change]] = {}
    for c in self.changes:
      if c.kind == "at_users":  # grouped by source line, so elementwise chains take one line each
        moved.setdefault((c.where, c.primitive), []).append(c)
        continue
      saved = f" ({c.bytes_saved / 1e6:.2f} MB)" if c.bytes_saved else ""
      why = f": {c.reason}" if c.reason else ""
      lines.append(f"  {c.kind:18s} {c.primitive:14s} {c.where}{saved}{why}")
    for (where, primitive), group in moved.items():
      times = f" x{len(group)}" if len(group) > 1 else ""
      flops = sum(c.flops_saved for c in group)
      saved = f" ({flops / 1e6:.2f} MFLOP)" if flops else ""
      lines.append(f"  {'at_users':18s} {primitive + times:14s} {where}{saved}")
    return "\n".join(lines)
