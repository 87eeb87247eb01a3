"""Serves the ranking model over HTTP (uvicorn):

    python -m ikbo_jax.serving --checkpoint-dir /tmp/ranker --port 8000
    python -m ikbo_jax.serving --checkpoint-dir /tmp/ranker --devices 2   # a replica per GPU

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
within `--drain-seconds`.
"""

from __future__ import annotations

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
  parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
  parser.add_argument("--port", type=int, default=8000, help="port to listen on")
  args = parser.parse_args(argv)
  _serve(args, parser)


def _serve(args, parser) -> None:
  # Imported after parsing, so that --help and --version answer before jax loads.
  import jax
  import uvicorn
  from flax import nnx

  import numpy as np

  from ikbo_jax.data.synthetic import ClickGenerator
  from ikbo_jax.models import Ranker, load_ranker
  from ikbo_jax.models.checkpoint import CheckpointError
  from ikbo_jax.serving.batcher import BatchingConfig
  from ikbo_jax.serving.buckets import BucketedModel, default_buckets
  from ikbo_jax.serving.cached import CachedModel, user_state_bytes
  from ikbo_jax.serving.devices import DeviceSet
  from ikbo_jax.serving.draining import DrainingServer
  from ikbo_jax.serving.http import HttpLimits, create_app
  from ikbo_jax.serving.protocol import guarded_http

  config = PRESETS[args.preset]()
  if not 1 <= args.devices <= len(jax.local_devices()):
    parser.error(f"--devices must be in [1, {len(jax.local_devices())}], got {args.devices}")
  buckets = default_buckets(config, max_batch_requests=args.max_batch_requests,
                            mean_candidates=args.mean_candidates)

  if args.checkpoint_dir:
    try:  # before the port opens: a checkpoint that does not verify never serves
      ranker = load_ranker(config, args.checkpoint_dir)
    except (CheckpointError, FileNotFoundError) as e:
      parser.exit(1, f"cannot serve {args.checkpoint_dir}: {e}\n")
  else:
    print("no --checkpoint-dir: serving random weights")
    ranker = Ranker(config, rngs=nnx.Rngs(0))

  cache_bytes = int(args.cache_mb * 2**20)
  if args.cache_mb:
    if args.build is not Build.IKBO or args.devices != 1:
      parser.error(f"--cache-mb needs --build ikbo and --devices 1, got --build {args.build} "
                   f"--devices {args.devices}")
    needed = max(b.num_users for b in buckets) * user_state_bytes(ranker)
    if cache_bytes < needed:
      parser.error(f"--cache-mb {args.cache_mb} holds fewer users than one batch has: give at "
                   f"least {needed / 2**20:.1f}")
  elif args.cache_ttl_seconds is not None:
    parser.error("--cache-ttl-seconds needs --cache-mb")

  def build_model():
    """Runs on a thread once the port is open; the server is ready when it returns."""
    print(f"compiling {len(buckets)} buckets of the {args.build} build on {args.devices} "
          "device(s)...", flush=True)
    progress = lambda bucket, seconds: print(f"  compiled {bucket} in {seconds:.1f} s",
                                             flush=True)
    if args.cache_mb:
      model = CachedModel(ranker, buckets, cache_bytes=cache_bytes,
                          ttl_seconds=args.cache_ttl_seconds, on_compiled=progress)
    elif args.devices == 1:
      model = BucketedModel(ranker, buckets, args.build, on_compiled=progress)
    else:
      model = DeviceSet(ranker, buckets, args.build, devices=jax.local_devices()[:args.devices],
                        on_compiled=progress)
    # A smoke batch: parameters that pass the checksums can still be garbage.
    smoke = ClickGenerator(config, seed=0).request(0).validated(config)
    if not np.isfinite(model([smoke])[0]).all():
      raise RuntimeError("a smoke request got non-finite scores: the parameters are broken")
    return model

  batching = BatchingConfig(args.max_batch_requests, args.batch_timeout_ms,
                            max_queued_candidates=args.max_queued_candidates,
                            max_in_flight=args.max_in_flight or 2 * args.devices,
                            default_timeout_ms=args.timeout_ms)
  limits = HttpLimits(max_body_bytes=args.max_body_bytes, max_active=args.max_active,
                      max_receiving=args.max_receiving,
                      max_receiving_per_peer=args.max_receiving_per_peer)
  app = create_app(build_model, batching, limits)
  http = guarded_http(args.head_seconds, args.max_head_bytes, args.max_headers)
  DrainingServer(uvicorn.Config(
      app, host=args.host, port=args.port, http=http, backlog=args.backlog,
      limit_concurrency=args.max_connections, timeout_keep_alive=args.idle_seconds,
      timeout_graceful_shutdown=args.drain_seconds)).run()


if __name__ == "__main__":
  main()
