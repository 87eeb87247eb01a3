"""A JAX profiler trace of the serving path under load, and what it shows.

    python -m benchmarks.serving_profile --qps 2000 --out profile.json [--trace-dir DIR]

The IKBO build of the benchmark preset (`--small`: the CPU default) serves the
Zipf trace through the batcher at `--qps` for `--seconds`, with the JAX
profiler on for the middle of the run. The summary says how busy the device
was (the union of its kernels' intervals over the window), which kernels took
its time, and where each host thread spent its time (inclusive times of the
profiler's events, top names): whether the device or the host sets the pace.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import glob
import os
import shutil
import tempfile

import jax
import uvloop
from flax import nnx
from jax.profiler import ProfileData, ProfileOptions

from benchmarks import common
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.data.trace import serving_trace
from ikbo_jax.models import Ranker, RankerConfig
from ikbo_jax.serving import Batcher, BatchingConfig, BucketedModel
from ikbo_jax.serving.buckets import default_buckets
from ikbo_jax.serving.load import run_load


def _busy_ns(intervals: list[tuple[int, int]]) -> int:
  """Length of the union of [start, end) intervals."""
  busy, reach = 0, None
  for start, end in sorted(intervals):
    if reach is None or start > reach:
      busy, reach = busy + end - start, end
    elif end > reach:
      busy, reach = busy + end - reach, end
  return busy


def _top(events, count: int) -> list[dict]:
  totals, calls = collections.Counter(), collections.Counter()
  for e in events:
    totals[e.name] += e.duration_ns
    calls[e.name] += 1
  return [dict(name=name[:160], total_ms=ns / 1e6, calls=calls[name])
          for name, ns in totals.most_common(count)]


def summarize(xplane: str) -> dict:
  """Device busy fraction and top kernels; each host thread's top events."""
  data = ProfileData.from_file(xplane)
  device, host, window = {}, {}, [None, None]
  for plane in data.planes:
    if plane.name.startswith("/device:GPU"):
      kernels = [e for line in plane.lines for e in line.events]
      intervals = [(e.start_ns, e.start_ns + e.duration_ns) for e in kernels]
      device[plane.name] = dict(events=len(kernels), busy_ns=_busy_ns(intervals),
                                top=_top(kernels, 12), span=(min(intervals, default=(0, 0))[0],
                                                             max((b for _, b in intervals),
                                                                 default=0)))
    elif plane.name == "/host:CPU":
      for line in plane.lines:
        events = list(line.events)
        if events:
          host[line.name] = dict(events=len(events), top=_top(events, 10))
          starts = [e.start_ns for e in events]
          ends = [e.start_ns + e.duration_ns for e in events]
          window = [min(filter(None, (window[0], min(starts)))),
                    max(x for x in (window[1], max(ends)) if x is not None)]
  seconds = (window[1] - window[0]) / 1e9 if window[0] is not None else 0.0
  for row in device.values():
    span = row.pop("span")
    row["busy_fraction_of_host_window"] = row["busy_ns"] / max(window[1] - window[0], 1)
    row["busy_fraction_of_kernel_span"] = row["busy_ns"] / max(span[1] - span[0], 1)
  return dict(window_seconds=seconds, device=device, host_threads=host)


async def _profiled_load(served, requests, qps: float, seconds: float, trace_dir: str,
                         python_tracer: bool) -> dict:
  async with Batcher(served, BatchingConfig()) as batcher:
    await asyncio.gather(*(batcher.score(r) for r in requests[:32]))
    load = asyncio.create_task(run_load(batcher.score, requests, qps=qps, max_seconds=seconds))
    await asyncio.sleep(seconds / 3)
    options = ProfileOptions()
    # The Python tracer records every Python call: it slows the host path it would show.
    options.python_tracer_level = int(python_tracer)
    jax.profiler.start_trace(trace_dir, profiler_options=options)
    await asyncio.sleep(min(seconds / 3, 1.0))
    jax.profiler.stop_trace()
    stats = await load
    stats["batches"] = batcher.batches_run
  return stats


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--small", action="store_true", help="the CPU default model")
  parser.add_argument("--qps", type=float, default=2000.0)
  parser.add_argument("--seconds", type=float, default=6.0)
  parser.add_argument("--trace-dir", help="keep the trace (.xplane.pb) here")
  parser.add_argument("--python-tracer", action="store_true",
                      help="record Python calls too (slows the host path)")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  config, mean = (RankerConfig(), 8.0) if args.small else (RankerConfig.benchmark(), 70.0)
  served = BucketedModel(Ranker(config, rngs=nnx.Rngs(0)),
                         default_buckets(config, mean_candidates=mean), "ikbo")
  requests = serving_trace(ClickGenerator(config, seed=3, mean_candidates=mean,
                                          max_candidates=int(4 * mean)),
                           int(args.qps * args.seconds) + 64, processes=os.cpu_count())
  with tempfile.TemporaryDirectory() as trace_dir:
    stats = uvloop.run(_profiled_load(served, requests, args.qps, args.seconds, trace_dir,
                                       args.python_tracer))
    xplane = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    summary = summarize(xplane)
    if args.trace_dir:
      os.makedirs(args.trace_dir, exist_ok=True)
      shutil.copy(xplane, args.trace_dir)
  for name, row in summary["device"].items():
    print(f"{name}: {row['events']} kernels, busy {100 * row['busy_fraction_of_host_window']:.0f}% "
          f"of the {summary['window_seconds']:.2f} s window", flush=True)
  print(f"load: {stats['achieved_qps']:.0f}/s answered, p99 {stats['p99_ms']:.1f} ms, "
        f"{stats['batches']} batches", flush=True)
  common.write_json(args.out, dict(**common.metadata(), config=str(config), qps=args.qps,
                                   load={k: v for k, v in stats.items()}, profile=summary))


if __name__ == "__main__":
  main()
