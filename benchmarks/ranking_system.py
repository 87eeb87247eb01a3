"""End-to-end benchmark of the reference ranker: IKBO vs standard build of the same parameters.

    python -m benchmarks.ranking_system --out benchmarks/results/ranking_system_h200.json
    python -m benchmarks.ranking_system --small --out /tmp/small.json   # CPU, seconds

Each measurement for both builds in the same run:
1. inference: the jitted forward at B candidates of U = B / ratio users, for
   every (B, ratio) asked (default B in {256, 1024, 4096}, ratio in {10, 70, 500}),
   and the IKBO build as served (`ikbo_served`: parameters cast once, not per call);
2. training: one optimizer step (forward, backward, AdamW) at B=1024, ratio 70;
3. checkpoint: what saving every N steps in the background costs a training run
   (IKBO build; `benchmarks/checkpoint_cost.py`);
4. serving: where one call's time goes (pack, host -> device, execute, fetch;
   one request and a full batch), the device time of a call and the
   device-bound rate (full batches back to back), single-request latency
   through the batcher, then Poisson streams of the Zipf trace through the
   batcher and the compiled buckets at rising rates, bisected at the knee: the
   highest rate whose p99 latency stays within the budget (default 20 ms on a
   GPU, 100 ms with --small), `--repeats` times (`benchmarks/serving_load.py`);
5. cache: the same trace through the user-state cache (`CachedModel`) at
   several budgets (hit rate, single-request latency, sustained rate), and the
   device time of the user side and the candidate side apart;
6. overload: the HTTP server in its own process offered `--overload-factor`
   times the sustained rate for `--overload-seconds` from several client
   processes (msgpack bodies unless `--content-type` says JSON): answers,
   refusals by status, resets by type, client and server p99, and the SIGTERM
   drain time.
Times are medians (CUPTI kernel time on a GPU, wall clock elsewhere; serving is
wall clock, end to end, apart from its device times).

`--items-per-group N` gives the model a group level (ad groups of about N
candidates each, with their own features: `RankerConfig.with_groups`); the
inference and training parts then compare its IKBO build (the group part of
linear compression once per group) with its standard build (groups copied to
the candidates). The serving parts take models without one.
"""

from __future__ import annotations

import argparse
import os

import jax
import optax
from flax import nnx

from benchmarks import common
from benchmarks.checkpoint_cost import checkpoint_cost
from benchmarks.problems import functional_step, ranking_batch, served_forward
from benchmarks.serving_load import (BUILDS, Ladder, cache_serving, overload,
                                     reference_scores, serving, split_device_time)
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.data.trace import serving_trace
from ikbo_jax.models import Ranker, RankerConfig
from ikbo_jax.models.config import PRESETS
from ikbo_jax.serving import bodies


def _forward(build):
  return nnx.jit(lambda model, batch: model(batch) if build == "ikbo" else model.standard(batch))


def inference(model, config, sizes, ratios, iterations, items_per_group=8) -> dict:
  rows = {}
  for b in sizes:
    for ratio in ratios:
      batch = jax.device_put(ranking_batch(config, max(1, round(b / ratio)), b,
                                           items_per_group=items_per_group))
      row = {}
      for build in BUILDS:
        try:
          ms, timer = common.median_ms(_forward(build), model, batch, iterations=iterations)
          row[build] = dict(ms=ms, timer=timer)
        except Exception as e:  # e.g. out of memory for the standard build at large B
          row[build] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
      # As served: the parameters the program only reads cast are cast once, not per call.
      served, leaves = served_forward(model, batch)
      ms, timer = common.median_ms(served, leaves, batch, iterations=iterations)
      row["ikbo_served"] = dict(ms=ms, timer=timer)
      if "ms" in row["ikbo"] and "ms" in row["standard"]:
        row["speedup"] = row["standard"]["ms"] / row["ikbo"]["ms"]
      groups = dict(num_groups=batch.group_to_user.shape[0]) if batch.has_groups else {}
      rows[f"B{b}_ratio{ratio}"] = dict(num_candidates=b, num_users=batch.num_users, **groups,
                                        **row)
      print(f"inference B={b} ratio={ratio}: {row}", flush=True)
  return rows


def training(config, b, ratio, iterations, items_per_group=8) -> dict:
  batch = jax.device_put(ranking_batch(config, max(1, round(b / ratio)), b, seed=1,
                                       items_per_group=items_per_group))
  row = dict(num_candidates=b, num_users=batch.num_users)
  if batch.has_groups:
    row["num_groups"] = batch.group_to_user.shape[0]
  for build in BUILDS:
    model = Ranker(config, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    step = functional_step(graphdef, build)
    ms, timer = common.median_ms(step, state, batch, iterations=iterations)
    row[build] = dict(ms=ms, timer=timer)
  row["speedup"] = row["standard"]["ms"] / row["ikbo"]["ms"]
  print(f"training: {row}", flush=True)
  return row


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
  parser.add_argument("--repeats", type=int, default=3, help="serving: sustained-rate runs")
  parser.add_argument("--cache-mb", type=float, nargs="*",
                      help="cache: the user-state cache budgets (default 512 and 8192; "
                           "--small 1 and 8)")
  parser.add_argument("--parts", nargs="*",
                      choices=("inference", "training", "checkpoint", "serving", "cache",
                               "overload"),
                      default=("inference", "training", "checkpoint", "serving", "cache",
                               "overload"),
                      help="what to measure")
  parser.add_argument("--overload-factor", type=float, default=3.0,
                      help="overload: offered rate as a multiple of the sustained one")
  parser.add_argument("--overload-pool", type=int, default=2000,
                      help="overload: distinct requests the clients cycle through")
  parser.add_argument("--overload-seconds", type=float, help="default 60, --small 2")
  parser.add_argument("--mean-candidates", type=float,
                      help="candidates per request, on average (default 70, --small 8)")
  parser.add_argument("--sustained", type=float, nargs=2, metavar=("IKBO", "STANDARD"),
                      help="overload without the serving part: the builds' sustained rates "
                           "(from an earlier run) that the factor multiplies")
  parser.add_argument("--content-type", choices=bodies.CONTENT_TYPES, default=bodies.MSGPACK,
                      help="overload: the bodies the clients send (msgpack: raw arrays, the "
                           "server's fast path)")
  parser.add_argument("--http-processes", type=int, default=1,
                      help="overload: the server's HTTP processes (ikbo_jax.serving.processes)")
  parser.add_argument("--client-processes", type=int,
                      help="overload: load generator processes (default 4, --small 1)")
  parser.add_argument("--items-per-group", type=int,
                      help="give the model a group level, groups of about this many candidates "
                           "(inference and training parts only)")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  if args.small:
    config, sizes, ratios, train_at = RankerConfig(), (64, 256), (8, 32), (256, 32)
    rates, mean = (50, 100, 200, 400, 800), 8.0
  else:
    config, train_at = RankerConfig.benchmark(), (1024, 70)
    sizes, ratios = (256, 1024, 4096), (10, 70, 500)
    rates = (200, 400, 800, 1200, 1600, 2400, 3200, 4800, 6400, 9600, 12800)
    mean = 70.0
  sizes, ratios, rates = args.sizes or sizes, args.ratios or ratios, args.rates or rates
  mean = args.mean_candidates or mean
  budget_ms = args.budget_ms or (100.0 if args.small else 20.0)
  per_group = args.items_per_group
  if per_group:
    if set(args.parts) - {"inference", "training"}:
      parser.error("--items-per-group takes the inference and training parts only")
    config = config.with_groups(8, 2) if args.small else config.with_groups(64, 16)
  model = Ranker(config, rngs=nnx.Rngs(0))
  payload = dict(**common.metadata(), config=str(config), iterations=args.iterations)

  def record(part: str, result) -> None:
    # Written after every part: a run cut short by its time limit keeps what it measured.
    payload[part] = result
    common.write_json(args.out, payload)

  if "inference" in args.parts:
    record("inference", inference(model, config, sizes, ratios, args.iterations,
                                  per_group or 8))
  if "training" in args.parts:
    record("training", training(config, *train_at, args.iterations, per_group or 8))
  if "checkpoint" in args.parts:
    record("checkpoint", checkpoint_cost(config, *train_at, small=args.small))
  if {"serving", "cache"} & set(args.parts):
    ladder = Ladder.draw(config, mean, rates, args.requests_per_rate, args.seconds_per_rate)
  if "serving" in args.parts:
    record("serving", serving(model, config, ladder, budget_ms, args.buckets,
                              args.max_in_flight, args.repeats))
  if "cache" in args.parts:
    record("split", split_device_time(model, config, (256, 1024) if not args.small else (64,),
                                      (10, 70) if not args.small else (8,), args.iterations))
    budgets = args.cache_mb or ((1.0, 8.0) if args.small else (512.0, 8192.0))
    record("cache", cache_serving(model, config, ladder, budget_ms, args.buckets,
                                  args.max_in_flight, budgets,
                                  on_budget=lambda so_far: record("cache", so_far)))
  if "overload" in args.parts:
    # Past the rate each build sustained: measured by the serving part, or given.
    if "serving" in payload and args.repeats:
      sustained = {b: payload["serving"][b]["sustained_qps"] for b in BUILDS}
    elif args.sustained:
      sustained = dict(zip(BUILDS, args.sustained))
    else:
      parser.error("the overload part needs the serving part's ladders or --sustained")
    payload["overload"] = {}
    for build, result in _overload(args, config, mean, budget_ms, sustained):
      payload["overload"][build] = result
      record("overload", payload["overload"])
  common.write_json(args.out, payload)


def _overload(args, config, mean: float, budget_ms: float, sustained: dict):
  """(build, its overload run) for each build, at `--overload-factor` times its sustained rate."""
  seconds = args.overload_seconds or (2.0 if args.small else 60.0)
  gen = ClickGenerator(config, seed=4, mean_candidates=mean, max_candidates=int(4 * mean))
  # A pool the clients cycle through: a minute's distinct bodies would not fit in memory.
  top = args.overload_factor * max(sustained.values()) * seconds
  trace = serving_trace(gen, min(args.overload_pool, int(top) + 1), processes=os.cpu_count())
  preset = "small" if args.small else "benchmark"
  expected = reference_scores(PRESETS[preset](), trace)  # what either build's server answers
  for build in BUILDS:
    qps = args.overload_factor * sustained[build]
    # The deadline is three quarters of the budget (the rest is for the call that answers),
    # the queue bound what the server drains in that time at its sustained rate: what
    # would be answered too late is refused instead.
    wait_ms = 0.75 * budget_ms
    queue = max(int(sustained[build] * mean * wait_ms / 1e3), int(8 * mean))
    server_args = ["--max-queued-candidates", str(queue), "--timeout-ms", str(wait_ms),
                   "--http-processes", str(args.http_processes)]
    yield build, dict(sustained_qps=sustained[build], **overload(
        preset, build, trace, qps, seconds,
        args.client_processes or (1 if args.small else 4), mean, server_args,
        args.content_type, expected))


if __name__ == "__main__":
  main()
