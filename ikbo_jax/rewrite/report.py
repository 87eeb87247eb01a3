"""`Report`: what a rewrite changed, where in the user's code, and what it saved."""

from __future__ import annotations

import dataclasses

from jax._src import source_info_util


@dataclasses.dataclass(frozen=True)
class Change:
  """One decision of the rewrite.

  `kind` is one of: "broadcast" (a gather by the mapping, kept lazy; its copy's
  bytes count as saved),
  "at_users" (an op run at batch U instead of B), "linear_compression",
  "split_dense" (a dense layer on a concat, user half at U), "target_attention",
  "materialized" (a broadcast made real because a consumer needs it; its bytes
  count against).
  """

  kind: str
  primitive: str
  where: str
  bytes_saved: int = 0
  flops_saved: int = 0


@dataclasses.dataclass
class Report:
  changes: list[Change] = dataclasses.field(default_factory=list)

  def add(self, kind: str, eqn, *, bytes_saved: int = 0, flops_saved: int = 0) -> None:
    where = source_info_util.summarize(eqn.source_info) if eqn is not None else "?"
    name = eqn.primitive.name if eqn is not None else "-"
    self.changes.append(Change(kind, name, where, int(bytes_saved), int(flops_saved)))

  def count(self, kind: str) -> int:
    return sum(c.kind == kind for c in self.changes)

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
    for c in self.changes:
      if c.kind != "at_users":  # one line per op moved would drown the rest
        saved = f" ({c.bytes_saved / 1e6:.2f} MB)" if c.bytes_saved else ""
        lines.append(f"  {c.kind:18s} {c.primitive:14s} {c.where}{saved}")
    return "\n".join(lines)
