"""A load generator: a Poisson request stream at a target rate, and its latency percentiles.

    python -m ikbo_jax.serving.loadgen --qps 200 --requests 1000
    python -m ikbo_jax.serving.loadgen --url http://127.0.0.1:8000 --qps 100

In-process it serves both builds of one model (IKBO and standard) through the
batcher in turn and prints p50/p90/p99 latency and throughput for each; with
`--url` it drives a running server over HTTP. The stream is the synthetic one
(`ikbo_jax.data.synthetic`): log-normal candidate counts around
`--mean-candidates`. Bounded by `--requests` and `--max-seconds`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence

import httpx
import numpy as np
from flax import nnx

from ikbo_jax import __version__, _cli
from ikbo_jax.data import Request, RequestError
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.models import PRESETS, Build, Ranker
from ikbo_jax.serving.batcher import Batcher, BatchingConfig
from ikbo_jax.serving.buckets import Bucket, BucketedModel, default_buckets


async def run_load(score: Callable[[Request], Awaitable], requests: Sequence[Request], *,
                   qps: float, seed: int = 0, max_seconds: float = 60.0) -> dict:
  """Sends `requests` at Poisson arrivals of rate `qps`; latency stats of those answered."""
  gaps = np.random.default_rng(seed).exponential(1.0 / qps, size=len(requests))
  loop = asyncio.get_running_loop()
  start = loop.time()
  latencies, errors = [], []

  async def one(request: Request) -> None:
    sent = time.perf_counter()
    try:
      await score(request)
    except RequestError as e:
      errors.append(str(e))
      return
    latencies.append((time.perf_counter() - sent) * 1e3)

  tasks, last_arrival = [], 0.0
  for request, arrival in zip(requests, np.cumsum(gaps)):
    if arrival > max_seconds:
      break
    await asyncio.sleep(max(start + arrival - loop.time(), 0))
    tasks.append(asyncio.create_task(one(request)))
    last_arrival = arrival
  await asyncio.gather(*tasks)
  elapsed = loop.time() - start
  sent = requests[:len(tasks)]
  p50, p90, p99 = (np.percentile(latencies, (50, 90, 99)) if latencies else (np.nan,) * 3)
  # The realized rate of this finite Poisson draw: what "keeping up" is judged against.
  offered = len(tasks) / last_arrival if last_arrival > 0 else float(len(tasks))
  return dict(target_qps=qps, offered_qps=offered, requests=len(tasks), answered=len(latencies),
              errors=len(errors),
              candidates=int(sum(r.num_candidates for r in sent)), seconds=elapsed,
              achieved_qps=len(latencies) / elapsed, p50_ms=float(p50), p90_ms=float(p90),
              p99_ms=float(p99), mean_ms=float(np.mean(latencies)) if latencies else np.nan)


def format_row(name: str, stats: dict) -> str:
  """One line per run: what was sent, what came back, and how fast.

  The rate is answers over the whole run, which includes waiting for the last
  answers after the last request was sent, so it reads below the offered rate
  even when every request is answered.
  """
  return (f"{name:>9}: {stats['requests']} requests sent at {stats['offered_qps']:.0f}/s "
          f"(target {stats['target_qps']:.0f}/s), {stats['answered']} answered "
          f"({stats['errors']} refused) in {stats['seconds']:.1f} s; latency "
          f"p50 {stats['p50_ms']:.1f} ms, p90 {stats['p90_ms']:.1f} ms, "
          f"p99 {stats['p99_ms']:.1f} ms")


async def _serve_load(model: BucketedModel, requests, batching, qps, max_seconds) -> dict:
  async with Batcher(model, batching) as batcher:
    await asyncio.gather(*(batcher.score(r) for r in requests[:8]))  # first calls, off the clock
    stats = await run_load(batcher.score, requests, qps=qps, max_seconds=max_seconds)
    stats["batches"] = batcher.batches_run
  return stats


def compare_builds(model: Ranker, requests: Sequence[Request], *, qps: float,
                   mean_candidates: float = 8.0, max_seconds: float = 60.0,
                   batching: BatchingConfig = BatchingConfig(),
                   buckets: Sequence[Bucket] | None = None) -> dict:
  """The same request stream through each build of `model` in turn, in process."""
  buckets = buckets or default_buckets(model.config, mean_candidates=mean_candidates)
  results = {}
  for build in Build:
    print(f"compiling {len(buckets)} buckets of the {build} build...", flush=True)
    start = time.perf_counter()
    served = BucketedModel(model, buckets, build)
    compile_s = time.perf_counter() - start
    print(f"  compiled in {compile_s:.1f} s; sending {len(requests)} requests at {qps:.0f}/s",
          flush=True)
    results[build] = asyncio.run(_serve_load(served, list(requests), batching, qps, max_seconds))
    results[build].update(compile_seconds=compile_s,
                          buckets=[(b.num_candidates, b.num_users, b.history_slots)
                                   for b in served.buckets])
  return results


async def _over_http(url: str, requests, args) -> dict:
  async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
    async def score(request: Request):
      body = {f: np.asarray(getattr(request, f)).tolist()
              for f in ("user_dense", "history", "cand_items", "cand_dense")}
      response = await client.post("/score", json=body)
      if response.status_code == 400:
        raise RequestError(response.json()["error"])
      response.raise_for_status()
      return response.json()["scores"]
    return await run_load(score, requests, qps=args.qps, max_seconds=args.max_seconds)


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
  parser.add_argument("--url", help="drive a running server over HTTP instead")
  parser.add_argument("--out", help="write the stats as JSON")
  args = parser.parse_args(argv)
  config = PRESETS[args.preset]()
  gen = ClickGenerator(config, seed=1, mean_candidates=args.mean_candidates,
                       max_candidates=int(8 * args.mean_candidates))
  requests = gen.requests(args.requests, start=2 * 10**9)
  if args.url:
    results = {"http": asyncio.run(_over_http(args.url, requests, args))}
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
