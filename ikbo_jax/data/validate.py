"""Checks Parquet request files against the schema and a model preset, without training:

    python -m ikbo_jax.data.validate logs.parquet held_out.parquet --preset small

Every row of every file is checked (`ikbo_jax.data.files`); the first failure is
printed with its file, rows and field and the exit status is 1. Otherwise one
summary line per file: requests, distinct users, candidates per request, history
length and the label rate.
"""

from __future__ import annotations

import sys

from ikbo_jax import __version__, _cli
from ikbo_jax.models.config import PRESETS


def main(argv=None) -> int:
  parser = _cli.parser("ikbo_jax.data.validate", __doc__, __version__)
  parser.add_argument("files", nargs="+", help="Parquet files in ikbo_jax.data.files' schema")
  parser.add_argument("--preset", choices=sorted(PRESETS), default="small",
                      help="the model the files must fit (ids, widths, history length)")
  parser.add_argument("--no-labels", action="store_true",
                      help="scoring data: labels may be absent or null")
  args = parser.parse_args(argv)
  # Imported after parsing, so that --help answers at once.
  import numpy as np

  from ikbo_jax.data import files

  config = PRESETS[args.preset]()
  for path in args.files:
    try:
      requests = files.read_requests(path, config, require_labels=not args.no_labels)
    except files.DataError as e:
      print(f"invalid: {e}")
      return 1
    counts = np.array([r.num_candidates for r in requests])
    labels = [r.labels for r in requests if r.labels is not None]
    rate = float(np.concatenate(labels).mean()) if labels else float("nan")
    users = len({r.user_dense.tobytes() + r.history.tobytes() for r in requests})
    print(f"{path}: {len(requests)} requests, {users} distinct users, candidates per request "
          f"mean {counts.mean():.1f} (min {counts.min()}, max {counts.max()}), history mean "
          f"{np.mean([len(r.history) for r in requests]):.1f}, label rate {rate:.3f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
