"""The rewrite's property-based test, long profile: many generated programs in parallel.

    JAX_PLATFORMS=cpu python tools/rewrite_fuzz.py --seeds 0:100 --per-seed 100 \
        --processes 2 --out rewrite_fuzz.json

Each seed runs `tests/test_rewrite_properties.py`'s check on `--per-seed`
programs drawn by hypothesis from that seed (no shrinking, so a failure is
reported at once); the JSON counts the programs checked, those whose mapping
left users without candidates and those with out-of-range ids, and lists
every failing seed with hypothesis' falsifying example.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
import traceback


def run_seed(args: tuple[int, int]) -> dict:
  seed_value, per_seed = args
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import numpy as np
  from hypothesis import HealthCheck, Phase, given, seed, settings

  from ikbo_jax.testing import programs
  from ikbo_jax.testing.rewrite_check import check_rewrite

  count = {"programs": 0, "users_without_candidates": 0, "out_of_range_ids": 0}

  @seed(seed_value)
  @settings(max_examples=per_seed, deadline=None, database=None,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, Phase.generate])
  @given(programs.programs())
  def check(program):
    steps, inputs = program
    ids, num_users = np.asarray(inputs[2]["ids"]), inputs[0].shape[0]
    count["programs"] += 1
    in_range = ids[(ids >= 0) & (ids < num_users)]
    count["users_without_candidates"] += len(np.unique(in_range)) < num_users
    count["out_of_range_ids"] += bool(np.any((ids < 0) | (ids >= num_users)))
    tol = programs.tolerance(steps)
    check_rewrite(programs.build(steps), inputs, rtol=tol, atol=tol, **programs.WHERE)

  try:
    check()
    return dict(seed=seed_value, **count, failure=None)
  except Exception as error:  # a mismatch or a crash: both are findings
    notes = "\n".join(getattr(error, "__notes__", []))
    return dict(seed=seed_value, **count,
                failure=f"{type(error).__name__}: {str(error)[:2000]}\n{notes[:4000]}",
                traceback=traceback.format_exc()[-3000:])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seeds", default="0:10", help="first:last (exclusive)")
  parser.add_argument("--per-seed", type=int, default=100)
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--minutes", type=float, default=None, help="stop starting seeds after")
  parser.add_argument("--out", required=True)
  args = parser.parse_args()
  first, last = (int(x) for x in args.seeds.split(":"))
  start, results = time.time(), []
  with multiprocessing.get_context("spawn").Pool(args.processes, maxtasksperchild=1) as pool:
    for result in pool.imap_unordered(run_seed, [(s, args.per_seed) for s in range(first, last)]):
      results.append(result)
      total = sum(r["programs"] for r in results)
      print(f"seed {result['seed']}: {result['programs']} programs, "
            f"{'FAIL' if result['failure'] else 'ok'}; {total} in {time.time() - start:.0f} s",
            flush=True)
      if args.minutes and time.time() - start > 60 * args.minutes:
        pool.terminate()
        break
      _write(args.out, results, start)
  _write(args.out, results, start)


def _write(path, results, start) -> None:
  with open(path, "w") as f:
    json.dump(dict(programs=sum(r["programs"] for r in results),
                   users_without_candidates=sum(r["users_without_candidates"] for r in results),
                   out_of_range_ids=sum(r["out_of_range_ids"] for r in results),
                   failures=[r for r in results if r["failure"]], seconds=time.time() - start,
                   seeds=sorted(r["seed"] for r in results)), f, indent=1)


if __name__ == "__main__":
  main()
