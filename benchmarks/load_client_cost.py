"""What the load generator's client costs per request: `http_wire.WirePool` against aiohttp.

    python -m benchmarks.load_client_cost --out load_client_cost.json

Starts this library's server (one process, a `DeviceStub` of the H100's device
times) and sends it the Zipf trace's msgpack bodies open loop at each `--rates`
from one client process, once through each client, alternating, `--repeats`
times: the client process's CPU time per answered request (its event loop
alone: the server runs in other processes), the answers, and the latency it
saw. A load generator on the server's host takes that CPU from the server, and
the delays of its event loop count as the server's latency.
"""

from __future__ import annotations

import argparse
import time

import aiohttp
import numpy as np
import uvloop

from benchmarks import common, http_ladder
from ikbo_jax.models.config import PRESETS
from ikbo_jax.serving import bodies, http_wire
from ikbo_jax.serving.load import Refused, drive, summarize

_STUB_MS = (0.232, 1.057)


async def _wire(url: str, payloads, counts, rate: float, seconds: float):
  pool = http_wire.WirePool.to(url, connections=256)

  async def send(body: bytes):
    status, _, _ = await pool.request("/score", body, {"content-type": bodies.MSGPACK})
    if status != 200:
      raise Refused(str(status))

  try:
    return await drive(send, payloads, qps=rate, candidates=counts, max_seconds=seconds)
  finally:
    await pool.close()


async def _aiohttp(url: str, payloads, counts, rate: float, seconds: float):
  connector = aiohttp.TCPConnector(limit=256, keepalive_timeout=1.0)
  async with aiohttp.ClientSession(url, connector=connector) as session:
    async def send(body: bytes):
      try:
        async with session.post("/score", data=body,
                                headers={"content-type": bodies.MSGPACK}) as response:
          await response.read()
          if response.status != 200:
            raise Refused(str(response.status))
      except aiohttp.ClientError as e:
        raise Refused(type(e).__name__) from None

    return await drive(send, payloads, qps=rate, candidates=counts, max_seconds=seconds)


_CLIENTS = {"wire": _wire, "aiohttp": _aiohttp}


def measure(client: str, url: str, payloads, counts, rate: float, seconds: float) -> dict:
  cpu = time.process_time()
  tally = uvloop.run(_CLIENTS[client](url, payloads, counts, rate, seconds))
  stats = summarize([tally], rate)
  stats["client_cpu_ms_per_request"] = (
      1e3 * (time.process_time() - cpu) / max(stats["answered"], 1))
  return stats


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rates", type=float, nargs="+", default=[250, 500, 1000])
  parser.add_argument("--seconds", type=float, default=4.0)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--mean-candidates", type=float, default=70.0)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  config = PRESETS["benchmark"]()
  requests = http_ladder.trace(config, args.mean_candidates, 2000)
  payloads = [bodies.encode(r, bodies.MSGPACK) for r in requests]
  counts = [r.num_candidates for r in requests]
  rows = []
  server = http_ladder.server_args(args.mean_candidates, 192, 20.0, 32, stub=_STUB_MS)
  payload = dict(**common.metadata(), stub_ms=_STUB_MS, seconds=args.seconds, rows=rows)
  with http_ladder.serving("benchmark", 1, False, args.mean_candidates, server) as (urls, _):
    for client in _CLIENTS:  # warm-up: the server's first batches and each client's imports
      measure(client, urls[0], payloads, counts, 200, 1.0)
    for repeat in range(args.repeats):
      for rate in args.rates:
        for client in _CLIENTS:
          stats = measure(client, urls[0], payloads, counts, rate, args.seconds)
          rows.append(dict(client=client, repeat=repeat, rate=rate, **stats))
          print(f"{client:>8} {rate:.0f}/s: client CPU {stats['client_cpu_ms_per_request']:.3f}"
                f" ms a request, answered {stats['achieved_qps']:.0f}/s, p50 "
                f"{stats['p50_ms']:.2f} ms, p99 {stats['p99_ms']:.2f} ms, errors "
                f"{stats['errors_by_kind']}", flush=True)
          common.write_json(args.out, payload)
  for client in _CLIENTS:
    cost = [r["client_cpu_ms_per_request"] for r in rows if r["client"] == client]
    print(f"{client}: client CPU a request, median {np.median(cost):.3f} ms", flush=True)


if __name__ == "__main__":
  main()
