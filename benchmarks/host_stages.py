"""Where a served request's time goes in process: each stage's time, alone and under load.

    python -m benchmarks.host_stages --out host_stages.json                  # a GPU: the model
    python -m benchmarks.host_stages --stub 0.232 1.057 --out stages.json    # no GPU: a stub

For the benchmark preset's Zipf trace (70 candidates a request), through
`BucketedModel` or, with `--stub`, a
`DeviceStub` that takes the given device times of the smallest and the largest
bucket (an H100's by default: the host path worked on without a GPU):

- `call`: one call's stages for one request and for a full batch, plain
  (pack, launch, d2h) and each waited for (pack, h2d, execute, d2h), medians;
- `lone`: requests one at a time through the batcher, every stage from the
  batcher's validation to the answer's return to the caller;
- `load`: the same at each `--rates` (Poisson, in process), with latency
  percentiles and the rate answered.

Stages are `ikbo_jax.serving.stages`'; `total` is their sum. Every row is
written as it is measured. Over HTTP, `benchmarks/http_front.py --server-timing`
gives the same stages plus the HTTP ones.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import uvloop

from benchmarks import common
from benchmarks.serving_load import full_batch
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.data.trace import serving_trace
from ikbo_jax.models.config import PRESETS
from ikbo_jax.serving import Batcher, BatchingConfig
from ikbo_jax.serving.buckets import default_buckets
from ikbo_jax.serving.launch import tune_gc
from ikbo_jax.serving.load import run_load
from ikbo_jax.serving.stages import StageClock, summarize


def call_stages(served, requests, iterations: int, waited: bool) -> dict:
  """Median ms of each stage of a call (and of the whole call), `iterations` calls."""
  rows = []
  for _ in range(iterations + 3):  # the first three warm the thread's buffers
    clock = StageClock()
    served.staged(requests, clock.marks, waited)
    rows.append(clock.durations_ms())
  return {stage: round(stats["p50"], 4) for stage, stats in summarize(rows[3:]).items()}


async def _through_batcher(served, requests, rate: float | None, batching: BatchingConfig,
                           seconds: float) -> dict:
  """Stages of `requests` through a batcher: one at a time, or at `rate` (open loop)."""
  rows = []

  async def score(request):
    clock = StageClock()
    scores = await batcher.score(request, clock=clock)
    rows.append(clock.durations_ms())
    return scores

  async with Batcher(served, batching) as batcher:
    await asyncio.gather(*(batcher.score(r) for r in requests[:16]))  # warm, off the clock
    if rate is None:
      for request in requests:
        await score(request)
      stats = {}
    else:
      stats = await run_load(score, requests, qps=rate, max_seconds=seconds)
      stats["batches"] = batcher.batches_run
  stats["stages"] = summarize(rows)
  return stats


def served_models(args, config, buckets) -> dict:
  """The model to profile, by name: the stub, or the IKBO build."""
  if args.stub:
    from ikbo_jax.serving.stub import DeviceStub

    return {"stub": DeviceStub(config, buckets, tuple(args.stub))}
  from flax import nnx

  from ikbo_jax.models import Ranker
  from ikbo_jax.serving import BucketedModel

  return {"ikbo": BucketedModel(Ranker(config, rngs=nnx.Rngs(0)), buckets, "ikbo")}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--stub", type=float, nargs=2, metavar=("FIRST_MS", "LAST_MS"),
                      help="a DeviceStub with these device times instead of the model")
  parser.add_argument("--preset", default="benchmark", choices=sorted(PRESETS))
  parser.add_argument("--mean-candidates", type=float, default=70.0)
  parser.add_argument("--rates", type=float, nargs="+", default=[2000, 4000, 8000, 12000])
  parser.add_argument("--seconds", type=float, default=4.0, help="per rate")
  parser.add_argument("--lone", type=int, default=300, help="requests sent one at a time")
  parser.add_argument("--max-in-flight", type=int, default=2)
  parser.add_argument("--iterations", type=int, default=100)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  config = PRESETS[args.preset]()
  gen = ClickGenerator(config, seed=3, mean_candidates=args.mean_candidates,
                       max_candidates=int(4 * args.mean_candidates))
  count = max(args.lone, int(max(args.rates) * args.seconds), 64)
  started = time.perf_counter()
  pool = [r.validated(config) for r in serving_trace(gen, min(count, 4000))]
  requests = (pool * -(-count // len(pool)))[:count]  # a pool cycled: drawing is slow
  buckets = default_buckets(config, mean_candidates=args.mean_candidates)
  print(f"trace of {len(pool)} requests in {time.perf_counter() - started:.0f} s", flush=True)
  batching = BatchingConfig(max_in_flight=args.max_in_flight)
  payload = dict(**common.metadata(), preset=args.preset, stub_device_ms=args.stub,
                 mean_candidates=args.mean_candidates, max_in_flight=args.max_in_flight,
                 buckets=[(b.num_candidates, b.num_users, b.history_slots) for b in buckets],
                 models={})
  full = full_batch(pool, buckets)
  for name, served in served_models(args, config, buckets).items():
    tune_gc()  # as a serving process does (`launch.tune_gc`)
    row = payload["models"][name] = {}
    row["call"] = {f"{size}_{'waited' if waited else 'plain'}":
                   call_stages(served, batch, args.iterations, waited)
                   for size, batch in (("one_request", pool[:1]), ("full_batch", full))
                   for waited in (False, True)}
    print(name, "call", row["call"], flush=True)
    row["lone"] = uvloop.run(_through_batcher(served, pool[:args.lone], None, batching, 0))
    print(name, "lone", {k: round(v["p50"], 3) for k, v in row["lone"]["stages"].items()},
          flush=True)
    common.write_json(args.out, payload)
    row["load"] = []
    for rate in args.rates:
      stats = uvloop.run(_through_batcher(served, requests[:int(rate * args.seconds)], rate,
                                          batching, args.seconds))
      row["load"].append(stats)
      print(f"{name} {rate:.0f}/s: answered {stats['achieved_qps']:.0f}/s, p50 "
            f"{stats['p50_ms']:.2f} p99 {stats['p99_ms']:.2f} ms, stages p50 "
            f"{ {k: round(v['p50'], 3) for k, v in stats['stages'].items()} }", flush=True)
      common.write_json(args.out, payload)
  print(f"done in {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
  main()
