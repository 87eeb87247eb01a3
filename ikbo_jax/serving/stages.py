"""Where a request's time goes: a clock of named stages, and their profile over many requests.

A `StageClock` rides along with one request and collects marks: a stage's
name and the `time.perf_counter()` at which it ended, so a stage's duration is
its mark less the one before. `perf_counter` is the host's monotonic clock,
one for every process of a host on Linux: marks that the model process takes
line up with the HTTP process's, and the hop between them is a stage too.

The stages of `POST /score`, in order (a path leaves out those it lacks):

    head      the request's first bytes are read -> its handler starts (the head's parse,
              the event loop's backlog; under `serving.protocol`'s uvicorn protocol only)
    body      -> the body is in
    decode    -> decoded and validated into a `Request`
    send      -> the model process has read it (several HTTP processes only)
    validate  -> the batcher has checked it against the model and queued it
    queue     -> its batch leaves the batcher's queue for a model thread
    thread    -> a model thread has started the batch
    pack      -> the batch is packed into its host buffer
    h2d       -> the buffer is on the device          (`waited` profiles only)
    launch    -> the program is enqueued              (the others: h2d is inside it)
    execute   -> the program is done                  (`waited` profiles only)
    d2h       -> the scores are on the host
    model     -> (a model with no stages of its own: the whole call)
    answer    -> the request's coroutine has its scores (the hop back to the event loop)
    reply     -> the HTTP process has them (several HTTP processes only)
    encode    -> the response is built
    outside   what a client measures beyond the stages above: the write, the kernel's
              queues and the client's own loop

A server started with `--server-timing` sends each request's stages back in a
standard `Server-Timing` header (`stage;dur=<ms>`), so a client sees the
server's side of every answer whatever the processes behind the port.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

# An ASGI scope's key for when its request's first bytes were read (`time.perf_counter()`,
# set by `serving.protocol`): where the `head` stage begins, and the request's deadline.
ARRIVED = "ikbo.arrived"
STAGES = ("head", "body", "decode", "send", "validate", "queue", "thread", "pack", "h2d", "launch",
          "execute", "d2h", "model", "answer", "reply", "encode", "outside")


class StageClock:
  """One request's marks; `start` is when its first stage began (now by default)."""

  __slots__ = ("marks",)

  def __init__(self, start: float | None = None):
    self.marks: list[tuple[str, float]] = [("", time.perf_counter() if start is None
                                            else start)]

  def mark(self, stage: str, at: float | None = None) -> None:
    """`stage` ended at `at` (now by default)."""
    self.marks.append((stage, time.perf_counter() if at is None else at))

  def extend(self, marks: Iterable[tuple[str, float]]) -> None:
    """Marks taken elsewhere (a batch's, the model process's), in order after these."""
    self.marks.extend(marks)

  def durations_ms(self) -> dict[str, float]:
    """Each stage's milliseconds (a stage marked twice adds up)."""
    out: dict[str, float] = {}
    for (_, before), (stage, at) in zip(self.marks, self.marks[1:]):
      out[stage] = out.get(stage, 0.0) + 1e3 * (at - before)
    return out

  def server_timing(self) -> str:
    """The `Server-Timing` header's value: `stage;dur=<ms>`, in order."""
    return ", ".join(f"{stage};dur={ms:.3f}" for stage, ms in self.durations_ms().items())


def marker(marks: list[tuple[str, float]] | None) -> Callable[[str], None]:
  """`mark(stage)`: appends (stage, now) to `marks`, or does nothing where `marks` is None
  (a call that nobody profiles)."""
  if marks is None:
    return lambda stage: None
  return lambda stage: marks.append((stage, time.perf_counter()))


def answer_row(server_timing: str, client_ms: float) -> dict[str, float]:
  """One answer's stages from its `Server-Timing` header, and `outside`: what the client
  measured (`client_ms`) beyond their sum."""
  row = parse_server_timing(server_timing)
  row["outside"] = client_ms - sum(row.values())
  return row


def parse_server_timing(value: str) -> dict[str, float]:
  """A `Server-Timing` header's `name;dur=<ms>` metrics (others and malformed ones skipped)."""
  out = {}
  for metric in value.split(","):
    name, *params = (part.strip() for part in metric.split(";"))
    for param in params:
      key, _, number = param.partition("=")
      if key.strip() == "dur":
        try:
          out[name] = float(number)
        except ValueError:
          pass
  return out


def summarize(rows: Sequence[dict[str, float]], percentiles: Sequence[float] = (50, 99)
              ) -> dict[str, dict[str, float]]:
  """Per stage (in `STAGES` order, then any other), its mean and percentiles in ms over `rows`.

  A stage missing from a row counts as 0 ms there (a lone request waits in no queue),
  so the means add up to the mean total.
  """
  names = [s for s in STAGES if any(s in r for r in rows)]
  names += sorted({s for r in rows for s in r} - set(names))
  out = {}
  for name in [*names, "total"]:
    values = np.array([sum(r.values()) if name == "total" else r.get(name, 0.0)
                       for r in rows])
    if not values.size:
      continue
    out[name] = {"mean": float(values.mean()),
                 **{f"p{p:g}": float(np.percentile(values, p)) for p in percentiles}}
  return out
