"""What checkpointing as it goes costs a training run: the checkpoint part of `ranking_system`.

A training run (the IKBO build, the synthetic stream) alternates rounds of
`steps` steps without saving and rounds that save every `every` steps in the
background (`run_guard.periodic_saver`, what `python -m ikbo_jax.training`
does), wall clock end to end. The saves fall in the middle of a round, and a
save still writing when its round ends is waited for on the round's clock, so
a round pays all of its saves. The overhead is the saving rounds' time over
the plain rounds', minus one; with it, the cost of one save, from which the
overhead at any longer interval follows (the default rounds are short: at the
benchmark preset a step takes ~57 ms on the H200, host-bound).
"""

from __future__ import annotations

import tempfile
import time

import numpy as np

from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.training import TrainConfig, Trainer
from ikbo_jax.training.run_guard import SaveInterval, StopSignals, periodic_saver


class _CountedInterval(SaveInterval):
  """A `SaveInterval` that counts the saves it was told of."""

  saves = 0

  def saved(self, step: int) -> None:
    self.saves += 1
    super().saved(step)


def _timed_round(trainer: Trainer, steps: int, directory: str | None, every: int) -> dict:
  after_step = interval = None
  if directory is not None:
    # The first save falls half an interval in, so the last one has time to overlap.
    interval = _CountedInterval(every, 1e9, last_step=trainer.step_count - every // 2)
    after_step = periodic_saver(trainer, directory, interval, StopSignals())
  start = time.perf_counter()
  trainer.fit(steps, progress=False, after_step=after_step)
  ran = time.perf_counter() - start
  trainer.seal_finished_save(wait=True)
  seconds = time.perf_counter() - start
  return dict(seconds=seconds, tail_seconds=seconds - ran,
              saves=interval.saves if interval else 0)


def checkpoint_cost(config, num_candidates: int, ratio: int, *, small: bool = False,
                    rounds: int = 2, intervals: tuple[int, ...] = (100,)) -> dict:
  """Per-step time with and without saves every N steps (N in `intervals`), `rounds` each.

  With `small` (CPU, tests), two rounds saving every 10 steps.
  """
  if small:
    rounds, intervals = 2, (10,)
  users = max(1, round(num_candidates / ratio))
  source = ClickGenerator(config, seed=0, mean_candidates=min(ratio, num_candidates / users),
                          max_candidates=num_candidates).request
  trainer = Trainer(config, TrainConfig(num_users=users, num_candidates=num_candidates,
                                        steps=10**7), source)
  out = dict(num_candidates=num_candidates, num_users=users, build="ikbo",
             checkpoint_bytes=trainer.state_bytes(), intervals={})
  with tempfile.TemporaryDirectory() as directory:
    trainer.fit(5, progress=False)  # compiles
    start = time.perf_counter()
    trainer.save(directory)  # the first save sets orbax up: off the rounds' clock
    out["first_save_seconds"] = time.perf_counter() - start
    for every in intervals:
      steps = 4 * every
      plain, saving = [], []
      for _ in range(rounds):
        plain.append(_timed_round(trainer, steps, None, every))
        saving.append(_timed_round(trainer, steps, directory, every))
      plain_s = float(np.median([r["seconds"] for r in plain]))
      saving_s = float(np.median([r["seconds"] for r in saving]))
      row = dict(steps_per_round=steps, plain_ms_per_step=1e3 * plain_s / steps,
                 saving_ms_per_step=1e3 * saving_s / steps,
                 saves_per_round=saving[0]["saves"],
                 tail_seconds=[r["tail_seconds"] for r in saving],
                 overhead=saving_s / plain_s - 1,
                 plain_rounds_s=[r["seconds"] for r in plain],
                 saving_rounds_s=[r["seconds"] for r in saving])
      row["ms_per_save"] = 1e3 * (saving_s - plain_s) / max(row["saves_per_round"], 1)
      out["intervals"][str(every)] = row
      print(f"checkpoint every {every} steps: {row['plain_ms_per_step']:.2f} -> "
            f"{row['saving_ms_per_step']:.2f} ms a step ({100 * row['overhead']:+.1f}%), "
            f"{row['ms_per_save']:.0f} ms a save of {out['checkpoint_bytes'] / 1e6:.0f} MB",
            flush=True)
  trainer.close()
  return out
