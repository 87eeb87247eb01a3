"""Trains the reference ranking model on the synthetic stream or on Parquet files.

    python -m ikbo_jax.training --steps 300 --checkpoint-dir /tmp/ranker
    python -m ikbo_jax.training --train-file logs.parquet --eval-file held_out.parquet

Resumes from `--checkpoint-dir` when it holds a checkpoint. Prints the
held-out AUC before and after, and the step time.
"""

from __future__ import annotations

import json

from ikbo_jax import __version__, _cli
from ikbo_jax.models.builds import Build
from ikbo_jax.models.config import PRESETS

EVAL_START = 10**9  # synthetic held-out requests: indices no training run reaches


def main(argv=None) -> dict:
  parser = _cli.parser("ikbo_jax.training", __doc__, __version__)
  parser.add_argument("--preset", choices=sorted(PRESETS), default="small",
                      help="model sizes (ikbo_jax.models.PRESETS)")
  parser.add_argument("--steps", type=int, default=300,
                      help="training steps (the schedule decays over them)")
  parser.add_argument("--users", type=int, default=16, help="requests (user slots) per step")
  parser.add_argument("--candidates", type=int, default=256, help="candidate slots per step")
  parser.add_argument("--learning-rate", type=float, default=3e-3, help="peak AdamW learning rate")
  parser.add_argument("--build", type=Build.parse, choices=list(Build), default=Build.IKBO,
                      help="which forward pass trains (same parameters)")
  parser.add_argument("--train-file", help="Parquet requests (ikbo_jax.data.files schema)")
  parser.add_argument("--eval-file", help="held-out Parquet requests")
  parser.add_argument("--eval-requests", type=int, default=300,
                      help="held-out requests for the AUC")
  parser.add_argument("--checkpoint-dir", help="save at the end; resume from here if present")
  parser.add_argument("--seed", type=int, default=0, help="parameter initialization seed")
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")
  args = parser.parse_args(argv)
  return _train(args, parser)


def _train(args, parser) -> dict:
  # Imported after parsing, so that --help and --version answer before jax loads.
  import jax

  from ikbo_jax.data import files
  from ikbo_jax.data.synthetic import ClickGenerator
  from ikbo_jax.training import TrainConfig, Trainer

  config = PRESETS[args.preset]()
  if args.train_file:
    train_requests = files.read_requests(args.train_file, config)
    source = lambda i: train_requests[i % len(train_requests)]
  else:
    source = ClickGenerator(config, seed=args.seed).request
  if args.eval_file:
    held_out = files.read_requests(args.eval_file, config)
  elif args.train_file:
    parser.error("--train-file needs --eval-file (a held-out split)")
  else:
    held_out = ClickGenerator(config, seed=args.seed).requests(args.eval_requests, EVAL_START)

  trainer = Trainer(config, TrainConfig(num_users=args.users, num_candidates=args.candidates,
                                        learning_rate=args.learning_rate, steps=args.steps,
                                        build=args.build), source, seed=args.seed)
  if args.checkpoint_dir:
    try:
      print(f"resumed from step {trainer.restore(args.checkpoint_dir)}")
    except FileNotFoundError:
      pass
  before = trainer.evaluate(held_out)
  losses = trainer.fit(max(args.steps - trainer.step_count, 0), progress=not args.no_progress)
  after = trainer.evaluate(held_out)
  if args.checkpoint_dir:
    trainer.save(args.checkpoint_dir)
  report = dict(device=jax.devices()[0].device_kind, preset=args.preset, build=args.build,
                steps=trainer.step_count, first_loss=losses[0] if losses else None,
                last_loss=losses[-1] if losses else None, auc_before=before["auc"],
                auc_after=after["auc"], eval_loss=after["loss"])
  print(json.dumps(report, indent=1))
  return report


if __name__ == "__main__":
  main()
