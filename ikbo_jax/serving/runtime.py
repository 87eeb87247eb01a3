"""The serving runtime assembled: default buckets, and both builds of a model under one load."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import numpy as np

from ikbo_jax.data import Request
from ikbo_jax.models import Ranker, RankerConfig
from ikbo_jax.serving.batcher import Batcher, BatchingConfig
from ikbo_jax.serving.buckets import Bucket, BucketedModel
from ikbo_jax.serving.loadgen import run_load


def default_buckets(config: RankerConfig, *, max_batch_requests: int = 16,
                    mean_candidates: float = 8.0, count: int = 4) -> list[Bucket]:
  """`count` (1-4) buckets for full batches, then half, quarter and double (multiples of 32).

  A full batch is `max_batch_requests` requests of `mean_candidates` each.
  """
  if not 1 <= count <= 4:
    raise ValueError(f"count must lie in [1, 4], got {count}")
  full = max_batch_requests * mean_candidates
  shapes = ((1, max_batch_requests), (0.5, max(max_batch_requests // 2, 1)),
            (0.25, max(max_batch_requests // 4, 1)), (2, max_batch_requests))[:count]
  return sorted({Bucket(int(np.ceil(full * fraction / 32) * 32), users, config.max_history)
                 for fraction, users in shapes})


async def _serve_load(model: BucketedModel, requests, batching, qps, max_seconds) -> dict:
  async with Batcher(model, batching) as batcher:
    await asyncio.gather(*(batcher.score(r) for r in requests[:8]))  # first calls, off the clock
    stats = await run_load(batcher.score, requests, qps=qps, max_seconds=max_seconds)
    stats["batches"] = batcher.batches_run
  return stats


def compare_builds(model: Ranker, requests: Sequence[Request], *, qps: float,
                   mean_candidates: float = 8.0, max_seconds: float = 60.0,
                   batching: BatchingConfig = BatchingConfig(),
                   buckets: Sequence[Bucket] | None = None) -> dict:
  """The same request stream through the IKBO and the standard build of `model`."""
  buckets = buckets or default_buckets(model.config, mean_candidates=mean_candidates)
  results = {}
  for build in ("ikbo", "standard"):
    start = time.perf_counter()
    served = BucketedModel(model, buckets, build)
    compile_s = time.perf_counter() - start
    results[build] = asyncio.run(_serve_load(served, list(requests), batching, qps, max_seconds))
    results[build].update(compile_seconds=compile_s,
                          buckets=[(b.num_candidates, b.num_users, b.history_slots)
                                   for b in served.buckets])
  return results
