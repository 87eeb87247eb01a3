"""Where the ranker's device time goes: every kernel of inference and of a training step.

    python -m benchmarks.ranker_profile --out benchmarks/results/ranker_profile_h100.json
    python -m benchmarks.ranker_profile --small --out /tmp/profile.json   # CPU: XLA's thunks

The IKBO build's jitted forward as served (parameters cast once, ahead of the
calls) and its training step (forward, backward, AdamW, as
`benchmarks.ranking_system` times them) run `--iterations` times
under the JAX profiler at B candidates, ratio R. Each kernel of the trace is
matched to the HLO instruction behind it (the `hlo_op` the runtime records)
and reported with:
- its part of the model: the named scope it was traced under
  (`candidate_embeddings`, `sequence`, `linear_compression`, `tower`, `loss`,
  `optimizer`, ...; `other` for XLA's own copies of parameters and state);
- its phase: forward, backward (traced under a transpose) or update;
- its kind: a Pallas kernel, a GEMM (cuBLAS or a Triton GEMM fusion), a fusion
  of another kind, a copy, ...;
- its time per call and its floor: the bytes its operands and result occupy
  at the measured copy bandwidth, or its matrix products' FLOPs at the
  measured bf16 matmul rate, whichever is longer. Pallas kernels get the
  bytes floor only (the attention benchmark gives their FLOP rooflines). A
  kernel that reads less than its operands (a gather reads rows of a table)
  can beat that floor: then its time stands for its floor in the sums.
Times are sums of kernel durations over the traced calls divided by the calls;
a part's `gap_ms` is its time over its floor, the most fixing it could win.
`--hlo-dir` keeps each program's compiled HLO, to read what a fusion holds.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import os
import re
import tempfile

import jax
import optax
from flax import nnx
from jax.profiler import ProfileData

from benchmarks import common, hlo_cost
from benchmarks.problems import functional_step, ranking_batch, served_forward
from ikbo_jax.models import Ranker, RankerConfig

# The named scopes the model, the loss and the trainer trace under, innermost wins.
PARTS = ("user_embeddings", "candidate_embeddings", "group_embeddings", "sequence", "pooling",
         "linear_compression", "tower", "loss", "optimizer", "finite_check")
_PART = re.compile(r"\b(" + "|".join(PARTS) + r")\b")
_HLO_OP = re.compile(r"hlo_op=([^,#:]+)")
_CONTROL_FLOW = ("while", "conditional", "call")


def kernel_events(xplane: str) -> list[dict]:
  """`[{name, hlo_op, ns}]`: the device's kernels (a CPU run: XLA's thunks), each once."""
  data = ProfileData.from_file(xplane)
  events, seen = [], set()
  for plane in data.planes:
    on_device = plane.name.startswith("/device:GPU")
    if not on_device and plane.name != "/host:CPU":
      continue
    for line in plane.lines:
      for event in line.events:
        stats = dict(event.stats)
        hlo_op = stats.get("hlo_op") or _annotated_op(str(stats.get("annotation", "")))
        if not (on_device or "hlo_op" in stats) or event.name.startswith("end: "):
          continue
        key = (event.start_ns, event.duration_ns, event.name)
        if key in seen:  # a kernel on a stream's line and on an aggregate line
          continue
        seen.add(key)
        events.append(dict(name=event.name, hlo_op=hlo_op, ns=event.duration_ns))
  return events


def _annotated_op(annotation: str) -> str:
  """The HLO instruction an XLA GPU kernel annotation names, or ""."""
  match = _HLO_OP.findall(annotation)
  return match[-1] if match else ""


def classify(instruction: hlo_cost.Instruction | None, kernel_name: str) -> dict:
  """`{part, phase, kind}` of a kernel from its instruction (None: unmatched)."""
  if instruction is None:
    return dict(part="unmatched", phase="unknown", kind=_kind_of_name(kernel_name))
  parts = _PART.findall(instruction.op_name)
  part = parts[-1] if parts else "other"
  phase = ("update" if part in ("optimizer", "finite_check")
           else "backward" if "transpose(" in instruction.op_name else "forward")
  return dict(part=part, phase=phase, kind=_kind(instruction, kernel_name))


def _kind(instruction: hlo_cost.Instruction, kernel_name: str) -> str:
  if instruction.opcode == "custom-call":
    if re.search("gemm|matmul", instruction.target):
      return "gemm"
    return "pallas" if re.search("mosaic|triton|pallas", instruction.target) else "custom_call"
  if instruction.opcode == "fusion":
    if instruction.flops:
      return "gemm"
    if re.search("scatter", kernel_name + instruction.name):
      return "scatter"
    if re.search("gather", kernel_name + instruction.name):
      return "gather"
    if re.search("transpose|copy", instruction.name):
      return "copy"
    return "reduction" if instruction.fusion_kind == "kInput" else "elementwise"
  return instruction.opcode


def _kind_of_name(name: str) -> str:
  for kind, pattern in (("gemm", "gemm|nvjet|xmma|cutlass"), ("copy", "memcpy|memset|copy")):
    if re.search(pattern, name, re.I):
      return kind
  return "other"


def profile(fn, args, iterations: int, ceilings: dict, hlo_path: str | None = None) -> dict:
  """`fn(*args)` traced `iterations` times: its kernels, grouped, against their floors."""
  compiled = jax.jit(fn).lower(*args).compile()
  text = compiled.as_text()
  if hlo_path:
    with gzip.open(hlo_path, "wt") as f:
      f.write(text)
  instructions = hlo_cost.parse(text)
  jax.block_until_ready(compiled(*args))
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    for _ in range(iterations):
      jax.block_until_ready(compiled(*args))
    jax.profiler.stop_trace()
    events = kernel_events(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"),
                                     recursive=True)[0])
  kernels = {}
  for event in events:
    instruction = instructions.get(event["hlo_op"])
    if instruction is not None and instruction.opcode in _CONTROL_FLOW:
      continue  # a CPU trace's loop or branch spans the thunks of its body, traced too
    key = (event["hlo_op"] or event["name"], event["name"])
    if key not in kernels:
      kernels[key] = dict(hlo_op=event["hlo_op"], kernel=event["name"][:120], ns=0, launches=0,
                          **classify(instruction, event["name"]), **_floor(instruction, ceilings))
    row = kernels[key]
    row["ns"] += event["ns"]
    row["launches"] += 1
  rows = sorted(kernels.values(), key=lambda row: -row["ns"])
  for row in rows:
    row["ms"] = row.pop("ns") / 1e6 / iterations
    row["floor_ms"] = min(row["floor_ms"], row["ms"])
    row["launches"] /= iterations
    row["op_name"] = instructions[row["hlo_op"]].op_name[:200] if row["hlo_op"] in instructions \
        else ""
  total = sum(row["ms"] for row in rows)
  return dict(kernel_ms=total, kernels_per_call=sum(row["launches"] for row in rows),
              matched_fraction=sum(row["ms"] for row in rows if row["part"] != "unmatched")
              / max(total, 1e-12),
              by_part=_grouped(rows, ("part",)), by_phase=_grouped(rows, ("phase",)),
              by_kind=_grouped(rows, ("kind",)), by_part_phase_kind=_grouped(
                  rows, ("part", "phase", "kind")), kernels=rows[:60])


def _floor(instruction: hlo_cost.Instruction | None, ceilings: dict) -> dict:
  if instruction is None:
    return dict(bytes=0, flops=0.0, floor_ms=0.0)
  floor = max(instruction.bytes / (ceilings["copy_tbps"] * 1e9),
              instruction.flops / (ceilings["matmul_tflops"] * 1e9))
  return dict(bytes=instruction.bytes, flops=instruction.flops, floor_ms=floor)


def _grouped(rows, keys) -> list[dict]:
  groups = collections.defaultdict(lambda: dict(ms=0.0, floor_ms=0.0, launches=0.0))
  for row in rows:
    group = groups[tuple(row[k] for k in keys)]
    for field in ("ms", "floor_ms", "launches"):
      group[field] += row[field]
  return [dict(zip(keys, key), **group, gap_ms=group["ms"] - group["floor_ms"])
          for key, group in sorted(groups.items(), key=lambda item: -item[1]["ms"])]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--small", action="store_true", help="the CPU default model, tiny sizes")
  parser.add_argument("--candidates", type=int, help="B (default 1024, --small 64)")
  parser.add_argument("--ratio", type=int, help="candidates per user (default 70, --small 8)")
  parser.add_argument("--iterations", type=int, default=10)
  parser.add_argument("--parts", nargs="*", choices=("inference", "training"),
                      default=("inference", "training"))
  parser.add_argument("--hlo-dir", help="write each program's compiled HLO here (.hlo.txt.gz)")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  hlo_path = lambda name: args.hlo_dir and os.path.join(args.hlo_dir, f"ranker_{name}.hlo.txt.gz")
  if args.hlo_dir:
    os.makedirs(args.hlo_dir, exist_ok=True)
  config = RankerConfig() if args.small else RankerConfig.benchmark()
  b = args.candidates or (64 if args.small else 1024)
  ratio = args.ratio or (8 if args.small else 70)
  batch = jax.device_put(ranking_batch(config, max(1, round(b / ratio)), b, seed=1))
  ceilings = common.measure_ceilings()
  payload = dict(**common.metadata(), config=str(config), num_candidates=b,
                 num_users=batch.num_users, iterations=args.iterations, ceilings=ceilings)
  if "inference" in args.parts:
    served, leaves = served_forward(Ranker(config, rngs=nnx.Rngs(0)), batch)
    payload["inference"] = profile(served, (leaves, batch), args.iterations, ceilings,
                                   hlo_path("inference"))
    _report("inference", payload["inference"])
    common.write_json(args.out, payload)
  if "training" in args.parts:
    model = Ranker(config, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    payload["training"] = profile(functional_step(graphdef, "ikbo"), (state, batch),
                                  args.iterations, ceilings, hlo_path("training"))
    _report("training", payload["training"])
  common.write_json(args.out, payload)


def _report(name: str, result: dict) -> None:
  print(f"{name}: {result['kernel_ms']:.3f} ms of kernels a call, "
        f"{result['kernels_per_call']:.0f} kernels, {result['matched_fraction']:.0%} matched",
        flush=True)
  for row in result["by_part_phase_kind"][:14]:
    print(f"  {row['part']:>20} {row['phase']:>8} {row['kind']:>11} {row['ms']:7.3f} ms "
          f"(floor {row['floor_ms']:.3f}, {row['launches']:.0f} kernels)", flush=True)


if __name__ == "__main__":
  main()
