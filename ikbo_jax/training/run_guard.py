"""What keeps a long training run from losing work: preflight, a save interval, stop signals.

`preflight` checks, before step one, that checkpoints can be written where they
are asked for and that the checkpoints a directory keeps, and one more being
written, fit on the disk (a full disk found after the last step lost whole runs). `SaveInterval` says when a step is due for a save (every
`steps` steps and every `minutes` minutes, whichever comes first).
`StopSignals` turns SIGTERM and SIGINT into a request the loop sees at its next
step, so the run saves and exits instead of dying mid-step. `resume` and
`periodic_saver` put them together for a `Trainer` (the command line uses them).
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import signal
import time

from ikbo_jax.models.checkpoint import KEPT, CheckpointError
from ikbo_jax.training.trainer import Trainer


def preflight(directory, bytes_per_checkpoint: int) -> None:
  """Raises `CheckpointError` unless `directory` is writable with room for its checkpoints.

  The room is for the `KEPT` checkpoints a directory keeps and one more in flight: the
  oldest is removed only after the newest is written.
  """
  path = pathlib.Path(directory)
  if path.exists() and not path.is_dir():
    raise CheckpointError(f"the checkpoint directory {path} is a file")
  try:
    path.mkdir(parents=True, exist_ok=True)
    probe = path / ".ikbo_write_probe"
    probe.write_bytes(b"\0" * 4096)
    probe.unlink()
  except OSError as e:
    raise CheckpointError(f"cannot write checkpoints under {path}: {e}") from None
  free, needed = shutil.disk_usage(path).free, (KEPT + 1) * bytes_per_checkpoint
  if free < needed:
    raise CheckpointError(f"{path}: {free:,} bytes free; {KEPT} checkpoints kept and one "
                          f"being written need {needed:,}")


@dataclasses.dataclass
class SaveInterval:
  """Due every `steps` steps and every `minutes` minutes since the last save."""

  steps: int
  minutes: float
  last_step: int = 0
  last_time: float = dataclasses.field(default_factory=time.monotonic)

  def __post_init__(self):
    if not (self.steps >= 1 and self.minutes > 0):
      raise ValueError(f"a save interval needs steps >= 1 and minutes > 0, got {self.steps} "
                       f"and {self.minutes}")

  def due(self, step: int) -> bool:
    return (step - self.last_step >= self.steps
            or time.monotonic() - self.last_time >= 60 * self.minutes)

  def saved(self, step: int) -> None:
    self.last_step, self.last_time = step, time.monotonic()


class StopSignals:
  """While entered, SIGTERM and SIGINT set `requested` instead of killing the process."""

  def __init__(self):
    self.requested: str | None = None
    self._previous = {}

  def __enter__(self) -> StopSignals:
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def _handle(self, signum, frame) -> None:
    self.requested = signal.Signals(signum).name


def resume(trainer: Trainer, directory) -> str:
  """Checks `directory` (`preflight`), restores its newest checkpoint that verifies; says what."""
  preflight(directory, trainer.state_bytes())
  try:
    step = trainer.restore(directory)
  except FileNotFoundError:
    return f"no checkpoint under {directory}: starting at step 0"
  return (f"resumed from step {step} (request cursor {trainer.cursor}) under {directory}; the "
          f"schedule runs over {trainer.train_config.steps} steps")


def periodic_saver(trainer: Trainer, directory, interval: SaveInterval, stop: StopSignals):
  """A `Trainer.fit` `after_step`: seals finished saves, saves when due, stops on a signal.

  Saves run in the background, except the one a signal asks for (then the run exits).
  """

  def after_step() -> bool:
    trainer.seal_finished_save()
    if stop.requested or interval.due(trainer.step_count):
      trainer.save(directory, wait=stop.requested is not None)
      interval.saved(trainer.step_count)
    return stop.requested is not None

  return after_step
