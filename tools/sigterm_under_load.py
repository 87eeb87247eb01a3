"""SIGTERM to the real server under load: is every connection a client opened answered?

    python tools/sigterm_under_load.py --clients 64 --out sigterm.json

Starts `python -m ikbo_jax.serving` (small preset, random weights) on a loopback port, waits
until it is ready, then `--clients` threads each send requests on fresh connections, one after
another (a client per connection, as independent callers are), and after `--after` seconds the
server gets SIGTERM. Each connection ends as an answer (by status), as refused (the port closed:
expected once the server stopped listening) or as reset / closed without an answer (what a
graceful shutdown must not do to a connection it had queued). `--src` runs another checkout.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import socket
import sys
import threading
import time

import served_checkout


def _one(port: int, request: bytes) -> str:
  try:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
      conn.sendall(request)
      reply = conn.recv(64)
  except ConnectionRefusedError:
    return "refused"
  except (ConnectionResetError, BrokenPipeError):
    return "reset"
  except TimeoutError:
    return "timeout"
  return reply[9:12].decode() if reply.startswith(b"HTTP/1.1 ") else "closed_unanswered"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--clients", type=int, default=64)
  parser.add_argument("--after", type=float, default=5.0, help="seconds of load before SIGTERM")
  parser.add_argument("--src", default=".", help="the checkout whose server runs")
  parser.add_argument("--http-processes", type=int, default=1, help="the server's")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  sys.path.insert(0, os.path.abspath(args.src))
  from ikbo_jax.data.synthetic import ClickGenerator
  from ikbo_jax.models import RankerConfig
  from ikbo_jax.serving import bodies
  from ikbo_jax.testing.loopback import free_port

  port = free_port()
  server = served_checkout.start(args.src, port,
                                 ("--http-processes", str(args.http_processes)))
  body = bodies.encode(ClickGenerator(RankerConfig(), seed=0).request(0))
  request = (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
  outcomes, lock, stopped = collections.Counter(), threading.Lock(), threading.Event()

  def client_loop():
    while True:
      outcome = _one(port, request)
      with lock:
        outcomes[outcome] += 1
      if outcome == "refused" and stopped.is_set():
        return

  threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(args.clients)]
  for t in threads:
    t.start()
  time.sleep(args.after)
  with lock:
    before_signal = dict(outcomes)
  server.send_signal(signal.SIGTERM)
  stopped.set()
  for t in threads:
    t.join(timeout=60)
  exit_code = server.wait(timeout=60)
  result = dict(clients=args.clients, http_processes=args.http_processes, before_sigterm=before_signal, all=dict(outcomes),
                lost=sum(n for k, n in outcomes.items()
                         if k in ("reset", "closed_unanswered", "timeout")),
                server_exit=exit_code)
  print(json.dumps(result))
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
