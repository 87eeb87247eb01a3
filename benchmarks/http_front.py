"""The sustained rate over HTTP with 1..N HTTP processes feeding one model process.

    python -m benchmarks.http_front --http-processes 1 2 4 8 --out http_front.json   # a GPU host
    python -m benchmarks.http_front --small --out http_front_small.json               # CPU

For each N, the server (`python -m ikbo_jax.serving --http-processes N`; N = 1 is
the one-process server) is started once, and offered Poisson rates over HTTP,
climbing `--rates`, from `--client-processes` load-generator processes with
msgpack bodies (the Zipf trace of returning users); a rate is held while the
clients' p99 stays within `--budget-ms`, at least 90% of the offered rate is
answered and no answer is wrong (each is checked against the model's scores)
or reset. Before the ladder, `--lone` requests one at a time on one keep-alive
connection give the lone request's latency over HTTP. Every row is written as
it is measured. The device-bound ceiling these rates are held against is
`benchmarks/ranking_system.py`'s (`device_bound_qps`: full batches back to back).

With `--server-timing`, the server sends each answer's stages and every rate's
row holds their percentiles (`ikbo_jax.serving.stages`: where a request's time
goes over HTTP). With `--stub FIRST_MS LAST_MS` the server runs a `DeviceStub`
of those device times instead of the model (the HTTP path on a host without a
GPU; each answer is checked against the stub's scores).

With `--replicas`, each N is instead N one-process servers, each with its own
copy of the model on the device, its own batcher and port, the client processes
split evenly between them (a round-robin balancer in front, without its cost):
the front this design was chosen over, measured on the same trace. With
`--balancer haproxy` too, the replicas sit behind HAProxy's one port
(`ikbo_jax.serving.haproxy`: Debian's `haproxy` on PATH), every request carrying
its user's `X-User-Id`, each user's requests hashed to one replica.
"""

from __future__ import annotations

import argparse
import os

from benchmarks import common, http_ladder
from benchmarks.http_ladder import ladder, lone_requests, serving, trace
from benchmarks.serving_load import reference_scores, server_metrics
from ikbo_jax.models.config import PRESETS
from ikbo_jax.serving.stub import stub_scores


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--small", action="store_true", help="the small preset, a short run")
  parser.add_argument("--http-processes", type=int, nargs="+", default=[1, 2, 4, 8])
  parser.add_argument("--rates", type=float, nargs="+",
                      default=[1000, 2000, 3000, 4000, 6000, 8000, 10000, 12000, 15000])
  parser.add_argument("--seconds-per-rate", type=float, default=5.0)
  parser.add_argument("--client-processes", type=int, default=8)
  parser.add_argument("--budget-ms", type=float, default=20.0)
  parser.add_argument("--mean-candidates", type=float, default=70.0)
  parser.add_argument("--lone", type=int, default=300, help="requests sent one at a time")
  parser.add_argument("--repeats", type=int, default=1,
                      help="ladders per N, each on a freshly started server (rows 'N', "
                           "'N run 2', ...)")
  parser.add_argument("--queue-requests", type=float, default=64,
                      help="the server's queue bound, in mean requests' candidates")
  parser.add_argument("--pool", type=int, default=2000, help="distinct requests cycled through")
  parser.add_argument("--replicas", action="store_true",
                      help="N one-process servers with a model each instead of N HTTP processes")
  parser.add_argument("--balancer", choices=["haproxy"],
                      help="with --replicas: the replicas behind HAProxy's one port, hashing "
                           "each request's X-User-Id (serving.haproxy)")
  parser.add_argument("--server-timing", action="store_true",
                      help="collect each answer's stages from its Server-Timing header")
  parser.add_argument("--stub", type=float, nargs=2, metavar=("FIRST_MS", "LAST_MS"),
                      help="serve a DeviceStub of these device times instead of the model")
  parser.add_argument("--iterations", type=int, help="ignored (the scripts' common flag)")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  if args.small:
    args.rates, args.seconds_per_rate = [20, 40], 1.0
    args.client_processes = 2 if args.replicas else 1  # a client per replica
    args.budget_ms = 200.0  # a CPU model call takes tens of milliseconds
    args.http_processes, args.mean_candidates, args.lone, args.pool = [1, 2], 8.0, 20, 60
  preset = "small" if args.small else "benchmark"
  config = PRESETS[preset]()
  requests = trace(config, args.mean_candidates, args.pool)
  if args.stub:
    expected = [stub_scores(r, config) for r in requests]
  else:
    expected = reference_scores(config, requests)
  tolerance = 1e-6 if args.stub else 1e-4 if config.dtype == "float32" else 0.03
  server_args = http_ladder.server_args(args.mean_candidates, args.queue_requests,
                                        args.budget_ms, 32, args.stub, args.server_timing)
  payload = dict(**common.metadata(), preset=preset, budget_p99_ms=args.budget_ms,
                 mean_candidates=args.mean_candidates, client_processes=args.client_processes,
                 seconds_per_rate=args.seconds_per_rate, server_args=server_args,
                 host_cpus=os.cpu_count(),
                 front=("replicas" + (f" behind {args.balancer}" if args.balancer else "")
                        if args.replicas else "model_process"), runs={})
  what = "replicas" if args.replicas else "HTTP processes"
  runs = [(n, k) for n in args.http_processes for k in range(1, args.repeats + 1)]
  for n, k in runs:
    if args.balancer and not args.replicas:
      raise SystemExit("--balancer puts replicas behind one port: give --replicas too")
    if args.replicas and not args.balancer and args.client_processes % n:
      raise SystemExit(f"--replicas: --client-processes {args.client_processes} must be a "
                       f"multiple of each N, got N = {n}")
    with serving(preset, n, args.replicas, args.mean_candidates, server_args,
                 balancer=bool(args.balancer)) as (urls, pids):
      row = dict(lone=lone_requests(urls[0], requests, args.lone))
      print(f"{n} {what}: lone request p50 {row['lone']['p50_ms']:.2f} ms", flush=True)
      row["sustained_qps"], row["ladder"] = ladder(
          urls, pids, requests, expected, args.rates, args.seconds_per_rate,
          args.client_processes, args.budget_ms, tolerance, user_header=bool(args.balancer))
      row["server"] = [server_metrics(url) for url in urls]
      print(f"{n} {what}: sustained {row['sustained_qps']:.0f}/s", flush=True)
    payload["runs"][str(n) if k == 1 else f"{n} run {k}"] = row
    common.write_json(args.out, payload)


if __name__ == "__main__":
  main()
