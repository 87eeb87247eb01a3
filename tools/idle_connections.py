"""A hostile client's idle connections against the real server: are real requests still served?

    python tools/idle_connections.py --idle 2100 --out idle.json

Starts `python -m ikbo_jax.serving` (small preset, random weights) on a loopback port, waits
until it is ready, opens `--idle` connections that never send a byte, then sends `--requests`
real `POST /score` requests and as many `GET /health/live`, one at a time, and counts their
statuses and the health checks' latency. `--src` runs another checkout's server (to measure the
code before a change in the same run).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import served_checkout


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--idle", type=int, default=2100)
  parser.add_argument("--requests", type=int, default=100)
  parser.add_argument("--src", default=".", help="the checkout whose server runs")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  sys.path.insert(0, os.path.abspath(args.src))
  from ikbo_jax.data.synthetic import ClickGenerator
  from ikbo_jax.models import RankerConfig
  from ikbo_jax.serving import bodies
  from ikbo_jax.testing.loopback import free_port

  port = free_port()
  server = served_checkout.start(args.src, port)
  try:
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(args.idle)]
    time.sleep(1.0)  # the server has accepted them
    body = bodies.encode(ClickGenerator(RankerConfig(), seed=0).request(0))
    probed = served_checkout.score_and_probe(port, body, bodies.JSON, args.requests)
    for conn in idle:
      conn.close()
  finally:
    server.terminate()
    server.wait(timeout=60)
  result = dict(idle_connections=args.idle, **probed)
  print(json.dumps(result))
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
