"""Requests on disk as Parquet (through pyarrow), so real logs can be brought in one schema.

One row per request:

| column | type | meaning |
|---|---|---|
| `user_dense` | `list<float>` | the user's profile features (`RankerConfig.user_dense` of them) |
| `history` | `list<int32>` | behaviour history item ids, most recent last |
| `cand_items` | `list<int32>` | the candidates' item ids |
| `cand_dense` | `list<list<float>>` | per candidate, its statistics (`RankerConfig.cand_dense`) |
| `labels` | `list<float>` | per candidate, click (1) or not (0); may be null when scoring |
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ikbo_jax.data.request import Request

SCHEMA = pa.schema([
    ("user_dense", pa.list_(pa.float32())),
    ("history", pa.list_(pa.int32())),
    ("cand_items", pa.list_(pa.int32())),
    ("cand_dense", pa.list_(pa.list_(pa.float32()))),
    ("labels", pa.list_(pa.float32())),
])


def write_requests(requests: Sequence[Request], path: str | os.PathLike) -> None:
  """Writes `requests` to one Parquet file in `SCHEMA`."""
  columns = {name: [] for name in SCHEMA.names}
  for r in requests:
    columns["user_dense"].append(np.asarray(r.user_dense).tolist())
    columns["history"].append(np.asarray(r.history).tolist())
    columns["cand_items"].append(np.asarray(r.cand_items).tolist())
    columns["cand_dense"].append(np.asarray(r.cand_dense).tolist())
    columns["labels"].append(None if r.labels is None else np.asarray(r.labels).tolist())
  pq.write_table(pa.Table.from_pydict(columns, schema=SCHEMA), path)


def read_requests(path: str | os.PathLike) -> list[Request]:
  """Reads requests written in `SCHEMA` (validate them against a config before use)."""
  table = pq.read_table(path)
  missing = set(SCHEMA.names) - set(table.column_names) - {"labels"}
  if missing:
    raise ValueError(f"{path}: missing columns {sorted(missing)}; expected {SCHEMA.names}")
  rows = table.to_pydict()
  labels = rows.get("labels", [None] * table.num_rows)
  return [Request(user_dense=np.asarray(u, np.float32), history=np.asarray(h, np.int64),
                  cand_items=np.asarray(c, np.int64),
                  cand_dense=np.asarray(d, np.float32).reshape(len(c), -1),
                  labels=None if y is None else np.asarray(y, np.float32))
          for u, h, c, d, y in zip(rows["user_dense"], rows["history"], rows["cand_items"],
                                   rows["cand_dense"], labels)]
