"""A longer correctness soak than the GPU tests: random cases until a time budget is spent.

    python tools/soak.py --minutes 10 --out soak.json
    python tools/soak.py --cases target_attention:6 self_target_attention:0

Draws cases of every op in turn (seeds from `--first-seed` on), or runs the
`--cases` named (op:seed, in that order, e.g. to re-run a failure), runs each
against every implementation that supports it on this device
(`ikbo_jax.testing.sweep.run_case`), prints each failure as it happens and,
at the end, the cases, failures and worst error ratio per op and
implementation. Exits non-zero when any case failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import sys
import time
import traceback

import jax

from ikbo_jax.testing import sweep


def _row(result: sweep.Result) -> dict:
  return dict(op=result.case.op, implementation=result.implementation, ok=result.ok,
              repeatable=result.repeatable, case=dataclasses.asdict(result.case),
              comparisons=[dict(name=c.name, ok=c.ok, ratio=c.ratio, kernel_err=c.kernel_err,
                                reference_err=c.reference_err,
                                worst_row_excess=c.worst_row_excess) for c in result.comparisons])


def _named_case(text: str) -> tuple[int, str]:
  op, _, seed = text.partition(":")
  if op not in sweep.OPS or not seed.isdigit():
    raise argparse.ArgumentTypeError(f"expected OP:SEED with OP in {sweep.OPS}, got {text!r}")
  return int(seed), op


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--minutes", type=float, default=10.0)
  parser.add_argument("--first-seed", type=int, default=1000)
  parser.add_argument("--ops", nargs="*", default=list(sweep.OPS), choices=sweep.OPS)
  parser.add_argument("--size", type=float, default=1.0,
                      help="scales the largest tensors (use ~0.01 on a CPU)")
  parser.add_argument("--cases", nargs="*", type=_named_case, metavar="OP:SEED",
                      help="run these cases, in this order, instead of drawing seeds")
  parser.add_argument("--out", help="write every result and the summary as JSON")
  args = parser.parse_args()
  deadline = time.monotonic() + 60 * args.minutes
  results, errors = [], []
  # (itertools.product would exhaust the endless seed count before yielding.)
  cases = args.cases or ((seed, op) for seed in itertools.count(args.first_seed)
                         for op in args.ops)
  for seed, op in cases:
    if time.monotonic() > deadline:
      break
    case = sweep.draw_case(op, seed, size=args.size)
    try:
      case_results = sweep.run_case(case)
    except Exception:  # a crash is a failure of the case, reported with the case
      errors.append(dict(op=op, case=dataclasses.asdict(case), error=traceback.format_exc()))
      print(f"ERROR {op} {case}\n{traceback.format_exc()}", flush=True)
      continue
    for result in case_results:
      if not result.ok:
        print(result.describe(), flush=True)
    if args.cases:  # a named case is worth a line even when it passes
      print(f"{op}:{seed} " + ", ".join(
          f"{r.implementation} {'ok' if r.ok else 'FAIL'} {max(c.ratio for c in r.comparisons):.2f}"
          for r in case_results), flush=True)
    results += case_results
  summary = sweep.summarize(results)
  print(f"{len(results)} results, {len(errors)} crashed cases, device {jax.devices()[0].device_kind}")
  for key, entry in sorted(summary.items()):
    worst = ", ".join(f"{name} {ratio:.2f}" for name, ratio in entry["worst_ratio"].items())
    print(f"{key}: {entry['cases']} cases, {entry['failures']} failed, "
          f"{entry['not_repeatable']} not repeatable; worst ratio {worst}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(date=datetime.datetime.now(datetime.UTC).isoformat(),
                     device=jax.devices()[0].device_kind, jax=jax.__version__,
                     summary=summary, errors=errors, results=[_row(r) for r in results]),
                f, indent=1, default=float)
  return 1 if errors or any(not r.ok for r in results) else 0


if __name__ == "__main__":
  sys.exit(main())
