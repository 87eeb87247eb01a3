"""What the hop to the model process costs a request (`--http-processes N`), on this host's CPU.

    python -m benchmarks.model_process_cost --out model_process_cost.json

Per request of the benchmark preset (64 candidates): encoding and decoding its
frame (`serving.frames`) against a pickle of the same message and against
decoding its msgpack body (what an HTTP process spends anyway); then a lone
request's round trip through a `Batcher` in this process against one through
a `ModelServer` on a Unix socket, with a scorer that returns at once, so that
only the batching and the hop are timed. Medians of `--iterations`.

With `--rates`, the model process's own cost under load: a `ModelServer` in a
process of its own serving a `DeviceStub` (`--stub`, the H100's device times by
default), fed by this process through a `RemoteBatcher` (an HTTP process's
stand-in, without HTTP) at each Poisson rate for `--seconds`: the model
process's CPU per answered request (/proc; its model threads wait on the stub's
clock, so this is its event loop's work: frames, the batcher, replies) and the
latency through it. Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import pickle
import time

import numpy as np
import uvloop

from benchmarks import common
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.models import Build
from ikbo_jax.models.config import PRESETS
from ikbo_jax.serving import Bucket, bodies, frames
from ikbo_jax.serving.batcher import Batcher, BatchingConfig
from ikbo_jax.serving.buckets import default_buckets
from ikbo_jax.serving.launch import tune_gc
from ikbo_jax.serving.load import run_load
from ikbo_jax.serving.model_server import ModelServer
from ikbo_jax.serving.remote import RemoteBatcher
from ikbo_jax.serving.stub import DeviceStub

# As `benchmarks/http_front.py` serves: batches of up to 32 requests, a 15 ms deadline.
_BATCHING = BatchingConfig(max_batch_requests=32, max_queued_candidates=70 * 192,
                           default_timeout_ms=15.0)


class InstantScorer:
  """Scores of zeros, at once: the batching and the hop are all that is timed."""

  build = Build.IKBO

  def __init__(self, config):
    self.config = config
    self.buckets = (Bucket(4096, 64, config.max_history),)

  @property
  def largest(self):
    return self.buckets[-1]

  def bucket_for(self, requests):
    return self.largest

  def __call__(self, requests):
    return [np.zeros(r.num_candidates, np.float32) for r in requests]


def median_us(fn, iterations: int) -> float:
  times = []
  for _ in range(iterations):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return 1e6 * float(np.median(times))


async def round_trips_us(score, requests) -> float:
  for r in requests[:50]:  # warm-up
    await score(r)
  times = []
  for r in requests:
    start = time.perf_counter()
    await score(r)
    times.append(time.perf_counter() - start)
  return 1e6 * float(np.median(times))


async def lone_requests(config, requests) -> dict:
  async with Batcher(InstantScorer(config), BatchingConfig()) as batcher:
    local = await round_trips_us(batcher.score, requests)
  path = frames.private_socket_path()
  server = ModelServer(path, lambda: InstantScorer(config), BatchingConfig())
  serving = asyncio.create_task(server.serve())
  try:
    async with RemoteBatcher(path, BatchingConfig()) as remote:
      await remote.ready()
      hop = await round_trips_us(remote.score, requests)
  finally:
    server.stop()
    await serving
  return dict(in_process_us=local, via_model_process_us=hop, hop_us=hop - local)


def _stub_buckets(config):
  return default_buckets(config, max_batch_requests=_BATCHING.max_batch_requests,
                         mean_candidates=70.0)


def serve_stub(path: str, device_ms: tuple[float, float]) -> None:
  """A model process serving a `DeviceStub` on `path` (the entry of a spawned process)."""
  config = PRESETS["benchmark"]()
  server = ModelServer(path, lambda: DeviceStub(config, _stub_buckets(config), device_ms),
                       _BATCHING)
  tune_gc()
  uvloop.run(server.serve())


async def _load_rows(path: str, pid: int, requests, rates, seconds: float) -> list[dict]:
  rows = []
  async with RemoteBatcher(path, _BATCHING) as remote:
    await remote.ready()
    await asyncio.gather(*(remote.score(r) for r in requests[:64]))  # warm-up
    for rate in rates:
      cpu = common.process_tree_cpu_seconds([pid])
      stats = await run_load(remote.score, requests, qps=rate, max_seconds=seconds)
      stats["model_process_cpu_ms_per_request"] = (
          1e3 * (common.process_tree_cpu_seconds([pid]) - cpu) / max(stats["answered"], 1))
      print(f"  {rate:.0f}/s: answered {stats['achieved_qps']:.0f}/s, p50 "
            f"{stats['p50_ms']:.2f} ms, p99 {stats['p99_ms']:.2f} ms, errors "
            f"{stats['errors_by_kind']}, model process CPU "
            f"{stats['model_process_cpu_ms_per_request']:.3f} ms a request", flush=True)
      rows.append(stats)
  return rows


def model_process_load(config, rates, seconds: float, device_ms) -> list[dict]:
  """The model process's CPU per request and latency at each rate (see the docstring)."""
  gen = ClickGenerator(config, seed=4, mean_candidates=70, max_candidates=280)
  pool = [r.validated(config) for r in gen.requests(2000)]
  requests = (pool * -(-int(max(rates) * seconds + 1) // len(pool)))
  path = frames.private_socket_path()
  process = multiprocessing.get_context("spawn").Process(target=serve_stub,
                                                         args=(path, tuple(device_ms)))
  process.start()
  try:
    while not os.path.exists(path):
      if not process.is_alive():
        raise RuntimeError(f"the model process exited with {process.exitcode} before it listened")
      time.sleep(0.05)
    tune_gc()
    return uvloop.run(_load_rows(path, process.pid, requests, rates, seconds))
  finally:
    process.terminate()
    process.join()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--iterations", type=int, default=2000)
  parser.add_argument("--rates", type=float, nargs="*", default=[],
                      help="the model process under load at these rates (requests/s)")
  parser.add_argument("--seconds", type=float, default=5.0, help="per rate")
  parser.add_argument("--stub", type=float, nargs=2, default=[0.232, 1.057],
                      metavar=("FIRST_MS", "LAST_MS"), help="the device stub's times")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  config = PRESETS["benchmark"]()
  requests = ClickGenerator(config, seed=1, mean_candidates=70, max_candidates=280).requests(
      args.iterations // 4)
  request = requests[0]
  message = ("score", 7, request, 10.0, False)
  frame, pickled = frames.encode(message)[4:], pickle.dumps(message, protocol=5)
  body = bodies.encode(request, bodies.MSGPACK)
  codec = dict(
      candidates=request.num_candidates, frame_bytes=len(frame), body_bytes=len(body),
      frame_encode_us=median_us(lambda: frames.encode(message), args.iterations),
      frame_decode_us=median_us(lambda: frames.decode(frame), args.iterations),
      pickle_encode_us=median_us(lambda: pickle.dumps(message, protocol=5), args.iterations),
      pickle_decode_us=median_us(lambda: pickle.loads(pickled), args.iterations),
      msgpack_body_decode_us=median_us(
          lambda: bodies.decode(bodies.MSGPACK, body, config, 8192), args.iterations))
  print(codec, flush=True)
  lone = uvloop.run(lone_requests(config, requests))  # the loop both servers run
  print(lone, flush=True)
  payload = dict(**common.metadata(), codec=codec, lone_request=lone)
  common.write_json(args.out, payload)
  if args.rates:
    payload.update(stub_ms=args.stub, batching=str(_BATCHING),
                   load=model_process_load(config, args.rates, args.seconds, args.stub))
    common.write_json(args.out, payload)


if __name__ == "__main__":
  main()
