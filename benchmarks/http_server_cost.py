"""The HTTP server's own CPU per `POST /score`: parsing, validation, batching, the response.

    python -m benchmarks.http_server_cost --out http_server_cost.json [--small]

Starts the server (`serving.http.create_app` under uvicorn with the command
line's protocol) in its own process around a null scorer: it packs each batch
into the bucket's host buffer like `BucketedModel` and answers zeros, so no
model time hides the host's. One client process then sends bodies of the
preset's request trace (`--content-type`, JSON or msgpack) with `--concurrency`
requests outstanding, and the
server's CPU time (user + system, from /proc) over the run divided by the
requests answered is its cost per request: the rate one server process can
take at most is its inverse. Linux only (/proc).

With `--overload FACTOR` the same server (its deadline `--timeout-ms`) is then
offered FACTOR times that ceiling for `--seconds` from one open-loop client of
`--connections` connections: answers, refusals by status, resets, the
client's p99 and the server's own for the requests it answered.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import timeit

import aiohttp
import msgspec
import numpy as np
import uvloop
from starlette.responses import JSONResponse

from benchmarks import common
from ikbo_jax.data import pack_requests
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.data.trace import serving_trace
from ikbo_jax.models import Build, RankerConfig
from ikbo_jax.serving.buckets import bucket_holding, default_buckets, smallest_fitting
from benchmarks.serving_load import server_metrics, wait_ready
from ikbo_jax.serving import bodies, http_load
from ikbo_jax.serving.transfer import FlatLayout
from ikbo_jax.testing import loopback


class NullScorer:
  """A `Scorer` that packs each batch as `BucketedModel` does and scores every candidate 0."""

  build = Build.IKBO

  def __init__(self, config: RankerConfig, mean_candidates: float):
    self.config = config
    self.buckets = tuple(default_buckets(config, mean_candidates=mean_candidates))
    self._views = {b: FlatLayout.of(config, b.num_users, b.num_candidates,
                                    b.history_slots).host_buffer()[1] for b in self.buckets}

  @property
  def largest(self):
    return self.buckets[-1]

  def bucket_for(self, requests):
    return smallest_fitting(self.buckets, requests)

  def __call__(self, requests):
    bucket = bucket_holding(self.buckets, requests)
    pack_requests(requests, self.config, num_users=bucket.num_users,
                  num_candidates=bucket.num_candidates, history_slots=bucket.history_slots,
                  out=self._views[bucket])
    return [np.zeros(r.num_candidates, np.float32) for r in requests]


def _config(small: bool) -> tuple[RankerConfig, float]:
  return (RankerConfig(), 8.0) if small else (RankerConfig.benchmark(), 70.0)


def _serve(port: int, small: bool, timeout_ms: float) -> None:
  import uvicorn

  from ikbo_jax.serving.batcher import BatchingConfig
  from ikbo_jax.serving.http import create_app
  from ikbo_jax.serving.protocol import guarded_http

  app = create_app(NullScorer(*_config(small)), BatchingConfig(default_timeout_ms=timeout_ms))
  uvicorn.run(app, host="127.0.0.1", port=port, http=guarded_http(10.0), log_level="warning")


def _cpu_seconds(pid: int) -> float:
  fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _send_all(url: str, payloads: list[bytes], content_type: str, count: int,
                    concurrency: int, server_pid: int) -> dict:
  connector = aiohttp.TCPConnector(limit=concurrency)
  async with aiohttp.ClientSession(url, connector=connector,
                                   timeout=aiohttp.ClientTimeout(total=60)) as session:
    outstanding, statuses = asyncio.Semaphore(concurrency), {}

    async def one(i: int) -> None:
      async with outstanding:
        async with session.post("/score", data=payloads[i % len(payloads)],
                                headers={"content-type": content_type}) as response:
          await response.read()
          statuses[response.status] = statuses.get(response.status, 0) + 1

    await asyncio.gather(*(one(i) for i in range(min(count, 200))))  # warm, off the clock
    statuses.clear()
    cpu, start = _cpu_seconds(server_pid), time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(count)))
    seconds, cpu = time.perf_counter() - start, _cpu_seconds(server_pid) - cpu
  return dict(requests=count, statuses=statuses, seconds=seconds, rate=count / seconds,
              server_cpu_ms_per_request=1e3 * cpu / count,
              server_ceiling_per_s=count / cpu if cpu else None)


def _overload(url: str, trace, args, qps: float) -> dict:
  stats = http_load.over_http(url, trace, qps=qps, max_seconds=args.seconds, cycle=True,
                              connections=args.connections, content_type=args.content_type)
  stats.update(server_metrics(url))
  print(f"offered {qps:.0f}/s (sent {stats['sent_qps']:.0f}/s) for {args.seconds:.0f} s: "
        f"{stats['answered']} answered, {stats['errors_by_kind']}; p99 {stats['p99_ms']:.0f} ms "
        f"(server <= {stats['server_p99_ms_at_most']:.0f} ms)", flush=True)
  return stats


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out")
  parser.add_argument("--small", action="store_true", help="the CPU default model's requests")
  parser.add_argument("--requests", type=int, default=2000)
  parser.add_argument("--concurrency", type=int, default=16)
  parser.add_argument("--content-type", choices=bodies.CONTENT_TYPES, default=bodies.JSON)
  parser.add_argument("--overload", type=float, metavar="FACTOR",
                      help="then offer FACTOR times the measured ceiling")
  parser.add_argument("--seconds", type=float, default=15.0, help="overload: how long")
  parser.add_argument("--connections", type=int, default=2000, help="overload: client's")
  parser.add_argument("--timeout-ms", type=float, default=15.0,
                      help="the server's request deadline")
  parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.serve:
    return _serve(args.serve, args.small, args.timeout_ms)
  if not args.out:
    parser.error("--out is required")
  config, mean = _config(args.small)
  trace = serving_trace(ClickGenerator(config, seed=3, mean_candidates=mean,
                                       max_candidates=int(4 * mean)), 200)
  payloads = [bodies.encode(r, args.content_type) for r in trace]
  port = loopback.free_port()
  log = tempfile.TemporaryFile()
  server = subprocess.Popen([sys.executable, "-m", "benchmarks.http_server_cost",
                             "--serve", str(port), "--timeout-ms", str(args.timeout_ms),
                             *(["--small"] if args.small else [])],
                            stdout=log, stderr=subprocess.STDOUT)
  url = f"http://127.0.0.1:{port}"
  try:
    wait_ready(url, server, log, 120)
    row = uvloop.run(_send_all(url, payloads, args.content_type, args.requests,
                               args.concurrency, server.pid))
    if args.overload:
      row["overload"] = _overload(url, trace, args, args.overload * row["server_ceiling_per_s"])
  finally:
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=60)
    log.close()
  row.update(answer_encoding_us=_answer_encoding_us(mean),
             timeout_ms=args.timeout_ms, content_type=args.content_type,
             mean_body_bytes=float(np.mean([len(p) for p in payloads])),
             concurrency=args.concurrency, cpus=os.cpu_count())
  print(f"{row['requests']} requests {row['statuses']}, {args.content_type} bodies of "
        f"{row['mean_body_bytes']:.0f} bytes: server CPU {row['server_cpu_ms_per_request']:.3f} "
        f"ms per request (at most {row['server_ceiling_per_s']:.0f}/s per process), "
        f"{row['rate']:.0f}/s here", flush=True)
  common.write_json(args.out, dict(**common.metadata(), config=str(config), **row))


def _answer_encoding_us(mean: float) -> dict[str, float]:
  """Building one answer of `mean` scores: starlette's `JSONResponse` (the standard
  library's `json.dumps`) against the server's (`msgspec.json.encode`), best of five,
  microseconds."""
  content = {"scores": np.random.default_rng(0).random(int(mean), np.float32).tolist()}
  encoders = {"JSONResponse": JSONResponse, "msgspec": msgspec.json.encode}
  return {name: 1e6 * min(timeit.repeat(lambda: encode(content), number=2000, repeat=5)) / 2000
          for name, encode in encoders.items()}


if __name__ == "__main__":
  main()
