"""Load: a Poisson request stream at a target rate against any scorer, and its latency percentiles.

`run_load` drives one async `score(request)` open loop (Poisson arrivals,
never waiting for answers) and counts failures by kind; `compare_builds`
serves both builds of one model (IKBO and standard) through the batcher in
turn; `http_load.over_http` drives a running server from several processes.
`python -m ikbo_jax.serving.loadgen` is the command line over them.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence

import numpy as np
import uvloop

from ikbo_jax.data import Request, RequestError
from ikbo_jax.models import Build, Ranker
from ikbo_jax.serving import stages
from ikbo_jax.serving.batcher import Batcher, BatchingConfig, DeadlineExceeded, Overloaded
from ikbo_jax.serving.buckets import Bucket, BucketedModel, default_buckets


class Refused(Exception):
  """The request got no scores; `kind` says why: the status the server answered with, or
  the type of the connection's failure (a reset, say)."""

  def __init__(self, kind: str):
    super().__init__(kind)
    self.kind = kind


@dataclasses.dataclass
class Tally:
  """What one open-loop client saw (several clients' tallies merge in `summarize`)."""

  latencies_ms: list[float] = dataclasses.field(default_factory=list)  # of answered requests
  errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  sent: int = 0
  candidates: int = 0
  seconds: float = 0.0
  last_arrival: float = 0.0  # the schedule's last send time
  last_sent: float = 0.0  # when the last request actually went out
  max_lag: float = 0.0  # the longest a send ran behind its schedule
  # Per answered request, its stages in ms (`serving.stages`), where the server sent them.
  stage_rows: list[dict[str, float]] = dataclasses.field(default_factory=list)


def _kind(error: Exception) -> str:
  """How a request failed: the refusal's kind, or the exception's type (resets, timeouts)."""
  kinds = {RequestError: "bad_request", Overloaded: "overloaded", DeadlineExceeded: "deadline"}
  if isinstance(error, Refused):
    return error.kind
  return next((k for t, k in kinds.items() if isinstance(error, t)), type(error).__name__)


async def drive(send: Callable[[object], Awaitable], items: Sequence, *, qps: float,
                candidates: Sequence[int], seed: int = 0, max_seconds: float = 60.0) -> Tally:
  """Sends each item at Poisson arrivals of rate `qps` (open loop: never waits for answers)."""
  gaps = np.random.default_rng(seed).exponential(1.0 / qps, size=len(items))
  loop = asyncio.get_running_loop()
  start, tally = loop.time(), Tally()

  async def one(item) -> None:
    sent = time.perf_counter()
    try:
      await send(item)
    except (RequestError, Overloaded, DeadlineExceeded, Refused,
            OSError) as e:  # counted by kind (timeouts are OSErrors); the run goes on
      tally.errors[_kind(e)] += 1
    else:
      tally.latencies_ms.append((time.perf_counter() - sent) * 1e3)

  tasks = []
  for item, count, arrival in zip(items, candidates, np.cumsum(gaps)):
    if arrival > max_seconds:
      break
    await asyncio.sleep(max(start + arrival - loop.time(), 0))
    tally.max_lag = max(tally.max_lag, loop.time() - start - arrival)
    tasks.append(asyncio.create_task(one(item)))
    tally.sent, tally.last_arrival = tally.sent + 1, float(arrival)
    tally.last_sent = loop.time() - start
    tally.candidates += int(count)
  await asyncio.gather(*tasks)
  tally.seconds = loop.time() - start
  return tally


def summarize(tallies: Sequence[Tally], qps: float) -> dict:
  """Latency percentiles and counts over the tallies of clients that ran side by side."""
  latencies = [x for t in tallies for x in t.latencies_ms]
  errors = sum((t.errors for t in tallies), collections.Counter())
  sent, elapsed = sum(t.sent for t in tallies), max(t.seconds for t in tallies)
  last_arrival = max(t.last_arrival for t in tallies)
  p50, p90, p99 = (np.percentile(latencies, (50, 90, 99)) if latencies else (np.nan,) * 3)
  # The realized rate of this finite Poisson draw: what "keeping up" is judged against.
  offered = sent / last_arrival if last_arrival > 0 else float(sent)
  # What went out: below `offered` when the client itself fell behind its schedule.
  last_sent = max(t.last_sent for t in tallies)
  sent_qps = sent / last_sent if last_sent > 0 else float(sent)
  rows = [row for t in tallies for row in t.stage_rows]
  return dict(target_qps=qps, offered_qps=offered, sent_qps=sent_qps,
              **({"stages": stages.summarize(rows)} if rows else {}),
              max_send_lag_ms=1e3 * max(t.max_lag for t in tallies), requests=sent,
              answered=len(latencies),
              errors=sum(errors.values()), errors_by_kind=dict(errors),
              candidates=sum(t.candidates for t in tallies), seconds=elapsed,
              achieved_qps=len(latencies) / elapsed, p50_ms=float(p50), p90_ms=float(p90),
              p99_ms=float(p99), mean_ms=float(np.mean(latencies)) if latencies else np.nan)


async def run_load(score: Callable[[Request], Awaitable], requests: Sequence[Request], *,
                   qps: float, seed: int = 0, max_seconds: float = 60.0) -> dict:
  """Sends `requests` to `score` at Poisson arrivals of rate `qps`; stats of the answers."""
  tally = await drive(score, requests, qps=qps, seed=seed, max_seconds=max_seconds,
                      candidates=[r.num_candidates for r in requests])
  return summarize([tally], qps)


def format_row(name: str, stats: dict) -> str:
  """One line per run: what was sent, what came back, and how fast.

  The rate is answers over the whole run, which includes waiting for the last
  answers after the last request was sent, so it reads below the offered rate
  even when every request is answered.
  """
  kinds = ", ".join(f"{n} {kind}" for kind, n in stats.get("errors_by_kind", {}).items())
  row = (f"{name:>9}: {stats['requests']} requests sent at {stats['sent_qps']:.0f}/s "
         f"(target {stats['target_qps']:.0f}/s), {stats['answered']} answered"
         f"{f' ({kinds})' if kinds else ''} in {stats['seconds']:.1f} s; latency "
         f"p50 {stats['p50_ms']:.1f} ms, p90 {stats['p90_ms']:.1f} ms, "
         f"p99 {stats['p99_ms']:.1f} ms")
  if stats["sent_qps"] < 0.9 * stats["offered_qps"]:
    row += (f"; the load generator fell behind its schedule (up to "
            f"{stats['max_send_lag_ms']:.0f} ms): its latencies include its own delay")
  return row


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
    results[build] = uvloop.run(_serve_load(served, list(requests), batching, qps, max_seconds))
    results[build].update(compile_seconds=compile_s,
                          buckets=[(b.num_candidates, b.num_users, b.history_slots)
                                   for b in served.buckets])
  return results
