"""The serving parts of `benchmarks/ranking_system.py`: in process, then over HTTP.

`serving` measures each build through the batcher and the compiled buckets:
where one call's time goes, the device time of a call, single-request latency,
and the highest sustained rate (a ladder of Poisson rates, then bisection at
the knee), repeated to show how repeatable it is. `overload` starts the HTTP
server in its own process and offers it a multiple of that rate from client
processes. `cache_serving` serves the same trace through the user-state cache
(`CachedModel`) at several budgets, and `split_device_time` times the model's
user side and candidate side apart.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import jax
import numpy as np
import uvloop
from flax import nnx
from prometheus_client import parser

from benchmarks import common
from benchmarks.problems import ranking_batch
from ikbo_jax.data import pack_requests
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.data.trace import serving_trace
from ikbo_jax.models import Ranker
from ikbo_jax.models.config import PRESETS
from ikbo_jax.serving import Batcher, BatchingConfig, BucketedModel, http_load
from ikbo_jax.serving.buckets import default_buckets
from ikbo_jax.serving.cached import CachedModel, user_state_bytes
from ikbo_jax.serving.launch import tune_gc
from ikbo_jax.serving.load import run_load
from ikbo_jax.serving.user_cache import user_key
from ikbo_jax.testing import loopback

BUILDS = ("ikbo", "standard")


def call_breakdown(served, requests, iterations: int) -> dict:
  """Median ms of each stage of a call (pack, transfer, execute, fetch), each waited for.

  `whole_call` is a plain call (the stages overlap there), `device` the
  executable alone (CUPTI kernel time on a GPU).
  """
  served.call_breakdown(requests)  # off the clock: first transfers
  runs = [served.call_breakdown(requests) for _ in range(iterations)]
  row = {stage: 1e3 * float(np.median([r[stage] for r in runs])) for stage in runs[0]}
  row["total"] = 1e3 * float(np.median([sum(r.values()) for r in runs]))
  row["whole_call"] = common.wall_median_ms(lambda: served(requests), iterations)
  row["device"], row["device_timer"] = common.median_ms(*served.device_call(requests),
                                                        iterations=iterations)
  row.update(requests=len(requests), candidates=sum(r.num_candidates for r in requests),
             bucket=str(served.bucket_for(requests)))
  return row


def full_batch(requests, buckets):
  """A full batch: the longest prefix of the trace that the largest bucket holds."""
  largest = max(buckets)
  return next(requests[:n] for n in range(largest.num_users, 0, -1)
              if largest.fits(requests[:n]))


async def _single_requests(served, requests) -> dict:
  """Latency of requests sent one at a time (each answered before the next goes)."""
  async with Batcher(served, BatchingConfig()) as batcher:
    await batcher.score(requests[0])
    latencies = []
    for request in requests:
      start = time.perf_counter()
      await batcher.score(request)
      latencies.append(1e3 * (time.perf_counter() - start))
  p50, p99 = np.percentile(latencies, (50, 99))
  return dict(requests=len(requests), p50_ms=float(p50), p99_ms=float(p99))


async def _load(served, requests, rate, max_in_flight):
  batching = BatchingConfig(batch_timeout_ms=2.0, max_in_flight=max_in_flight)
  async with Batcher(served, batching) as batcher:
    await asyncio.gather(*(batcher.score(r) for r in requests[:16]))
    return await run_load(batcher.score, requests, qps=rate, max_seconds=30.0)


def sustained_rate(served, ladder: Ladder, budget_ms, max_in_flight,
                   refinements: int = 2) -> tuple[float, list[dict]]:
  """The highest rate held at p99 <= budget with >= 90% answered: the ladder, then bisection.

  A rate the in-process load generator could not send (below 95% of its
  schedule) is not counted as held: the client, not the server, set it. The
  collector is tuned as in a serving process (`launch.tune_gc`): untuned, its full
  passes over the model's objects stop the event loop for tens of milliseconds.
  """
  tune_gc()
  runs = []

  def holds(rate: float) -> bool:
    stats = uvloop.run(_load(served, ladder.requests[:ladder.count(rate)], rate, max_in_flight))
    runs.append(stats)
    print(f"  {rate:.0f}/s: p99 {stats['p99_ms']:.1f} ms, answered {stats['achieved_qps']:.0f}/s"
          f", sent {stats['sent_qps']:.0f}/s", flush=True)
    return (stats["p99_ms"] <= budget_ms and stats["achieved_qps"] >= 0.9 * stats["offered_qps"]
            and stats["sent_qps"] >= 0.95 * stats["offered_qps"])

  held, failed = 0.0, None
  for rate in ladder.rates:
    if not holds(rate):
      failed = rate
      break
    held = rate
  for _ in range(refinements if failed is not None and held else 0):
    middle = (held + failed) / 2
    if holds(middle):
      held = middle
    else:
      failed = middle
  return held, runs


@dataclasses.dataclass(frozen=True)
class Ladder:
  """The rates a sustained-rate run tries, and the trace they send (drawn once per run).

  Each rate sends at least `requests_per_rate` requests and at least `seconds_per_rate`
  of traffic, so that a high rate's p99 rests on as many samples as a low rate's.
  """

  requests: list
  rates: tuple[float, ...]
  mean_candidates: float
  requests_per_rate: int
  seconds_per_rate: float

  @classmethod
  def draw(cls, config, mean_candidates: float, rates, requests_per_rate: int,
           seconds_per_rate: float) -> Ladder:
    gen = ClickGenerator(config, seed=3, mean_candidates=mean_candidates,
                         max_candidates=int(4 * mean_candidates))
    ladder = cls([], tuple(rates), mean_candidates, requests_per_rate, seconds_per_rate)
    return dataclasses.replace(ladder, requests=serving_trace(
        gen, ladder.count(max(rates)), processes=os.cpu_count()))

  def count(self, rate: float) -> int:
    return max(self.requests_per_rate, int(rate * self.seconds_per_rate))


def serving(model, config, ladder: Ladder, budget_ms, num_buckets, max_in_flight,
            repeats: int = 3) -> dict:
  requests, mean_candidates = ladder.requests, ladder.mean_candidates
  buckets = default_buckets(config, mean_candidates=mean_candidates, count=num_buckets)
  out = dict(budget_p99_ms=budget_ms, mean_candidates=mean_candidates,
             max_in_flight=max_in_flight, trace="serving_trace (Zipf users)",
             buckets=[(b.num_candidates, b.num_users, b.history_slots) for b in buckets])
  full = full_batch(requests, buckets)
  for build in BUILDS:
    served = BucketedModel(model, buckets, build)
    breakdown = {"one_request": call_breakdown(served, requests[:1], 100),
                 "full_batch": call_breakdown(served, full, 100)}
    # What the device alone would allow: full batches back to back.
    device_bound = len(full) / (breakdown["full_batch"]["device"] / 1e3)
    single = uvloop.run(_single_requests(served, requests[:300]))
    print(f"{build}: one request {breakdown['one_request']['whole_call']:.2f} ms a call "
          f"(device {breakdown['one_request']['device']:.3f}), p50 {single['p50_ms']:.2f} ms "
          f"through the batcher; full batch {breakdown['full_batch']['whole_call']:.2f} ms "
          f"(device {breakdown['full_batch']['device']:.3f}); device-bound {device_bound:.0f}/s",
          flush=True)
    held = []
    for repeat in range(repeats):
      rate, runs = sustained_rate(served, ladder, budget_ms, max_in_flight)
      held.append(dict(sustained_qps=rate, ladder=runs))
      print(f"serving {build}, run {repeat + 1}: sustained {rate:.0f}/s", flush=True)
    out[build] = dict(runs=held, breakdown=breakdown, single_request=single,
                      device_bound_qps=device_bound)
    if held:  # no ladders (repeats=0): the calls and the device-bound rate alone
      rates_held = [h["sustained_qps"] for h in held]
      median = float(np.median(rates_held))
      # The first run's rates in order (bisection tries rates between the ladder's): the plot.
      out[build].update(
          sustained_qps=median, sustained_fraction_of_device_bound=median / device_bound,
          ladder=sorted(held[0]["ladder"], key=lambda stats: stats["offered_qps"]),
          spread_of_runs=(max(rates_held) - min(rates_held)) / max(median, 1e-9))
  if repeats:
    out["qps_ratio"] = (out["ikbo"]["sustained_qps"]
                        / max(out["standard"]["sustained_qps"], 1e-9))
  return out


def server_metrics(url: str) -> dict:
  """Refusals by reason and the server-side latency of answered requests, from /metrics."""
  families = {f.name: f for f in parser.text_string_to_metric_families(
      httpx.get(f"{url}/metrics", timeout=30).text)}
  # A server of several processes reports no family for a counter that never counted.
  refused = {s.labels["reason"]: s.value for s in getattr(families.get("ikbo_refused"),
                                                          "samples", [])
             if s.name.endswith("_total")}
  # The 200s' latency histogram: the first bucket bound holding 99% (an upper bound on p99).
  buckets = sorted((float(s.labels["le"]), s.value)
                   for s in families["ikbo_http_request_seconds"].samples
                   if s.name.endswith("_bucket") and s.labels["status"] == "200")
  total = buckets[-1][1] if buckets else 0
  p99 = next((le for le, count in buckets if count >= 0.99 * total), float("nan"))
  return dict(refused=refused, server_p99_ms_at_most=1e3 * p99, server_answered=total)


def wait_ready(url: str, server: subprocess.Popen, log, seconds: float,
               path: str = "/health/ready") -> None:
  """Until the server says ready (200 at `path`); its log's tail in the error if it exits or
  never does."""
  deadline = time.time() + seconds
  while time.time() < deadline and server.poll() is None:
    try:
      if httpx.get(f"{url}{path}", timeout=5).status_code == 200:
        return
    except httpx.HTTPError:
      pass
    time.sleep(0.2)
  log.seek(0)
  tail = log.read()[-3000:].decode(errors="replace")
  state = (f"exited with {server.returncode}" if server.poll() is not None
           else f"was not ready in {seconds:.0f} s")
  raise RuntimeError(f"the server at {url} {state}; its log ends:\n{tail}")


def overload(preset: str, build: str, requests, qps: float, seconds: float, processes: int,
             mean_candidates: float, server_args: list[str], content_type: str,
             expected: list[np.ndarray]) -> dict:
  """The HTTP server (`python -m ikbo_jax.serving`, its own process) offered `qps` for `seconds`.

  `requests` is a pool the clients cycle through for the whole run.

  `server_args` go to the server's command line (its queue bound and deadline); the
  bodies are of `content_type` (`ikbo_jax.serving.bodies`).
  Reports what the clients saw (answers, refusals by status, resets and timeouts by
  type, wrong scores, latency), what the server counted, and how long its SIGTERM
  drain took. Every answer is checked against `expected`, each request's scores from
  the model the server builds (`reference_scores`: the same for every build).
  """
  config = PRESETS[preset]()
  # The server may batch a request with others, in another bucket than alone: 16-bit
  # models round differently there (IKBO and standard builds agree to 5% of the logits).
  tolerance = 1e-4 if config.dtype == "float32" else 0.03
  port = loopback.free_port()
  # This process already holds the device: XLA's default is to take 75% of its memory up
  # front, which leaves the server too little to start.
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  log = tempfile.TemporaryFile()
  server = subprocess.Popen(
      [sys.executable, "-m", "ikbo_jax.serving", "--preset", preset, "--build", build,
       "--port", str(port), "--mean-candidates", str(mean_candidates), *server_args],
      stdout=log, stderr=subprocess.STDOUT, env=env)
  url = f"http://127.0.0.1:{port}"
  try:
    started = time.perf_counter()
    wait_ready(url, server, log, 900)
    print(f"overload {build}: server ready in {time.perf_counter() - started:.0f} s", flush=True)
    stats = http_load.over_http(url, requests, qps=qps, max_seconds=seconds,
                                processes=processes, cycle=True, content_type=content_type,
                                expected=expected, score_tolerance=tolerance)
    stats["score_tolerance"] = tolerance
    stats.update(server_metrics(url))
    start = time.perf_counter()
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=120)
    stats["drain_seconds"] = time.perf_counter() - start
    stats.update(server_args=server_args, content_type=content_type)
  finally:
    if server.poll() is None:
      server.kill()
    log.close()
  print(f"overload {build} at {qps:.0f}/s (sent {stats['sent_qps']:.0f}/s): "
        f"{stats['answered']} answered, "
        f"{stats['errors_by_kind']}; p99 {stats['p99_ms']:.1f} ms (server <= "
        f"{stats['server_p99_ms_at_most']:.0f} ms)", flush=True)
  return stats


def reference_scores(config, requests) -> list[np.ndarray]:
  """Each request's click probabilities from the model the server builds without a checkpoint
  (`Ranker(config, rngs=nnx.Rngs(0))`), scored alone: one user slot, the IKBO build."""
  graph, params = nnx.split(Ranker(config, rngs=nnx.Rngs(0)))
  slots = max(r.num_candidates for r in requests)
  # jax.jit over the split state, not nnx.jit over the module: nnx.jit walks the module's
  # graph on every call, which cost ~10 ms a request here (thousands of requests).
  score = jax.jit(lambda p, b: jax.nn.sigmoid(nnx.merge(graph, p)(b)))
  return [np.asarray(score(params, pack_requests([r.validated(config)], config, num_users=1,
                                                  num_candidates=slots)))[:r.num_candidates]
          for r in requests]


def split_device_time(model, config, sizes, ratios, iterations: int) -> dict:
  """Device ms of the user side and of the candidate side alone, per (B, ratio)."""
  rows = {}
  for b in sizes:
    for ratio in ratios:
      batch = jax.device_put(ranking_batch(config, max(1, round(b / ratio)), b))
      row = dict(num_candidates=b, num_users=batch.num_users, **_sides(model, batch, iterations))
      rows[f"B{b}_ratio{ratio}"] = row
      print(f"split B={b} ratio={ratio}: {row}", flush=True)
  return rows


def _sides_apart(model, config, buckets, requests) -> dict:
  """Device ms of a full batch's user side, candidate side and whole IKBO build, apart."""
  largest, full = max(buckets), full_batch(requests, buckets)
  batch = jax.device_put(pack_requests([r.validated(config) for r in full], config,
                                       num_users=largest.num_users,
                                       num_candidates=largest.num_candidates,
                                       history_slots=largest.history_slots))
  rows = _sides(model, batch)
  rows.update(requests=len(full), bucket=str(largest))
  return rows


def _sides(model, batch, iterations: int = 50) -> dict:
  user_side = jax.jit(lambda m, b: m.user_state(b.history, b.user_dense, b.history_len))
  candidate_side = jax.jit(lambda m, state, b: m.score_candidates(
      state, b.cand_items, b.cand_dense, b.index()))
  row = {}
  row["user_side_ms"], _ = common.median_ms(user_side, model, batch, iterations=iterations)
  row["candidate_side_ms"], _ = common.median_ms(candidate_side, model,
                                                 user_side(model, batch), batch,
                                                 iterations=iterations)
  row["ikbo_build_ms"], row["timer"] = common.median_ms(jax.jit(lambda m, b: m(b)), model,
                                                        batch, iterations=iterations)
  return row


def cache_serving(model, config, ladder: Ladder, budget_ms, num_buckets, max_in_flight,
                  budgets_mb, on_budget=None) -> dict:
  """The Zipf trace through `CachedModel` at each cache budget: hit rate, latency, sustained rate.

  The uncached builds' numbers come from `serving` in the same run, on the same `ladder`.
  `on_budget(results so far)` hears of each budget as it ends (to write them as they come).
  """
  requests = ladder.requests
  buckets = default_buckets(config, mean_candidates=ladder.mean_candidates, count=num_buckets)
  out = dict(bytes_per_user=user_state_bytes(model),
             distinct_users=len({user_key(r.validated(config)) for r in requests}))
  out["full_batch"] = _sides_apart(model, config, buckets, requests)
  full = full_batch(requests, buckets)
  for mb in budgets_mb:
    cached = CachedModel(model, buckets, cache_bytes=int(mb * 2**20))
    # A full batch whose users all hit costs its candidate side alone: against that side
    # timed apart at the same padded shapes, and against the uncached build's device time.
    hit_ms, timer = common.median_ms(*cached.device_call(full), iterations=50)
    cached.flush()
    single = uvloop.run(_single_requests(cached, requests[:300]))
    cached.flush()
    rate, runs = sustained_rate(cached, ladder, budget_ms, max_in_flight)
    report = cached.report()
    out[f"{mb}MB"] = dict(capacity=cached.capacity, single_request=single, sustained_qps=rate,
                          ladder=runs, cache=report, full_batch_all_hits_ms=hit_ms,
                          timer=timer)
    print(f"cache {mb} MB ({cached.capacity} users): hit rate {report['hit_rate']:.2f}, "
          f"single p50 {single['p50_ms']:.2f} ms, sustained {rate:.0f}/s", flush=True)
    del cached
    if on_budget is not None:
      on_budget(out)
  return out
