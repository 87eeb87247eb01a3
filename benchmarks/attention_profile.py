"""Where the Mosaic GPU attention kernel's time goes: per-warpgroup phase timings on the GPU.

    python -m benchmarks.attention_profile --out profile.json

Runs the kernel in each of the diagnostics' configs with `profile_dir` set,
which records clock readings at the consumers' named phases (item_start, qk
and the turn wait inside it, softmax, pv_wait, pv, epilogue), and summarises
the trace per consumer warpgroup: cycles per work item, per phase per item,
and outside any phase.
The clock stores perturb the kernel by a few percent: compare phases with
each other, not with unprofiled times.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import statistics
import tempfile

import jax

from benchmarks import common
from benchmarks.attention_diagnostics import CONFIGS, kernel_steps
from benchmarks.target_attention import PUBLISHED
from ikbo_jax.kernels.mosaic_gpu import target_attention as kernel

# Each CTA records one trace per warpgroup: the consumers, then the producer.
TRACES_PER_CTA = kernel.NUM_CONSUMERS + 1
# The first item of each CTA fills the pipeline; it is left out of the means.
WARMUP_ITEMS = 1


def _ranges_by_trace(trace: dict) -> dict[int, list[tuple[str, float, float, int]]]:
  """Per trace: its (name, begin, end, depth) ranges in cycles, in begin order."""
  open_events = collections.defaultdict(list)
  ranges = collections.defaultdict(list)
  for event in trace["traceEvents"]:
    # `ts` is (start time + clock cycles) / 1e3, so differences times 1e3 are cycles.
    cycles = event["ts"] * 1e3
    stack = open_events[event["tid"]]
    if event["ph"] == "B":
      stack.append((event["name"], cycles))
    else:
      name, begin = stack.pop()
      ranges[event["tid"]].append((name, begin, cycles, len(stack)))
  return {tid: sorted(r, key=lambda x: x[1]) for tid, r in ranges.items()}


def summarize(trace: dict) -> dict:
  """Per consumer: mean cycles per item, per phase per item, and outside the phases."""
  ranges_by_trace = _ranges_by_trace(trace)
  summary = {}
  for wg in range(kernel.NUM_CONSUMERS):
    per_item = collections.defaultdict(list)
    item_cycles, steps = [], []
    for tid, ranges in ranges_by_trace.items():
      if (tid - 1) % TRACES_PER_CTA != wg:
        continue
      begins = [begin for name, begin, _, _ in ranges if name == "item_start"]
      # Whole items only: from one item_start to the next.
      for a, b in zip(begins[WARMUP_ITEMS:], begins[WARMUP_ITEMS + 1:]):
        inside = [r for r in ranges if a <= r[1] < b]
        item_cycles.append(b - a)
        steps.append(sum(1 for r in inside if r[0] == "softmax"))
        totals = collections.Counter()
        for name, begin, end, _ in inside:
          totals[name] += end - begin
        top_level = sum(end - begin for _, begin, end, depth in inside if depth == 0)
        totals["outside phases"] = (b - a) - top_level
        for name in set(totals) | set(per_item):
          per_item[name].append(totals.get(name, 0.0))
    summary[f"consumer{wg}"] = dict(
        items=len(item_cycles),
        cycles_per_item=statistics.fmean(item_cycles) if item_cycles else None,
        steps_per_item=statistics.fmean(steps) if steps else None,
        phase_cycles_per_item={name: statistics.fmean(v) for name, v in sorted(per_item.items())})
  summary["timeline"] = _timeline(ranges_by_trace)
  return summary


def _timeline(ranges: dict, items: int = 2) -> dict:
  """Both consumers of one CTA, their ranges over `items` items after the warm-up, in cycles."""
  cta = min((tid - 1) // TRACES_PER_CTA for tid in ranges)
  traces = {wg: ranges.get(cta * TRACES_PER_CTA + wg + 1, [])
            for wg in range(kernel.NUM_CONSUMERS)}
  begins = [b for name, b, _, _ in traces[0] if name == "item_start"]
  if len(begins) <= WARMUP_ITEMS + items:
    return {}
  start, stop = begins[WARMUP_ITEMS], begins[WARMUP_ITEMS + items]
  return {f"consumer{wg}": [(name, round(b - start), round(e - start))
                            for name, b, e, _ in r if start <= b < stop]
          for wg, r in traces.items()}


def profile(fn, operands, profile_dir: str) -> dict:
  for old in glob.glob(os.path.join(profile_dir, "*.json")):
    os.remove(old)
  jax.block_until_ready(fn(*operands))  # compiles and warms up; the second run's trace is kept
  jax.block_until_ready(fn(*operands))
  jax.effects_barrier()  # the trace is written by a host callback
  newest = max(glob.glob(os.path.join(profile_dir, "*.json")), key=os.path.getmtime)
  with open(newest) as f:
    return summarize(json.load(f))


def run(seq_len: int, profile_dir: str, config: kernel.Config) -> dict:
  config = dataclasses.replace(config, profile_dir=profile_dir)
  return {kind: profile(fn, operands, profile_dir)
          for kind, (fn, operands) in kernel_steps(seq_len, config).items()}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", required=True)
  parser.add_argument("--seq-lens", type=int, nargs="*", default=(1024, 4096))
  args = parser.parse_args()
  payload = dict(**common.metadata(), shape=PUBLISHED, configs=list(CONFIGS), rows={})
  with tempfile.TemporaryDirectory() as profile_dir:
    for seq_len in args.seq_lens:
      for name, config in CONFIGS.items():
        row = payload["rows"].setdefault(seq_len, {})[name] = run(seq_len, profile_dir, config)
        brief = {kind: {k: v for k, v in summary.items() if k != "timeline"}
                 for kind, summary in row.items()}
        print("S", seq_len, name, json.dumps(brief), flush=True)
        common.write_json(args.out, payload)


if __name__ == "__main__":
  main()
