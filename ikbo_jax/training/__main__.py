"""Trains the reference ranking model on the synthetic stream or on Parquet files.

    python -m ikbo_jax.training --steps 300 --checkpoint-dir /tmp/ranker
    python -m ikbo_jax.training --train-file logs.parquet --eval-file held_out.parquet

With `--checkpoint-dir` it checks first that checkpoints can be written there
(and that the checkpoints it keeps, plus one, fit), saves every
`--save-every-steps` steps and every `--save-every-minutes` minutes in the
background, on SIGTERM/SIGINT (then exits; a signal during the final evaluation
lets it and the last save finish), and at the end; a save that fails (a full or
read-only disk) stops the run with one line naming the cause and the last good
checkpoint, and removes what it left half-written. It resumes from the newest
checkpoint that verifies and says what it resumed. The learning-rate schedule runs over
`--schedule-steps` (default `--steps`): declare the full length to extend a run
in pieces that equal one straight run. A non-finite loss or gradient stops the
run naming the step and the last checkpoint (`--max-skipped-steps` allows some,
not applied). Prints the held-out AUC before and after.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time

from ikbo_jax import __version__, _cli
from ikbo_jax.models.builds import Build
from ikbo_jax.models.config import PRESETS

EVAL_START = 10**9  # synthetic held-out requests: indices no training run reaches


def main(argv=None) -> dict:
  parser = _cli.parser("ikbo_jax.training", __doc__, __version__)
  parser.add_argument("--preset", choices=sorted(PRESETS), default="small",
                      help="model sizes (ikbo_jax.models.PRESETS)")
  parser.add_argument("--steps", type=int, default=300, help="train up to this step")
  parser.add_argument("--schedule-steps", type=int,
                      help="the learning-rate schedule's length (default: --steps)")
  parser.add_argument("--users", type=int, default=16, help="requests (user slots) per step")
  parser.add_argument("--candidates", type=int, default=256, help="candidate slots per step")
  parser.add_argument("--learning-rate", type=float, default=3e-3, help="peak AdamW learning rate")
  parser.add_argument("--build", type=Build.parse, choices=list(Build), default=Build.IKBO,
                      help="which forward pass trains (same parameters)")
  parser.add_argument("--train-file", help="Parquet requests (ikbo_jax.data.files schema)")
  parser.add_argument("--eval-file", help="held-out Parquet requests")
  parser.add_argument("--eval-requests", type=int, default=300,
                      help="held-out requests for the AUC")
  parser.add_argument("--checkpoint-dir", help="save here as the run goes; resume from here")
  # A save of the benchmark preset (831 MB) costs the run ~1.5 s on the H200; every 2000 steps
  # at its measured 57 ms a step that is 1.4% (docs/results.md).
  parser.add_argument("--save-every-steps", type=int, default=2000, help="save interval in steps")
  parser.add_argument("--save-every-minutes", type=float, default=10.0,
                      help="save interval in minutes")
  parser.add_argument("--max-skipped-steps", type=int, default=0,
                      help="non-finite steps skipped (not applied) before the run stops")
  parser.add_argument("--seed", type=int, default=0, help="parameter initialization seed")
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")
  args = parser.parse_args(argv)
  return _train(args, parser)


def _train(args, parser) -> dict:
  # Imported after parsing, so that --help and --version answer before jax loads.
  import jax

  from ikbo_jax.data import files
  from ikbo_jax.data.synthetic import ClickGenerator
  from ikbo_jax.models.checkpoint import CheckpointError
  from ikbo_jax.training import Divergence, TrainConfig, Trainer
  from ikbo_jax.training import quiet_saves
  from ikbo_jax.training.trainer import describe_save
  from ikbo_jax.training.run_guard import SaveInterval, StopSignals, periodic_saver, resume

  quiet_saves.quiet()  # a failed save is reported once, in the line the run exits with
  config = PRESETS[args.preset]()
  if args.train_file and not args.eval_file:
    parser.error("--train-file needs --eval-file (a held-out split)")
  try:  # a data error is the data's: one line naming file, row and field, no traceback
    train_requests = files.read_requests(args.train_file, config) if args.train_file else None
    held_out = (files.read_requests(args.eval_file, config) if args.eval_file else
                ClickGenerator(config, seed=args.seed).requests(args.eval_requests, EVAL_START))
  except files.DataError as e:
    parser.exit(1, f"invalid data: {e}\n")
  if train_requests:
    source = lambda i: train_requests[i % len(train_requests)]
  else:
    source = ClickGenerator(config, seed=args.seed).request

  train_config = TrainConfig(num_users=args.users, num_candidates=args.candidates,
                             learning_rate=args.learning_rate,
                             steps=args.schedule_steps or args.steps, build=args.build,
                             max_skipped_steps=args.max_skipped_steps)
  trainer = Trainer(config, train_config, source, seed=args.seed)
  try:
    if args.checkpoint_dir:
      print(resume(trainer, args.checkpoint_dir))
    before = trainer.evaluate(held_out)
    # Signals stay caught to the end: one that comes during the final evaluation or save
    # lets them finish (the last step is sealed) instead of killing the process.
    with StopSignals() as stop:
      after_step = (periodic_saver(trainer, args.checkpoint_dir, SaveInterval(
          args.save_every_steps, args.save_every_minutes, last_step=trainer.step_count), stop)
                    if args.checkpoint_dir else lambda: stop.requested is not None)
      losses = trainer.fit(max(args.steps - trainer.step_count, 0),
                           progress=not args.no_progress, after_step=after_step)
      if not stop.requested:
        after = trainer.evaluate(held_out)
        trainer.seal_finished_save(wait=True)
        if args.checkpoint_dir and (trainer.last_saved or (-1,))[0] < trainer.step_count:
          trainer.save(args.checkpoint_dir)
    if stop.requested:
      trainer.close()
      parser.exit(0, f"{stop.requested}: stopped at step {trainer.step_count}; saved "
                     f"{describe_save(trainer.last_saved)}\n")
  except (Divergence, CheckpointError, OSError) as e:  # OSError: a disk that failed mid-run
    with contextlib.suppress(CheckpointError, OSError):  # an earlier save may still seal
      trainer.close()
    _exit(parser, 1, f"training stopped at step {trainer.step_count}: {e}; the last good "
                     f"checkpoint is {describe_save(trainer.last_saved)}\n")
  finally:
    trainer.close()
  report = dict(device=jax.devices()[0].device_kind, preset=args.preset, build=args.build,
                steps=trainer.step_count, first_loss=losses[0] if losses else None,
                last_loss=losses[-1] if losses else None, auc_before=before["auc"],
                auc_after=after["auc"], eval_loss=after["loss"])
  print(json.dumps(report, indent=1))
  return report


def _exit(parser, status: int, message: str) -> None:
  """`parser.exit`, unless threads a failed save left behind would hold the process forever.

  When orbax's save fails before its writes start (a directory that became read-only or
  vanished), its signaling threads, which are not daemons, wait for writes that never come,
  and the interpreter would wait for them at exit. They get a moment; then the process
  ends without them, its message written.
  """
  deadline = time.monotonic() + 2.0
  for thread in threading.enumerate():
    if thread is not threading.main_thread() and not thread.daemon:
      with contextlib.suppress(Exception):  # orbax's threads re-raise their failure on join
        thread.join(max(0.0, deadline - time.monotonic()))
  if any(t.is_alive() and not t.daemon and t is not threading.main_thread()
         for t in threading.enumerate()):
    sys.stderr.write(message)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
  parser.exit(status, message)


if __name__ == "__main__":
  main()
