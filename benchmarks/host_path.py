"""Where a served call's host time goes: variants of moving one batch in and its scores out.

    python -m benchmarks.host_path --out host_path.json [--small]

For one request and for a full batch of the serving trace, through the IKBO
build's compiled bucket, the median wall time of:
- `put_call_fetch`: `device_put` the packed buffer, run, `np.asarray` the scores
  (what `BucketedModel.__call__` does, less packing);
- `put_call_async_fetch`: the same with `copy_to_host_async` before the fetch;
- `numpy_call_fetch`: the NumPy buffer passed to the program as it is (the
  transfer inside the call);
- `transfer`, `execute` and `fetch` alone, each waited for;
- `floor`: a program adding one to a scalar, from NumPy to NumPy: the least any
  call to this device costs.
The difference between a variant and `execute` is host work a faster path
could remove; the result decides what `BucketedModel` does.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from benchmarks import common
from benchmarks.serving_load import full_batch
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.data.trace import serving_trace
from ikbo_jax.models import Ranker, RankerConfig
from ikbo_jax.serving import BucketedModel
from ikbo_jax.serving.buckets import default_buckets


def variants(served: BucketedModel, requests, iterations: int) -> dict:
  fn, flat = served.device_call(requests)
  host, device = np.asarray(flat), served.device

  def fresh_result():  # np.asarray caches the host copy on the array: fetch a new one
    return jax.block_until_ready(fn(flat))

  def async_fetch():
    out = fn(jax.device_put(host, device))
    out.copy_to_host_async()
    np.asarray(out)

  wall = lambda step: common.wall_median_ms(step, iterations)
  row = dict(put_call_fetch=wall(lambda: np.asarray(fn(jax.device_put(host, device)))),
             put_call_async_fetch=wall(async_fetch),
             numpy_call_fetch=wall(lambda: np.asarray(fn(host))),
             transfer=wall(lambda: jax.block_until_ready(jax.device_put(host, device))),
             execute=wall(fresh_result))
  times = []
  for _ in range(iterations):
    out = fresh_result()
    start = time.perf_counter()
    np.asarray(out)
    times.append(time.perf_counter() - start)
  row["fetch"] = 1e3 * float(np.median(times))
  row.update(requests=len(requests), buffer_bytes=int(host.nbytes),
             bucket=str(served.bucket_for(requests)))
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--small", action="store_true", help="the CPU default model")
  parser.add_argument("--iterations", type=int, default=200)
  args = parser.parse_args()
  config = RankerConfig() if args.small else RankerConfig.benchmark()
  mean = 8.0 if args.small else 70.0
  requests = serving_trace(ClickGenerator(config, seed=3, mean_candidates=mean,
                                          max_candidates=int(4 * mean)), 64)
  requests = [r.validated(config) for r in requests]
  buckets = default_buckets(config, mean_candidates=mean)
  served = BucketedModel(Ranker(config, rngs=nnx.Rngs(0)), buckets, "ikbo")
  full = full_batch(requests, buckets)
  one = jax.jit(lambda x: x + 1)
  payload = dict(**common.metadata(), config=str(config), iterations=args.iterations,
                 floor=common.wall_median_ms(lambda: np.asarray(one(np.float32(1))),
                                             args.iterations),
                 one_request=variants(served, requests[:1], args.iterations),
                 full_batch=variants(served, full, args.iterations))
  for name in ("one_request", "full_batch"):
    print(name, {k: round(v, 3) if isinstance(v, float) else v
                 for k, v in payload[name].items()}, flush=True)
  print(f"floor {payload['floor']:.3f} ms", flush=True)
  common.write_json(args.out, payload)


if __name__ == "__main__":
  main()
