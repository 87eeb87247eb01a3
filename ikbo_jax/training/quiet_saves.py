"""Keeps a failed background save to one line of the run's output.

When orbax's background write fails (a full disk, a file size limit, a directory that
became read-only), it logs the failure from each of its threads and event-loop tasks with
tracebacks, and tensorstore's callbacks then call into event loops orbax already closed,
each printing a "RuntimeError: Event loop is closed" traceback. The training command
reports the failure once, in the line it exits with (`Trainer.seal_finished_save` raises
it), so `quiet()` drops exactly that noise: orbax's (absl) and asyncio's log records, and
tracebacks that end in a closed event loop. Everything else prints as ever.
"""

from __future__ import annotations

import io
import logging
import sys
import threading
import warnings

_CLOSED_LOOP = "RuntimeError: Event loop is closed"


class _ClosedLoopFilter(io.TextIOBase):
  """A text stream that holds each traceback until its last line, and drops closed-loop ones."""

  def __init__(self, stream):
    self._stream, self._held, self._partial = stream, [], ""

  def write(self, text: str) -> int:
    self._partial += text
    *lines, self._partial = self._partial.split("\n")
    for line in lines:
      self._line(line + "\n")
    return len(text)

  def _line(self, line: str) -> None:
    # Threads print tracebacks at once, so their lines interleave: every traceback line is
    # held, and a final line ("Kind: message") ends what is held, dropped with it if it is
    # a closed loop's.
    if line.startswith((" ", "Traceback", "During handling", "The above exception")) or (
        line == "\n"):
      self._held.append(line)
      return
    if line.strip() != _CLOSED_LOOP:
      self._stream.write("".join(self._held) + line)
    self._held = []

  def flush(self) -> None:
    self._stream.write("".join(self._held) + self._partial)
    self._held, self._partial = [], ""
    self._stream.flush()

  def fileno(self) -> int:
    return self._stream.fileno()


def quiet() -> None:
  """Installs the filters for this process (the training command's)."""
  for name in ("absl", "asyncio"):
    logging.getLogger(name).setLevel(logging.CRITICAL)
  # orbax's write coroutines of a failed save, collected at exit, warn that they never ran.
  warnings.filterwarnings("ignore", message="coroutine .* was never awaited",
                          category=RuntimeWarning)
  closed_loop = lambda value: isinstance(value, RuntimeError) and str(value) == (
      "Event loop is closed")
  hook, thread_hook = sys.excepthook, threading.excepthook
  sys.excepthook = lambda kind, value, tb: None if closed_loop(value) else hook(kind, value, tb)
  threading.excepthook = lambda args: (None if closed_loop(args.exc_value)
                                       else thread_hook(args))
  sys.stderr = _ClosedLoopFilter(sys.stderr)
