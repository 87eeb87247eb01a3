"""What `python -m ikbo_jax.serving`'s processes build from its command line.

One process (`--http-processes 1`) builds all of it; with several, the model
process builds the model (`model_builder`) and each HTTP process the app and
its uvicorn server (`http_server`). Nothing here runs at import: the
supervisor of several processes must not load jax's backend, which would take
the GPU's memory its model process needs.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable

import numpy as np


class LaunchError(RuntimeError):
  """The command line asks for what cannot be served (a bad checkpoint, too few devices)."""


def tune_gc() -> None:
  """Keeps the cyclic garbage collector's pauses short in a serving process.

  A server's heap after start-up is mostly jax's, flax's and the model's objects,
  which live as long as the process, and every full pass of the collector walked
  them all with the event loop stopped: 114 ms, every few seconds under load (a p99
  of 100-135 ms at 1000 requests a second over HTTP, on a stub device here and on
  an H100 alike). `gc.freeze` puts them out of its reach. What each request leaves
  is cyclic garbage (asyncio's and the HTTP stack's objects): at the default
  threshold of 700 allocations a request still in flight is collected young
  several times, moves to the oldest generation and dies there, so full passes
  kept coming (17 ms, ~60,000 objects, every few seconds). At 20,000 allocations
  between young passes, a request's cycles die young: no object reached the oldest
  generation at 1000 requests a second, and the longest pause was ~5 ms.
  """
  gc.collect()
  gc.freeze()
  gc.set_threshold(_YOUNG_COLLECTION_ALLOCATIONS, 50, 100)


_YOUNG_COLLECTION_ALLOCATIONS = 20_000


def load_ranker(args: argparse.Namespace):
  """The ranker to serve: the checkpoint's, or random weights without one; None for a
  `--device-stub`, which has no parameters."""
  if args.device_stub:
    return None
  import jax
  from flax import nnx

  from ikbo_jax.models import Ranker, load_ranker as load
  from ikbo_jax.models.checkpoint import CheckpointError
  from ikbo_jax.models.config import PRESETS
  from ikbo_jax.serving.cached import user_state_bytes

  if not 1 <= args.devices <= len(jax.local_devices()):
    raise LaunchError(f"--devices must be in [1, {len(jax.local_devices())}], got "
                      f"{args.devices}")
  config = PRESETS[args.preset]()
  if args.checkpoint_dir:
    try:  # before the model is built: a checkpoint that does not verify never serves
      ranker = load(config, args.checkpoint_dir)
    except (CheckpointError, FileNotFoundError) as e:
      raise LaunchError(f"cannot serve {args.checkpoint_dir}: {e}") from None
  else:
    print("no --checkpoint-dir: serving random weights", flush=True)
    ranker = Ranker(config, rngs=nnx.Rngs(0))
  if args.cache_mb:
    needed = max(b.num_users for b in buckets(args)) * user_state_bytes(ranker)
    if args.cache_mb * 2**20 < needed:
      raise LaunchError(f"--cache-mb {args.cache_mb} holds fewer users than one batch has: "
                        f"give at least {needed / 2**20:.1f}")
  return ranker


def buckets(args: argparse.Namespace):
  from ikbo_jax.models.config import PRESETS
  from ikbo_jax.serving.buckets import default_buckets

  return default_buckets(PRESETS[args.preset](), max_batch_requests=args.max_batch_requests,
                         mean_candidates=args.mean_candidates)


def model_builder(args: argparse.Namespace, ranker) -> Callable[[], object]:
  """A function that compiles the served model (`Scorer`): run it once the port is open."""

  def build_model():
    model = _stub(args) if args.device_stub else _model(args, ranker)
    tune_gc()  # what the model built lives as long as the process
    return model

  return build_model


def _stub(args: argparse.Namespace):
  from ikbo_jax.models.config import PRESETS
  from ikbo_jax.serving.stub import DeviceStub

  print(f"a device stub of {args.device_stub} ms, no model", flush=True)
  return DeviceStub(PRESETS[args.preset](), buckets(args), tuple(args.device_stub), args.build)


def _model(args: argparse.Namespace, ranker):
  """The compiled model, checked on a smoke batch."""
  import jax

  from ikbo_jax.data.synthetic import ClickGenerator
  from ikbo_jax.serving.buckets import BucketedModel
  from ikbo_jax.serving.cached import CachedModel
  from ikbo_jax.serving.devices import DeviceSet

  shapes = buckets(args)
  print(f"compiling {len(shapes)} buckets of the {args.build} build on {args.devices} "
        "device(s)...", flush=True)
  progress = lambda bucket, seconds: print(f"  compiled {bucket} in {seconds:.1f} s",
                                           flush=True)
  if args.cache_mb:
    model = CachedModel(ranker, shapes, cache_bytes=int(args.cache_mb * 2**20),
                        ttl_seconds=args.cache_ttl_seconds, on_compiled=progress)
  elif args.devices == 1:
    model = BucketedModel(ranker, shapes, args.build, on_compiled=progress)
  else:
    model = DeviceSet(ranker, shapes, args.build, devices=jax.local_devices()[:args.devices],
                      on_compiled=progress)
  # A smoke batch: parameters that pass the checksums can still be garbage.
  smoke = ClickGenerator(ranker.config, seed=0).request(0).validated(ranker.config)
  if not np.isfinite(model([smoke])[0]).all():
    raise RuntimeError("a smoke request got non-finite scores: the parameters are broken")
  return model


def batching(args: argparse.Namespace):
  from ikbo_jax.serving.batcher import BatchingConfig

  return BatchingConfig(args.max_batch_requests, args.batch_timeout_ms,
                        max_queued_candidates=args.max_queued_candidates,
                        max_in_flight=args.max_in_flight or 2 * args.devices,
                        default_timeout_ms=args.timeout_ms)


def http_server(args: argparse.Namespace, model=None, model_process: str | None = None):
  """The uvicorn server of one HTTP process: its app serves `model` or `model_process`'s."""
  import uvicorn

  from ikbo_jax.serving.draining import DrainingServer
  from ikbo_jax.serving.http import HttpLimits, create_app
  from ikbo_jax.serving.protocol import guarded_http

  limits = HttpLimits(max_body_bytes=args.max_body_bytes, max_active=args.max_active,
                      max_receiving=args.max_receiving,
                      max_receiving_per_peer=args.max_receiving_per_peer)
  app = create_app(model, batching(args), limits, model_process=model_process,
                   server_timing=args.server_timing)
  http = guarded_http(args.head_seconds, args.max_head_bytes, args.max_headers)
  server = DrainingServer(uvicorn.Config(
      app, host=args.host, port=args.port, http=http, backlog=args.backlog,
      limit_concurrency=args.max_connections, timeout_keep_alive=args.idle_seconds,
      timeout_graceful_shutdown=args.drain_seconds, access_log=args.access_log))
  tune_gc()
  return server
