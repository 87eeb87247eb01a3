"""Clients trickling request bodies against the real server: are real requests still served?

    python tools/slow_bodies.py --tricklers 300 --requests 590 --out slow_bodies.json

Starts `python -m ikbo_jax.serving` (small preset, random weights) on a loopback port, waits
until it is ready, then keeps `--tricklers` connections from 127.0.0.1 each sending a request
head and then its body a byte every `--byte-every` seconds; a connection the server answers or
closes is opened again (after `--reconnect-after` seconds), as an attacker's would be. Meanwhile
`--requests` real `POST /score` requests from 127.0.0.2 (one at a time), each followed by a
`GET /health/live` from 127.0.0.3, are counted by status, with the health checks' latency.
`--src` runs another checkout's server (to measure the code before a change in the same run).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import threading
import time

import served_checkout

_HEAD = (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
         b"Content-Length: 100000\r\n\r\n")


async def _trickle(port: int, byte_every: float, reconnect_after: float,
                   stop: asyncio.Event, seen: collections.Counter) -> None:
  while not stop.is_set():
    try:
      reader, writer = await asyncio.open_connection("127.0.0.1", port,
                                                     local_addr=("127.0.0.1", 0))
      writer.write(_HEAD)
      while not stop.is_set() and not reader.at_eof():
        writer.write(b" ")
        await writer.drain()
        try:
          reply = await asyncio.wait_for(reader.read(64), byte_every)
        except TimeoutError:
          continue
        seen[reply[9:12].decode() if reply.startswith(b"HTTP/1.1 ") else "closed"] += 1
        break
      writer.close()
    except OSError as e:
      seen[type(e).__name__] += 1
    await asyncio.sleep(reconnect_after)


def _attack(args, port: int, stop: threading.Event, seen: collections.Counter) -> None:
  async def main():
    stopping = asyncio.Event()
    tasks = [asyncio.create_task(_trickle(port, args.byte_every, args.reconnect_after,
                                          stopping, seen)) for _ in range(args.tricklers)]
    while not stop.is_set():
      await asyncio.sleep(0.05)
    stopping.set()
    await asyncio.gather(*tasks, return_exceptions=True)
  asyncio.run(main())


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tricklers", type=int, default=300)
  parser.add_argument("--requests", type=int, default=590)
  parser.add_argument("--byte-every", type=float, default=0.2)
  parser.add_argument("--reconnect-after", type=float, default=0.05)
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
  seen, stop = collections.Counter(), threading.Event()
  attacker = threading.Thread(target=_attack, args=(args, port, stop, seen))
  try:
    attacker.start()
    time.sleep(3.0)  # every trickler connected, the first ones cut and back
    body = bodies.encode(ClickGenerator(RankerConfig(), seed=0).request(0))
    start = time.perf_counter()
    probed = served_checkout.score_and_probe(port, body, bodies.JSON, args.requests,
                                             client_address="127.0.0.2",
                                             prober_address="127.0.0.3")
    took = time.perf_counter() - start
  finally:
    stop.set()
    attacker.join(timeout=30)
    server.terminate()
    server.wait(timeout=60)
  result = dict(tricklers=args.tricklers, byte_every_s=args.byte_every,
                reconnect_after_s=args.reconnect_after, trickler_answers=dict(seen), **probed,
                seconds=took)
  print(json.dumps(result))
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
