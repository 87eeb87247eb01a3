"""What the hop to the model process costs a request (`--http-processes N`), on this host's CPU.

    python -m benchmarks.model_process_cost --out model_process_cost.json

Per request of the benchmark preset (64 candidates): encoding and decoding its
frame (`serving.frames`) against a pickle of the same message and against
decoding its msgpack body (what an HTTP process spends anyway); then a lone
request's round trip through a `Batcher` in this process against one through
a `ModelServer` on a Unix socket, with a scorer that returns at once, so that
only the batching and the hop are timed. Medians of `--iterations`.
"""

from __future__ import annotations

import argparse
import asyncio
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
from ikbo_jax.serving.model_server import ModelServer
from ikbo_jax.serving.remote import RemoteBatcher


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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--iterations", type=int, default=2000)
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
  common.write_json(args.out, dict(**common.metadata(), codec=codec, lone_request=lone))


if __name__ == "__main__":
  main()
