"""The whole system in one command: train the reference ranker briefly, then serve a request stream.

    python -m ikbo_jax                 # small model on a CPU (under two minutes)
    python -m ikbo_jax --preset benchmark --steps 50   # the benchmark shape, on a GPU

Trains `ikbo_jax.models.Ranker` on the synthetic click stream (progress bar,
held-out AUC before and after), checks that its IKBO and standard builds give
the same scores, then sends one Poisson request stream through the batcher
and the compiled shape buckets of each build and prints their latency
percentiles and throughput side by side.
"""

from __future__ import annotations

import json

from ikbo_jax import __version__, _cli
from ikbo_jax.models.config import PRESETS

EVAL_START, LOAD_START = 10**9, 2 * 10**9  # disjoint from the training requests


def main(argv=None) -> dict:
  parser = _cli.parser("ikbo_jax", __doc__, __version__)
  parser.add_argument("--preset", choices=sorted(PRESETS), default="small",
                      help="model sizes (ikbo_jax.models.PRESETS)")
  parser.add_argument("--steps", type=int, default=150, help="training steps")
  parser.add_argument("--qps", type=float, default=100.0,
                      help="request rate of the serving comparison")
  parser.add_argument("--requests", type=int, default=300, help="requests sent to each build")
  parser.add_argument("--mean-candidates", type=float,
                      help="candidates per request, the user:candidate ratio (default: 70 on "
                           "a GPU, 8 elsewhere)")
  parser.add_argument("--users", type=int, default=16, help="requests per training step")
  parser.add_argument("--out", help="write the report as JSON")
  return _run(parser.parse_args(argv))


def _run(args) -> dict:
  # Imported after parsing, so that --help and --version answer before jax loads.
  import jax
  import numpy as np
  from flax import nnx

  from ikbo_jax.data import pack_requests
  from ikbo_jax.data.synthetic import ClickGenerator
  from ikbo_jax.models import Build
  from ikbo_jax.serving.load import compare_builds, format_row
  from ikbo_jax.training import TrainConfig, Trainer

  if args.mean_candidates is None:
    args.mean_candidates = 70.0 if jax.default_backend() == "gpu" else 8.0
  config = PRESETS[args.preset]()
  print(f"device: {jax.devices()[0].device_kind}, preset {args.preset}: {config}")
  gen = ClickGenerator(config, seed=0, mean_candidates=args.mean_candidates,
                       max_candidates=int(4 * args.mean_candidates))
  slots = int(np.ceil(args.users * args.mean_candidates * 1.5 / 64) * 64)
  trainer = Trainer(config, TrainConfig(num_users=args.users, num_candidates=slots,
                                        steps=args.steps), gen.request)
  held_out = gen.requests(200, start=EVAL_START)
  before = trainer.evaluate(held_out)
  losses = trainer.fit(args.steps)
  after = trainer.evaluate(held_out)
  print(f"held-out AUC {before['auc']:.3f} -> {after['auc']:.3f} after {args.steps} steps "
        f"(loss {losses[0]:.3f} -> {np.mean(losses[-10:]):.3f})")

  sample = pack_requests(held_out[:args.users], config, num_users=args.users,
                         num_candidates=slots)
  mask = np.asarray(sample.candidate_mask())
  ikbo = np.asarray(nnx.jit(lambda m, b: m(b))(trainer.model, sample))[mask]
  standard = np.asarray(nnx.jit(lambda m, b: m.standard(b))(trainer.model, sample))[mask]
  difference = float(np.max(np.abs(ikbo - standard)) / np.max(np.abs(standard)))
  print(f"IKBO vs standard build, same parameters: largest logit difference {difference:.1e} "
        "(relative)")

  requests = gen.requests(args.requests, start=LOAD_START)
  results = compare_builds(trainer.model, requests, qps=args.qps,
                                   mean_candidates=args.mean_candidates)
  for build, stats in results.items():
    print(format_row(build, stats))
  ratio = results[Build.STANDARD]["p50_ms"] / results[Build.IKBO]["p50_ms"]
  print(f"p50 latency, standard / IKBO: {ratio:.2f}x")
  report = dict(device=jax.devices()[0].device_kind, preset=args.preset,
                auc_before=before["auc"], auc_after=after["auc"], build_difference=difference,
                serving=results)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)
  return report


if __name__ == "__main__":
  main()
