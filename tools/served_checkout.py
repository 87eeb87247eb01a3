"""The command line's server from a checkout, started for a hostile-client measurement.

`tools/idle_connections.py` and `tools/sigterm_under_load.py` measure a checkout's real
server (`python -m ikbo_jax.serving`, small preset, random weights), that one or another
(`--src`, to measure the code before a change in the same run).
"""

from __future__ import annotations

import collections
import os
import statistics
import subprocess
import sys
import time

import httpx


def start(src: str, port: int, server_args: tuple[str, ...] = ()) -> subprocess.Popen:
  """The server of checkout `src` on loopback `port` (with `server_args`), once it is ready."""
  env = dict(os.environ, PYTHONPATH=os.path.abspath(src), JAX_PLATFORMS="cpu")
  server = subprocess.Popen([sys.executable, "-m", "ikbo_jax.serving", "--port", str(port),
                             *server_args],
                            cwd=src, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
  with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
    deadline = time.time() + 300
    while time.time() < deadline:
      try:
        if client.get("/health/ready").status_code == 200:
          return server
      except httpx.TransportError:
        pass
      time.sleep(0.5)
  server.terminate()
  raise RuntimeError(f"the server of {src} was not ready within 300 s")


def score_and_probe(port: int, body: bytes, content_type: str, count: int,
                    client_address: str = "127.0.0.1", prober_address: str = "127.0.0.1") -> dict:
  """`count` real `POST /score` requests, one at a time, each followed by a `GET /health/live`
  (from the given loopback addresses): their statuses and the health checks' latency."""
  url = f"http://127.0.0.1:{port}"
  scores, health, health_ms = collections.Counter(), collections.Counter(), []
  with httpx.Client(base_url=url, timeout=10,
                    transport=httpx.HTTPTransport(local_address=client_address)) as client, \
       httpx.Client(base_url=url, timeout=10,
                    transport=httpx.HTTPTransport(local_address=prober_address)) as prober:
    for _ in range(count):
      try:
        scores[client.post("/score", content=body,
                           headers={"content-type": content_type}).status_code] += 1
      except httpx.TransportError as e:
        scores[type(e).__name__] += 1
      start = time.perf_counter()
      try:
        health[prober.get("/health/live").status_code] += 1
      except httpx.TransportError as e:
        health[type(e).__name__] += 1
      health_ms.append(1e3 * (time.perf_counter() - start))
  return dict(score_statuses=dict(scores), health_statuses=dict(health),
              health_ms_p50=statistics.median(health_ms), health_ms_max=max(health_ms))
