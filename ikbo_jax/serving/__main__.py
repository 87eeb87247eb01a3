"""Serves the ranking model over HTTP (uvicorn):

    python -m ikbo_jax.serving --checkpoint-dir /tmp/ranker --port 8000
    python -m ikbo_jax.serving --checkpoint-dir /tmp/ranker --devices 2   # a replica per GPU
    python -m ikbo_jax.serving --checkpoint-dir /tmp/ranker --http-processes 4

`--checkpoint-dir` is a directory written by `python -m ikbo_jax.training`
(without it the model has random weights, for load tests). Routes: `POST
/score`, `GET /health`, `/health/live`, `/health/ready`, `/metrics`, and with
`--cache-mb` (a device-resident cache of users' states, `serving.cached`)
`GET /cache` and `POST /cache/flush` (`ikbo_jax.serving.http`). The port opens at once; the buckets compile after,
and the server reports ready when they are done.

Overload is answered, never dropped: the batcher refuses requests past its
queue bounds (429) and answers those whose deadline passed in the queue (503);
the server answers 503 past `--max-connections` requests in progress (idle connections
do not count; health checks always pass), and its accept backlog holds the connections it
has not yet accepted. A connection must complete each request
head within `--head-seconds` (idle and drip-feeding clients cannot hold sockets),
of at most `--max-head-bytes` and `--max-headers` fields (431 beyond).
On SIGTERM it answers 503 to the requests still in its accept queue (instead of
resetting their connections), stops accepting, answers what is in flight, and exits
within `--drain-seconds`. With `--http-processes N` (N > 1), N processes read and
decode requests from the one port and feed one model process, which holds the model,
its batcher and its cache (`ikbo_jax.serving.processes`).
"""

from __future__ import annotations

import sys

from ikbo_jax import __version__, _cli
from ikbo_jax.models.builds import Build
from ikbo_jax.models.config import PRESETS


def main(argv=None) -> None:
  parser = _cli.parser("ikbo_jax.serving", __doc__, __version__)
  parser.add_argument("--preset", choices=sorted(PRESETS), default="small",
                      help="model sizes (must match the checkpoint)")
  parser.add_argument("--checkpoint-dir",
                      help="a directory written by python -m ikbo_jax.training (none: "
                           "random weights)")
  parser.add_argument("--build", type=Build.parse, choices=list(Build), default=Build.IKBO,
                      help="which forward pass serves")
  parser.add_argument("--max-batch-requests", type=int, default=16,
                      help="requests per batch at most")
  parser.add_argument("--batch-timeout-ms", type=float, default=2.0,
                      help="how long a batch waits to fill")
  parser.add_argument("--max-in-flight", type=int,
                      help="batches with the model at once (default: 2 per device)")
  parser.add_argument("--devices", type=int, default=1,
                      help="serve on this many local devices, one model replica on each")
  parser.add_argument("--mean-candidates", type=float, default=8.0,
                      help="sizes the default buckets")
  parser.add_argument("--cache-mb", type=float, default=0.0,
                      help="device memory for a cache of users' states (IKBO build, one "
                           "device; 0: no cache)")
  parser.add_argument("--cache-ttl-seconds", type=float,
                      help="a cached user state older than this is computed again")
  parser.add_argument("--max-queued-candidates", type=int, default=65536,
                      help="candidates waiting in the batcher beyond which requests get 429")
  parser.add_argument("--timeout-ms", type=float, default=1000.0,
                      help="a request's deadline unless its X-Timeout-Ms header sets one")
  parser.add_argument("--max-body-bytes", type=int, default=8 << 20,
                      help="the largest request body (413 beyond)")
  parser.add_argument("--max-active", type=int, default=256,
                      help="POST /score requests whose body arrived, being parsed or scored "
                           "at once, beyond which requests get 429")
  parser.add_argument("--max-receiving", type=int, default=1024,
                      help="request bodies being received at once beyond which requests "
                           "get 503")
  parser.add_argument("--max-receiving-per-peer", type=int, default=128,
                      help="request bodies one client address may be sending at once (429 "
                           "beyond); behind a proxy, set it to --max-receiving")
  parser.add_argument("--max-connections", type=int, default=2048,
                      help="requests in progress beyond which the server answers 503 "
                           "(idle connections do not count; health checks always pass)")
  parser.add_argument("--backlog", type=int, default=4096,
                      help="the socket's accept backlog (connections not yet accepted)")
  parser.add_argument("--idle-seconds", type=int, default=5,
                      help="an idle keep-alive connection is closed after this long")
  parser.add_argument("--head-seconds", type=float, default=10.0,
                      help="a connection that has not sent a whole request head this long "
                           "after opening (or after its last response) is closed")
  parser.add_argument("--max-head-bytes", type=int, default=32 * 1024,
                      help="a request head (request line and headers) over this many bytes "
                           "is answered 431")
  parser.add_argument("--max-headers", type=int, default=100,
                      help="a request head with more header fields is answered 431")
  parser.add_argument("--drain-seconds", type=int, default=10,
                      help="on SIGTERM, how long in-flight requests may take to finish")
  parser.add_argument("--http-processes", type=int, default=1,
                      help="processes reading and decoding requests; with more than 1, the "
                           "model runs in a process of its own that they all feed "
                           "(ikbo_jax.serving.processes), and the connection and body limits "
                           "above hold per HTTP process")
  parser.add_argument("--server-timing", action="store_true",
                      help="every answer of POST /score carries its stages (body, decode, "
                           "queue, pack, ..., in ms) in a Server-Timing header")
  parser.add_argument("--device-stub", type=float, nargs=2, metavar=("FIRST_MS", "LAST_MS"),
                      help="no model: a stub that packs each batch and answers after the "
                           "smallest / largest bucket's device time (linear between), to "
                           "profile the host path without a device")
  parser.add_argument("--access-log", action="store_true",
                      help="log a line per request (off: at thousands of requests a second "
                           "the log costs the HTTP process more than its parsing; /metrics "
                           "counts every request by status)")
  parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
  parser.add_argument("--port", type=int, default=8000, help="port to listen on")
  args = parser.parse_args(argv)
  _serve(args, parser)


def _serve(args, parser) -> None:
  if args.cache_mb and (args.build is not Build.IKBO or args.devices != 1):
    parser.error(f"--cache-mb needs --build ikbo and --devices 1, got --build {args.build} "
                 f"--devices {args.devices}")
  if not args.cache_mb and args.cache_ttl_seconds is not None:
    parser.error("--cache-ttl-seconds needs --cache-mb")
  if args.device_stub and (args.checkpoint_dir or args.cache_mb or args.devices != 1):
    parser.error("--device-stub stands for the model: it takes no --checkpoint-dir, "
                 "--cache-mb or --devices")
  if args.http_processes < 1:
    parser.error(f"--http-processes must be >= 1, got {args.http_processes}")
  if args.http_processes > 1:
    from ikbo_jax.serving.processes import Supervisor

    sys.exit(Supervisor(args).run())
  # Imported after parsing, so that --help and --version answer before jax loads.
  from ikbo_jax.serving import launch

  try:
    ranker = launch.load_ranker(args)  # before the port opens
  except launch.LaunchError as e:
    parser.exit(1, f"{e}\n")
  launch.http_server(args, model=launch.model_builder(args, ranker)).run()


if __name__ == "__main__":
  main()
