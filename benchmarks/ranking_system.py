"""End-to-end benchmark of the reference ranker: IKBO vs standard build of the same parameters.

    python -m benchmarks.ranking_system --out benchmarks/results/ranking_system_h200.json
    python -m benchmarks.ranking_system --small --out /tmp/small.json   # CPU, seconds

Three measurements, each for both builds in the same run:
1. inference: the jitted forward at B candidates of U = B / ratio users, for
   every (B, ratio) asked (default B in {256, 1024, 4096}, ratio in {10, 70, 500});
2. training: one optimizer step (forward, backward, AdamW) at B=1024, ratio 70;
3. serving: where one call's time goes (pack, host -> device, execute, fetch;
   one request and a full batch, each stage waited for), the device-bound rate
   (full batches back to back), then a Poisson stream through the batcher and
   the compiled buckets at rising rates; the highest rate whose p99 latency
   stays within the budget (default 20 ms on a GPU, 100 ms with --small) and
   whose answered rate is at least 90% of the offered one;
4. overload: the HTTP server in its own process offered `--overload-factor`
   times the sustained rate for `--overload-seconds` from several client
   processes: answers, refusals by status, resets by type, client and server
   p99, and the SIGTERM drain time.
Times are medians (CUPTI kernel time on a GPU, wall clock elsewhere; serving is
always wall clock, end to end).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import optax
from flax import nnx
from prometheus_client import parser

from benchmarks import common
from benchmarks.problems import ranking_batch
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.data.trace import serving_trace
from ikbo_jax.models import Ranker, RankerConfig
from ikbo_jax.serving import Batcher, BatchingConfig, BucketedModel, http_load
from ikbo_jax.serving.load import run_load
from ikbo_jax.testing import loopback
from ikbo_jax.serving.buckets import default_buckets
from ikbo_jax.training import trainer

BUILDS = ("ikbo", "standard")


def _forward(build):
  return nnx.jit(lambda model, batch: model(batch) if build == "ikbo" else model.standard(batch))


def inference(model, config, sizes, ratios, iterations) -> dict:
  rows = {}
  for b in sizes:
    for ratio in ratios:
      batch = jax.device_put(ranking_batch(config, max(1, round(b / ratio)), b))
      row = {}
      for build in BUILDS:
        try:
          ms, timer = common.median_ms(_forward(build), model, batch, iterations=iterations)
          row[build] = dict(ms=ms, timer=timer)
        except Exception as e:  # e.g. out of memory for the standard build at large B
          row[build] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
      if "ms" in row["ikbo"] and "ms" in row["standard"]:
        row["speedup"] = row["standard"]["ms"] / row["ikbo"]["ms"]
      rows[f"B{b}_ratio{ratio}"] = dict(num_candidates=b, num_users=batch.num_users, **row)
      print(f"inference B={b} ratio={ratio}: {row}", flush=True)
  return rows


def _functional_step(graphdef, build):
  """The trainer's step as a function of the state that returns the updated state.

  The timer jits what it measures; a step that returned only its loss would let
  XLA drop the backward pass and the update, whose results nothing would read.
  """
  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss = trainer._train_step(model, optimizer, batch, build)
    return loss, nnx.state((model, optimizer))
  return step


def training(config, b, ratio, iterations) -> dict:
  batch = jax.device_put(ranking_batch(config, max(1, round(b / ratio)), b, seed=1))
  row = dict(num_candidates=b, num_users=batch.num_users)
  for build in BUILDS:
    model = Ranker(config, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    step = _functional_step(graphdef, build)
    ms, timer = common.median_ms(step, state, batch, iterations=iterations)
    row[build] = dict(ms=ms, timer=timer)
  row["speedup"] = row["standard"]["ms"] / row["ikbo"]["ms"]
  print(f"training: {row}", flush=True)
  return row


async def _load(served, requests, rate, max_seconds, max_in_flight):
  batching = BatchingConfig(batch_timeout_ms=2.0, max_in_flight=max_in_flight)
  async with Batcher(served, batching) as batcher:
    await asyncio.gather(*(batcher.score(r) for r in requests[:16]))
    return await run_load(batcher.score, requests, qps=rate, max_seconds=max_seconds)


def served_users(buckets) -> int:
  """Requests in a full batch: the user slots of the largest bucket."""
  return max(buckets).num_users


def call_breakdown(served, requests, iterations: int) -> dict:
  """Median ms of each stage of a call (pack, transfer, execute, fetch), each waited for."""
  served.call_breakdown(requests)  # off the clock: first transfers
  runs = [served.call_breakdown(requests) for _ in range(iterations)]
  row = {stage: 1e3 * float(np.median([r[stage] for r in runs])) for stage in runs[0]}
  row["total"] = 1e3 * float(np.median([sum(r.values()) for r in runs]))
  row.update(requests=len(requests), candidates=sum(r.num_candidates for r in requests),
             bucket=str(served.bucket_for(requests)))
  return row


def serving(model, config, mean_candidates, rates, budget_ms, requests_per_rate,
            seconds_per_rate, num_buckets, max_in_flight) -> dict:
  gen = ClickGenerator(config, seed=3, mean_candidates=mean_candidates,
                       max_candidates=int(4 * mean_candidates))
  # Each rate sends at least `requests_per_rate` requests and at least `seconds_per_rate`
  # of traffic, so that a high rate's p99 rests on as many samples as a low rate's.
  count = lambda rate: max(requests_per_rate, int(rate * seconds_per_rate))
  requests = gen.requests(count(max(rates)), start=3 * 10**9)
  buckets = default_buckets(config, mean_candidates=mean_candidates, count=num_buckets)
  out = dict(budget_p99_ms=budget_ms, mean_candidates=mean_candidates,
             max_in_flight=max_in_flight,
             buckets=[(b.num_candidates, b.num_users, b.history_slots) for b in buckets])
  full = requests[:served_users(buckets)]
  for build in BUILDS:
    served = BucketedModel(model, buckets, build)
    breakdown = {"one_request": call_breakdown(served, requests[:1], 50),
                 "full_batch": call_breakdown(served, full, 50)}
    # What the device alone would allow: full batches back to back.
    device_bound = len(full) / (breakdown["full_batch"]["execute"] / 1e3)
    print(f"{build}: one request {breakdown['one_request']['total']:.2f} ms "
          f"(execute {breakdown['one_request']['execute']:.2f}), full batch "
          f"{breakdown['full_batch']['total']:.2f} ms (execute "
          f"{breakdown['full_batch']['execute']:.2f}); device-bound {device_bound:.0f}/s",
          flush=True)
    ladder, sustained = [], 0.0
    for rate in rates:
      stats = asyncio.run(_load(served, requests[:count(rate)], rate, 30.0, max_in_flight))
      ladder.append(stats)
      print(f"serving {build} at {rate}/s: p99 {stats['p99_ms']:.1f} ms, "
            f"answered {stats['achieved_qps']:.0f}/s", flush=True)
      if stats["p99_ms"] > budget_ms or stats["achieved_qps"] < 0.9 * stats["offered_qps"]:
        break
      sustained = rate
    out[build] = dict(sustained_qps=sustained, ladder=ladder, breakdown=breakdown,
                      device_bound_qps=device_bound,
                      sustained_fraction_of_device_bound=sustained / device_bound)
  out["qps_ratio"] = out["ikbo"]["sustained_qps"] / max(out["standard"]["sustained_qps"], 1e-9)
  return out


def _server_metrics(url: str) -> dict:
  """Refusals by reason and the server-side latency of answered requests, from /metrics."""
  families = {f.name: f for f in parser.text_string_to_metric_families(
      httpx.get(f"{url}/metrics", timeout=30).text)}
  refused = {s.labels["reason"]: s.value for s in families["ikbo_refused"].samples
             if s.name.endswith("_total")}
  # The 200s' latency histogram: the first bucket bound holding 99% (an upper bound on p99).
  buckets = sorted((float(s.labels["le"]), s.value)
                   for s in families["ikbo_http_request_seconds"].samples
                   if s.name.endswith("_bucket") and s.labels["status"] == "200")
  total = buckets[-1][1] if buckets else 0
  p99 = next((le for le, count in buckets if count >= 0.99 * total), float("nan"))
  return dict(refused=refused, server_p99_ms_at_most=1e3 * p99, server_answered=total)


def overload(preset: str, build: str, requests, qps: float, seconds: float, processes: int,
             mean_candidates: float) -> dict:
  """The HTTP server (`python -m ikbo_jax.serving`, its own process) offered `qps` for `seconds`.

  Reports what the clients saw (answers, refusals by status, resets and timeouts by
  type, latency), what the server counted, and how long its SIGTERM drain took.
  """
  port = loopback.free_port()
  server = subprocess.Popen(
      [sys.executable, "-m", "ikbo_jax.serving", "--preset", preset, "--build", build,
       "--port", str(port), "--mean-candidates", str(mean_candidates)],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  url = f"http://127.0.0.1:{port}"
  try:
    deadline = time.time() + 900
    while time.time() < deadline:
      try:
        if httpx.get(f"{url}/health/ready", timeout=5).status_code == 200:
          break
      except httpx.HTTPError:
        pass
      time.sleep(0.2)
    else:
      raise RuntimeError(f"the server did not get ready on port {port}")
    stats = http_load.over_http(url, requests, qps=qps, max_seconds=seconds,
                                processes=processes)
    stats.update(_server_metrics(url))
    start = time.perf_counter()
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=120)
    stats["drain_seconds"] = time.perf_counter() - start
  finally:
    if server.poll() is None:
      server.kill()
  print(f"overload {build} at {qps:.0f}/s (sent {stats['sent_qps']:.0f}/s): "
        f"{stats['answered']} answered, "
        f"{stats['errors_by_kind']}; p99 {stats['p99_ms']:.1f} ms (server <= "
        f"{stats['server_p99_ms_at_most']:.0f} ms)", flush=True)
  return stats


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--small", action="store_true", help="the CPU default model, tiny sizes")
  parser.add_argument("--iterations", type=int, default=20)
  parser.add_argument("--budget-ms", type=float, help="p99 budget (default 20, --small 100)")
  parser.add_argument("--requests-per-rate", type=int, default=400)
  parser.add_argument("--seconds-per-rate", type=float, default=2.0)
  parser.add_argument("--sizes", type=int, nargs="*", help="candidate counts B")
  parser.add_argument("--ratios", type=int, nargs="*", help="candidates per user")
  parser.add_argument("--rates", type=float, nargs="*", help="serving rates to climb")
  parser.add_argument("--buckets", type=int, default=4, help="how many default buckets (1-4)")
  parser.add_argument("--max-in-flight", type=int, default=2, help="the batcher's")
  parser.add_argument("--parts", nargs="*",
                      choices=("inference", "training", "serving", "overload"),
                      default=("inference", "training", "serving", "overload"),
                      help="what to measure")
  parser.add_argument("--overload-factor", type=float, default=3.0,
                      help="overload: offered rate as a multiple of the sustained one")
  parser.add_argument("--overload-seconds", type=float, help="default 60, --small 2")
  parser.add_argument("--client-processes", type=int,
                      help="overload: load generator processes (default 4, --small 1)")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  if args.small:
    config, sizes, ratios, train_at = RankerConfig(), (64, 256), (8, 32), (256, 32)
    rates, mean = (50, 100, 200, 400, 800), 8.0
  else:
    config, train_at = RankerConfig.benchmark(), (1024, 70)
    sizes, ratios = (256, 1024, 4096), (10, 70, 500)
    rates, mean = (25, 50, 100, 200, 300, 400, 600, 800, 1200, 1600, 2400, 3200, 4800), 70.0
  sizes, ratios, rates = args.sizes or sizes, args.ratios or ratios, args.rates or rates
  budget_ms = args.budget_ms or (100.0 if args.small else 20.0)
  model = Ranker(config, rngs=nnx.Rngs(0))
  payload = dict(**common.metadata(), config=str(config), iterations=args.iterations)
  if "inference" in args.parts:
    payload["inference"] = inference(model, config, sizes, ratios, args.iterations)
  if "training" in args.parts:
    payload["training"] = training(config, *train_at, args.iterations)
  if "serving" in args.parts:
    payload["serving"] = serving(model, config, mean, rates, budget_ms, args.requests_per_rate,
                                 args.seconds_per_rate, args.buckets, args.max_in_flight)
  if "overload" in args.parts:
    # Past the rate each build sustained (or, without the serving part, past the top rate).
    sustained = {b: payload.get("serving", {}).get(b, {}).get("sustained_qps") or max(rates)
                 for b in BUILDS}
    seconds = args.overload_seconds or (2.0 if args.small else 60.0)
    gen = ClickGenerator(config, seed=4, mean_candidates=mean,
                         max_candidates=int(4 * mean))
    payload["overload"] = {}
    for build in BUILDS:
      qps = args.overload_factor * sustained[build]
      trace = serving_trace(gen, int(qps * seconds) + 1)
      payload["overload"][build] = dict(sustained_qps=sustained[build], **overload(
          "small" if args.small else "benchmark", build, trace, qps, seconds,
          args.client_processes or (1 if args.small else 4), mean))
  common.write_json(args.out, payload)


if __name__ == "__main__":
  main()
