"""A load generator: a Poisson request stream at a target rate, and its latency percentiles.

    python -m ikbo_jax.serving.loadgen --qps 200 --requests 1000
    python -m ikbo_jax.serving.loadgen --url http://127.0.0.1:8000 --qps 100

In-process it serves both builds of one model (IKBO and standard) through the
batcher in turn and prints p50/p90/p99 latency and throughput for each; with
`--url` it drives a running server over HTTP from `--processes` client
processes (`ikbo_jax.serving.http_load`). Arrivals are Poisson (open loop);
failures are counted by kind (status, or the connection error). The requests
are a serving trace (`ikbo_jax.data.trace`): Zipf-popular returning users over
`--users`, candidate counts log-normal around `--mean-candidates` with a tail of
large requests. Bounded by `--requests` and `--max-seconds`.
"""

from __future__ import annotations

import json

from ikbo_jax import __version__, _cli
from ikbo_jax.models.config import PRESETS


def main(argv=None) -> dict:
  parser = _cli.parser("ikbo_jax.serving.loadgen", __doc__, __version__)
  parser.add_argument("--preset", choices=sorted(PRESETS), default="small",
                      help="model sizes (ikbo_jax.models.PRESETS)")
  parser.add_argument("--qps", type=float, default=100.0,
                      help="target request rate (Poisson arrivals)")
  parser.add_argument("--requests", type=int, default=500, help="requests to send at most")
  parser.add_argument("--max-seconds", type=float, default=60.0,
                      help="stop sending after this long")
  parser.add_argument("--mean-candidates", type=float, default=8.0,
                      help="mean candidates per request (log-normal)")
  parser.add_argument("--users", type=int, default=10_000,
                      help="the returning-user population (Zipf popularity)")
  parser.add_argument("--url", help="drive a running server over HTTP instead")
  parser.add_argument("--processes", type=int, default=1,
                      help="client processes sending over HTTP (each qps / processes)")
  parser.add_argument("--connections", type=int, default=256,
                      help="connections per client process")
  parser.add_argument("--msgpack", action="store_true",
                      help="send msgpack bodies of raw arrays, not JSON (ikbo_jax.serving.bodies)")
  parser.add_argument("--out", help="write the stats as JSON")
  return _run(parser.parse_args(argv))


def _run(args) -> dict:
  # Imported after parsing, so that --help and --version answer before jax loads.
  from flax import nnx

  from ikbo_jax.data.synthetic import ClickGenerator
  from ikbo_jax.data.trace import serving_trace
  from ikbo_jax.models import Ranker
  from ikbo_jax.serving.bodies import JSON, MSGPACK
  from ikbo_jax.serving.http_load import over_http
  from ikbo_jax.serving.load import compare_builds, format_row

  config = PRESETS[args.preset]()
  gen = ClickGenerator(config, seed=1, mean_candidates=args.mean_candidates,
                       max_candidates=int(8 * args.mean_candidates))
  requests = serving_trace(gen, args.requests, num_users=args.users)
  if args.url:
    results = {"http": over_http(args.url, requests, qps=args.qps, max_seconds=args.max_seconds,
                                 processes=args.processes, connections=args.connections,
                                 content_type=MSGPACK if args.msgpack else JSON)}
  else:
    model = Ranker(config, rngs=nnx.Rngs(0))
    results = compare_builds(model, requests, qps=args.qps, mean_candidates=args.mean_candidates,
                             max_seconds=args.max_seconds)
  for name, stats in results.items():
    print(format_row(name, stats))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)
  return results


if __name__ == "__main__":
  main()
