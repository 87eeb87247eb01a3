"""Load: a Poisson request stream at a target rate against any scorer, and its latency percentiles.

`run_load` drives one async `score(request)`; `compare_builds` serves both
builds of one model (IKBO and standard) through the batcher in turn;
`over_http` drives a running server. `python -m ikbo_jax.serving.loadgen` is
the command line over them.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, Sequence

import httpx
import numpy as np

from ikbo_jax.data import Request, RequestError
from ikbo_jax.models import Build, Ranker
from ikbo_jax.serving.batcher import Batcher, BatchingConfig, DeadlineExceeded, Overloaded
from ikbo_jax.serving.buckets import Bucket, BucketedModel, default_buckets


class Refused(Exception):
  """The server answered without scores; `kind` says how (the HTTP status)."""

  def __init__(self, kind: str):
    super().__init__(kind)
    self.kind = kind


async def run_load(score: Callable[[Request], Awaitable], requests: Sequence[Request], *,
                   qps: float, seed: int = 0, max_seconds: float = 60.0) -> dict:
  """Sends `requests` at Poisson arrivals of rate `qps`; latency stats of those answered."""
  gaps = np.random.default_rng(seed).exponential(1.0 / qps, size=len(requests))
  loop = asyncio.get_running_loop()
  start = loop.time()
  latencies, errors = [], collections.Counter()

  async def one(request: Request) -> None:
    sent = time.perf_counter()
    try:
      await score(request)
    except RequestError:
      errors["bad_request"] += 1
    except Overloaded:
      errors["overloaded"] += 1
    except DeadlineExceeded:
      errors["deadline"] += 1
    except Refused as e:
      errors[e.kind] += 1
    except (httpx.HTTPError, OSError) as e:  # resets, timeouts: counted, the run goes on
      errors[type(e).__name__] += 1
    else:
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
              errors=sum(errors.values()), errors_by_kind=dict(errors),
              candidates=int(sum(r.num_candidates for r in sent)), seconds=elapsed,
              achieved_qps=len(latencies) / elapsed, p50_ms=float(p50), p90_ms=float(p90),
              p99_ms=float(p99), mean_ms=float(np.mean(latencies)) if latencies else np.nan)


def format_row(name: str, stats: dict) -> str:
  """One line per run: what was sent, what came back, and how fast.

  The rate is answers over the whole run, which includes waiting for the last
  answers after the last request was sent, so it reads below the offered rate
  even when every request is answered.
  """
  kinds = ", ".join(f"{n} {kind}" for kind, n in stats.get("errors_by_kind", {}).items())
  return (f"{name:>9}: {stats['requests']} requests sent at {stats['offered_qps']:.0f}/s "
          f"(target {stats['target_qps']:.0f}/s), {stats['answered']} answered"
          f"{f' ({kinds})' if kinds else ''} in {stats['seconds']:.1f} s; latency "
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


async def over_http(url: str, requests: Sequence[Request], *, qps: float,
                    max_seconds: float = 60.0) -> dict:
  """`run_load` against the server at `url` (`POST /score`)."""
  async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
    async def score(request: Request):
      body = {f: np.asarray(getattr(request, f)).tolist()
              for f in ("user_dense", "history", "cand_items", "cand_dense")}
      response = await client.post("/score", json=body)
      if response.status_code == 400:
        raise RequestError(response.json()["error"])
      if response.status_code != 200:
        raise Refused(str(response.status_code))
      return response.json()["scores"]
    return await run_load(score, requests, qps=qps, max_seconds=max_seconds)
