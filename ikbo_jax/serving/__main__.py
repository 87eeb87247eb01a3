"""Serves the ranking model over HTTP (uvicorn):

    python -m ikbo_jax.serving --checkpoint-dir /tmp/ranker --port 8000
    python -m ikbo_jax.serving --checkpoint-dir /tmp/ranker --devices 2   # a replica per GPU

`--checkpoint-dir` is a directory written by `python -m ikbo_jax.training`
(without it the model has random weights, for load tests). Routes: `POST
/score`, `GET /health` (`ikbo_jax.serving.http`).
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
  parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
  parser.add_argument("--port", type=int, default=8000, help="port to listen on")
  args = parser.parse_args(argv)
  _serve(args, parser)


def _serve(args, parser) -> None:
  # Imported after parsing, so that --help and --version answer before jax loads.
  import jax
  import uvicorn
  from flax import nnx

  from ikbo_jax.models import Ranker, load_ranker
  from ikbo_jax.serving.batcher import BatchingConfig
  from ikbo_jax.serving.buckets import BucketedModel, default_buckets
  from ikbo_jax.serving.devices import DeviceSet
  from ikbo_jax.serving.http import create_app

  config = PRESETS[args.preset]()
  if args.checkpoint_dir:
    ranker = load_ranker(config, args.checkpoint_dir)
  else:
    print("no --checkpoint-dir: serving random weights")
    ranker = Ranker(config, rngs=nnx.Rngs(0))
  buckets = default_buckets(config, max_batch_requests=args.max_batch_requests,
                            mean_candidates=args.mean_candidates)
  if not 1 <= args.devices <= len(jax.local_devices()):
    parser.error(f"--devices must be in [1, {len(jax.local_devices())}], got {args.devices}")
  print(f"compiling {len(buckets)} buckets of the {args.build} build on {args.devices} "
        "device(s)...", flush=True)
  progress = lambda bucket, seconds: print(f"  compiled {bucket} in {seconds:.1f} s", flush=True)
  model = (BucketedModel(ranker, buckets, args.build, on_compiled=progress)
           if args.devices == 1 else
           DeviceSet(ranker, buckets, args.build, devices=jax.local_devices()[:args.devices],
                     on_compiled=progress))
  batching = BatchingConfig(args.max_batch_requests, args.batch_timeout_ms,
                            max_in_flight=args.max_in_flight or 2 * args.devices)
  uvicorn.run(create_app(model, batching), host=args.host, port=args.port)


if __name__ == "__main__":
  main()
