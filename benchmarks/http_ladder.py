"""Servers over HTTP for the front benchmarks: start them, send lone requests, climb a ladder.

`benchmarks/http_front.py` (this library's fronts) and `benchmarks/pytriton_front.py` (an
existing engine beside them) share these: `serving` starts this library's server (N HTTP
processes feeding one model process, or N one-process replicas, optionally behind HAProxy),
`lone_requests` times requests sent one at a time, `ladder` climbs offered rates until one
is not held (`holds`), with the server's CPU per answered request at each; `trace` draws the
requests both send and `server_args` the server's command line both measure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import uvloop

from benchmarks import common
from benchmarks.serving_load import wait_ready
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.data.trace import serving_trace
from ikbo_jax.serving import bodies, haproxy, http_load, http_wire, stages
from ikbo_jax.testing import loopback


def trace(config, mean_candidates: float, pool: int) -> list:
  """`pool` requests of the Zipf trace of returning users, ~`mean_candidates` each."""
  gen = ClickGenerator(config, seed=4, mean_candidates=mean_candidates,
                       max_candidates=int(4 * mean_candidates))
  return serving_trace(gen, pool, processes=os.cpu_count())


def server_args(mean_candidates: float, queue_requests: float, budget_ms: float,
                max_batch_requests: int, stub: tuple[float, float] | None = None,
                server_timing: bool = False) -> list[str]:
  """The server's command line: a queue bound of `queue_requests` mean requests' candidates,
  a deadline of 3/4 of the p99 budget, and a `DeviceStub` of `stub`'s times if given."""
  return ["--max-queued-candidates", str(int(mean_candidates * queue_requests)),
          "--timeout-ms", str(0.75 * budget_ms), "--max-batch-requests", str(max_batch_requests),
          *(["--server-timing"] if server_timing else []),
          *(["--device-stub", *map(str, stub)] if stub else [])]


def lone_requests(url: str, requests, count: int,
                  endpoint: http_load.Endpoint = http_load.Endpoint()) -> dict:
  """Latency of `count` requests sent one at a time on one connection (msgpack), and
  their stages where the server sends them. The client is the load generator's
  (`serving.http_wire`), whose own time is in `outside`."""
  payloads = [endpoint.encode(r, bodies.MSGPACK) for r in requests[:count]]
  times, rows = [], []

  async def send_each() -> None:
    pool = http_wire.WirePool.to(url, connections=1, idle_s=30.0)
    try:
      for payload, headers in payloads:
        start = time.perf_counter()
        status, answer_headers, answer = await pool.request(endpoint.path, payload, headers)
        times.append(1e3 * (time.perf_counter() - start))
        if status != 200:
          raise RuntimeError(f"a lone request was answered {status}: {answer[:200]!r}")
        if "server-timing" in answer_headers:
          rows.append(stages.answer_row(answer_headers["server-timing"], times[-1]))
    finally:
      await pool.close()

  uvloop.run(send_each())
  warm = len(times) // 10  # the first tenth warms up
  p50, p99 = np.percentile(times[warm:], (50, 99))
  return dict(requests=len(times), p50_ms=float(p50), p99_ms=float(p99),
              **({"stages": stages.summarize(rows[warm:])} if rows else {}))


def holds(stats: dict, budget_ms: float) -> bool:
  resets = sum(n for kind, n in stats["errors_by_kind"].items() if kind not in ("429", "503"))
  return (stats["p99_ms"] <= budget_ms and stats["achieved_qps"] >= 0.9 * stats["offered_qps"]
          and stats["sent_qps"] >= 0.95 * stats["offered_qps"] and resets == 0)


def ladder(urls: list[str], pids: list[int], requests, expected, rates, seconds: float,
           clients: int, budget_ms: float, tolerance: float, user_header: bool = False,
           endpoint: http_load.Endpoint = http_load.Endpoint()) -> tuple[float, list[dict]]:
  """The highest of `rates` held, and every rate's stats, climbing until one fails.

  Each row holds the server's CPU time per answered request: every process of `pids`
  and their children (HTTP processes, the model process, a balancer), over the run.
  """
  held, rows = 0.0, []
  for rate in rates:
    cpu = common.process_tree_cpu_seconds(pids)
    stats = http_load.over_http(urls, requests, qps=rate, max_seconds=seconds,
                                processes=clients, cycle=True, content_type=bodies.MSGPACK,
                                expected=expected, score_tolerance=tolerance,
                                user_header=user_header, endpoint=endpoint)
    stats["server_cpu_ms_per_request"] = (
        1e3 * (common.process_tree_cpu_seconds(pids) - cpu) / max(stats["answered"], 1))
    rows.append(stats)
    ok = holds(stats, budget_ms)
    print(f"  {rate:.0f}/s: p99 {stats['p99_ms']:.1f} ms, answered {stats['achieved_qps']:.0f}/s,"
          f" errors {stats['errors_by_kind']}, server CPU "
          f"{stats['server_cpu_ms_per_request']:.2f} ms a request -> "
          f"{'held' if ok else 'not held'}", flush=True)
    if not ok:
      break
    held = rate
  return held, rows


def start(preset: str, http_processes: int, mean_candidates: float, server_args: list[str]):
  """A server in its own process, starting: (url, process, log)."""
  port = loopback.free_port()
  log = tempfile.TemporaryFile()
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  server = subprocess.Popen(
      [sys.executable, "-m", "ikbo_jax.serving", "--preset", preset, "--port", str(port),
       "--mean-candidates", str(mean_candidates), "--http-processes", str(http_processes),
       *server_args], stdout=log, stderr=subprocess.STDOUT, env=env)
  return f"http://127.0.0.1:{port}", server, log


def start_haproxy(urls: list[str]):
  """HAProxy (`serving.haproxy`) in front of `urls`, starting: (url, process, log)."""
  port = loopback.free_port()
  backends = [("127.0.0.1", int(u.rsplit(":", 1)[1])) for u in urls]
  path = os.path.join(tempfile.mkdtemp(), "haproxy.cfg")
  with open(path, "w") as f:
    f.write(haproxy.config(backends, port))
  log = tempfile.TemporaryFile()
  proxy = subprocess.Popen(["haproxy", "-db", "-f", path], stdout=log, stderr=subprocess.STDOUT)
  return f"http://127.0.0.1:{port}", proxy, log


@contextlib.contextmanager
def serving(preset: str, n: int, replicas: bool, mean_candidates: float, server_args: list[str],
            balancer: bool = False):
  """(urls, pids) of one server of `n` HTTP processes, or of `n` one-process replicas (behind
  HAProxy's one url with `balancer`), ready; stopped (SIGTERM) on leaving."""
  started = []
  try:
    for _ in range(n if replicas else 1):
      started.append(start(preset, 1 if replicas else n, mean_candidates, server_args))
    for url, server, log in started:
      wait_ready(url, server, log, 900)
    if balancer:
      url, proxy, log = start_haproxy([u for u, _, _ in started])
      started.append((url, proxy, log))
      wait_ready(url, proxy, log, 30)
      yield [url], [p.pid for _, p, _ in started]
    else:
      yield [url for url, _, _ in started], [p.pid for _, p, _ in started]
  finally:
    for _, server, _ in started:
      server.send_signal(signal.SIGTERM)
    for _, server, _ in started:
      server.wait(timeout=120)
