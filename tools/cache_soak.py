"""A soak of the user-state cache: cached scores against the uncached build until time runs out.

    python tools/cache_soak.py --minutes 60 --out cache_soak.json          # the GPU, benchmark preset
    python tools/cache_soak.py --small --minutes 1 --out /tmp/soak.json    # CPU

Several threads send batches of the Zipf trace of returning users (a share of
them with a changed history, so that stale entries would be read if they
could be) through one `CachedModel` whose budget holds a fraction of the
users (so that it evicts all the time), and score each batch with the
uncached IKBO build too. A request whose scores differ by more than the
tolerance (rounding of the two bfloat16 paths; 1e-5 in float32) is a
mismatch. Prints and writes requests, hits, evictions and mismatches; exits
non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import sys
import threading
import time

import jax
import numpy as np
from flax import nnx

from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.data.trace import serving_trace
from ikbo_jax.models import Ranker, RankerConfig
from ikbo_jax.serving import BucketedModel
from ikbo_jax.serving.buckets import default_buckets
from ikbo_jax.serving.cached import CachedModel, user_state_bytes


def _batches(config, mean: float, seed: int, count: int, changed_share: float, processes: int):
  """Batches of 1-16 trace requests; a share of them get their history reversed."""
  rng = np.random.default_rng(seed)
  trace = [r.validated(config) for r in serving_trace(
      ClickGenerator(config, seed=seed, mean_candidates=mean, max_candidates=int(2 * mean)),
      count, num_users=2000, seed=seed, processes=processes)]
  for i in np.flatnonzero(rng.random(count) < changed_share):
    trace[i] = dataclasses.replace(trace[i], history=trace[i].history[::-1].copy())
  start = 0
  while start < count:
    size = int(rng.integers(1, 17))
    yield trace[start:start + size]
    start += size


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--small", action="store_true", help="the CPU default model")
  parser.add_argument("--minutes", type=float, default=10.0)
  parser.add_argument("--users-in-cache", type=int, default=300,
                      help="the cache's budget, in users (the trace has 2000)")
  parser.add_argument("--threads", type=int, default=4)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  config, mean = (RankerConfig(), 8.0) if args.small else (RankerConfig.benchmark(), 70.0)
  tolerance = 1e-5 if config.dtype == "float32" else 2e-2
  ranker = Ranker(config, rngs=nnx.Rngs(0))
  buckets = default_buckets(config, mean_candidates=mean)
  cached = CachedModel(ranker, buckets, cache_bytes=args.users_in_cache * user_state_bytes(ranker))
  oracle = BucketedModel(ranker, buckets)
  counts, lock = dict(requests=0, batches=0, mismatches=0, worst=0.0), threading.Lock()
  deadline = time.monotonic() + 60 * args.minutes

  def check(batch) -> None:
    batch = batch[:next(n for n in range(len(batch), 0, -1) if cached.bucket_for(batch[:n]))]
    worst = max(float(np.max(np.abs(g - w))) for g, w in zip(cached(batch), oracle(batch)))
    with lock:
      counts["batches"] += 1
      counts["requests"] += len(batch)
      counts["worst"] = max(counts["worst"], worst)
      if worst > tolerance:
        counts["mismatches"] += 1
        print(f"mismatch: {worst:.3g} in a batch of {len(batch)}", flush=True)

  # A round's trace is drawn in processes where drawing is slow (the benchmark preset):
  # starting them costs seconds, more than the small preset's whole trace.
  seed, processes = 0, 1 if args.small else os.cpu_count()
  with concurrent.futures.ThreadPoolExecutor(args.threads) as threads:
    while time.monotonic() < deadline:
      list(threads.map(check, _batches(config, mean, seed, 2000, 0.05, processes)))
      seed += 1
  report = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                commit=os.environ.get("IKBO_COMMIT", "unknown"),
                device=jax.devices()[0].device_kind, config=str(config), minutes=args.minutes,
                tolerance=tolerance, **counts, cache=cached.report())
  print(json.dumps(report, indent=1))
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)
  return 1 if counts["mismatches"] else 0


if __name__ == "__main__":
  sys.exit(main())
