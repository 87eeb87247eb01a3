"""Requests on disk as Parquet (through pyarrow), so real logs can be brought in one schema.

One row per request; the schema is declared once (`SCHEMA`) and enforced on read:

| column | Arrow type | contract |
|---|---|---|
| `user_dense` | `list<float32>` | exactly `RankerConfig.user_dense` finite values |
| `history` | `list<int32>` | item ids in `[0, num_items)`, at most `max_history`, most recent last |
| `cand_items` | `list<int32>` | at least one item id in `[0, num_items)` |
| `cand_dense` | `list<list<float32>>` | one row of `RankerConfig.cand_dense` finite values per candidate |
| `labels` | `list<float32>` | one per candidate, each 0 or 1; required for training |

Nothing is null. Integer columns may be stored as any integer type (int8 to
int64); a float or string column where ids belong is refused, never truncated
or parsed. Every error names the file, the row and the field, and a whole file
is checked before any of it is used (vectorized, with `pyarrow.compute`). Pages
carry CRC checksums (written here, and verified wherever present), so a
corrupted page is an error, not silently different values. A file written
without them (most writers' default: `page_checksums.py`) is read, every value
checked against the contract above, with a warning that a corrupted byte that
still passes those checks would go unseen. `python -m ikbo_jax.data.validate
FILE` checks a dataset without training.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ikbo_jax.data.page_checksums import has_page_checksums
from ikbo_jax.data.request import Request
from ikbo_jax.models.config import RankerConfig

SCHEMA = pa.schema([
    pa.field("user_dense", pa.list_(pa.float32()), nullable=False),
    pa.field("history", pa.list_(pa.int32()), nullable=False),
    pa.field("cand_items", pa.list_(pa.int32()), nullable=False),
    pa.field("cand_dense", pa.list_(pa.list_(pa.float32())), nullable=False),
    pa.field("labels", pa.list_(pa.float32()), nullable=True),
])
_IDS = ("history", "cand_items")
_REQUIRED = ("user_dense", "history", "cand_items", "cand_dense")
_LOG = logging.getLogger(__name__)


class DataError(ValueError):
  """A file that breaks the schema's contract; names the file, the row and the field."""


def write_requests(requests: Sequence[Request], path: str | os.PathLike) -> None:
  """Writes `requests` to one Parquet file in `SCHEMA`, with page checksums.

  A request with a field of None is refused (it would be written as null, or as empty).
  """
  columns = {name: [] for name in SCHEMA.names}
  for i, r in enumerate(requests):
    if r.cand_groups is not None or r.group_dense is not None:
      raise DataError(f"{path}: request {i} has groups (cand_groups, group_dense), which "
                      "SCHEMA has no columns for: writing it would drop them")
    missing = [name for name in _REQUIRED if getattr(r, name) is None]
    if missing:
      raise DataError(f"{path}: request {i}: field {missing[0]} is None; nothing but labels "
                      "may be null")
    columns["user_dense"].append(np.asarray(r.user_dense).tolist())
    columns["history"].append(np.asarray(r.history).tolist())
    columns["cand_items"].append(np.asarray(r.cand_items).tolist())
    columns["cand_dense"].append(np.asarray(r.cand_dense).tolist())
    columns["labels"].append(None if r.labels is None else np.asarray(r.labels).tolist())
  pq.write_table(pa.Table.from_pydict(columns, schema=SCHEMA), path, write_page_checksum=True)


def read_requests(path: str | os.PathLike, config: RankerConfig, *,
                  require_labels: bool = True) -> list[Request]:
  """The requests of one file, every row checked against `SCHEMA` and `config` first.

  Raises `DataError` naming the file, the first rows and the field that break
  the contract; labels may be absent only with `require_labels=False` (scoring).
  The files hold no groups, so a `config` with a group level is refused.
  """
  if config.has_groups:
    raise DataError(f"{path}: request files have no group columns, and the model has a group "
                    f"level (RankerConfig.group_dense={config.group_dense})")
  try:
    table = pq.read_table(path, page_checksum_verification=True)
    checksums = has_page_checksums(path)
  except (OSError, pa.ArrowException) as e:
    raise DataError(f"{path}: not a readable Parquet file: {e}") from None
  if not checksums:
    _LOG.warning("%s: its pages carry no checksums, so a corrupted byte that still passes the "
                 "schema's checks would go unseen (write it with page checksums: "
                 "ikbo_jax.data.page_checksums)", path)
  if table.num_rows == 0:
    raise DataError(f"{path}: the file has no rows")
  table = _conform(table, path, require_labels)
  _check_rows(table, path, config)
  rows = table.to_pydict()
  n = [len(c) for c in rows["cand_items"]]
  labels = rows.get("labels") or [None] * table.num_rows
  return [Request(user_dense=np.asarray(u, np.float32), history=np.asarray(h, np.int32),
                  cand_items=np.asarray(c, np.int32),
                  cand_dense=np.asarray(d, np.float32).reshape(k, config.cand_dense),
                  labels=None if y is None else np.asarray(y, np.float32))
          for u, h, c, d, y, k in zip(rows["user_dense"], rows["history"], rows["cand_items"],
                                      rows["cand_dense"], labels, n)]


def _conform(table: pa.Table, path, require_labels: bool) -> pa.Table:
  """The table in `SCHEMA`'s types: integer ids widened or narrowed, nothing else converted."""
  names = set(table.column_names)
  required = [f.name for f in SCHEMA if f.name != "labels" or require_labels]
  missing, unknown = sorted(set(required) - names), sorted(names - set(SCHEMA.names))
  if missing or unknown:
    raise DataError(f"{path}: columns missing {missing}, unknown {unknown}; the schema is "
                    f"{SCHEMA.names}")
  columns = {}
  for field in SCHEMA:
    if field.name not in names:
      continue
    column = table.column(field.name)
    actual = column.type
    while pa.types.is_list(actual) or pa.types.is_large_list(actual):
      actual = actual.value_type
    wanted = field.type
    while pa.types.is_list(wanted):
      wanted = wanted.value_type
    if _depth(column.type) != _depth(field.type):
      raise DataError(f"{path}: field {field.name} must be {field.type}, got {column.type} "
                      f"(nested {_depth(column.type)} levels deep, not {_depth(field.type)})")
    if pa.types.is_integer(wanted) and not pa.types.is_integer(actual):
      raise DataError(f"{path}: field {field.name} must hold integer item ids, got "
                      f"{column.type} (ids are never truncated or parsed)")
    if pa.types.is_floating(wanted) and not (pa.types.is_floating(actual)
                                             or pa.types.is_integer(actual)):
      raise DataError(f"{path}: field {field.name} must hold numbers, got {column.type}")
    if field.name != "labels" or require_labels:  # scoring data may leave labels null
      _check_no_nulls(column, field.name, path)
    try:
      columns[field.name] = column.cast(field.type)  # checks integer overflow
    except pa.ArrowException as e:
      raise DataError(f"{path}: field {field.name} does not fit {field.type}: {e}") from None
  return pa.table(columns)


def _depth(arrow_type) -> int:
  """How many list levels `arrow_type` has."""
  depth = 0
  while pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
    arrow_type, depth = arrow_type.value_type, depth + 1
  return depth


def _check_no_nulls(column, name: str, path) -> None:
  flat, depth = column, 0
  while True:
    nulls = pc.is_null(flat)
    if pc.any(nulls).as_py():
      where = "" if depth == 0 else " (an element)"
      rows = _first_rows(nulls) if depth == 0 else "?"
      raise DataError(f"{path}: row {rows}: field {name} is null{where}; nothing may be null")
    if not pa.types.is_list(flat.type):
      return
    flat, depth = pc.list_flatten(flat), depth + 1


def _first_rows(mask) -> str:
  return _rows_text(np.flatnonzero(np.asarray(mask.to_numpy(zero_copy_only=False), bool)))


def _rows_text(rows) -> str:
  return ", ".join(map(str, rows[:5])) + (" and more" if len(rows) > 5 else "")


def _check_rows(table: pa.Table, path, config: RankerConfig) -> None:
  """Every row's lengths and values against `config`, whole columns at a time."""
  length = lambda name: pc.list_value_length(table.column(name))
  n = length("cand_items")
  checks = [
      ("user_dense", pc.not_equal(length("user_dense"), config.user_dense),
       f"must have {config.user_dense} values"),
      ("history", pc.greater(length("history"), config.max_history),
       f"must have at most max_history={config.max_history} items"),
      ("cand_items", pc.equal(n, 0), "must have at least one candidate"),
      ("cand_dense", pc.not_equal(length("cand_dense"), n),
       "must have one row per candidate (as many as cand_items)"),
  ]
  if "labels" in table.column_names:
    checks.append(("labels", pc.not_equal(length("labels"), n),
                   "must have one label per candidate"))
  for name, bad, rule in checks:
    if pc.any(bad).as_py():
      raise DataError(f"{path}: row {_first_rows(bad)}: field {name} {rule}")
  _check_values(table, path, config)


def _check_values(table: pa.Table, path, config: RankerConfig) -> None:
  """Ids in range, features finite and of the right width, labels 0 or 1; rows named."""
  def per_row(name, bad_elements, depth=1):
    """Rows of `name` holding a bad element (`bad_elements` over the flattened values)."""
    column = table.column(name).combine_chunks()
    parents = pc.list_parent_indices(column)
    if depth == 2:
      inner = pc.list_flatten(column)
      parents = pc.take(parents, pc.list_parent_indices(inner))
    rows = np.unique(np.asarray(parents)[np.asarray(bad_elements, bool)])
    return rows

  def fail(name, rows, rule):
    if len(rows):
      raise DataError(f"{path}: row {_rows_text(rows)}: field {name} {rule}")

  for name in _IDS:
    ids = np.asarray(pc.list_flatten(table.column(name)))
    fail(name, per_row(name, (ids < 0) | (ids >= config.num_items)),
         f"holds item ids outside [0, num_items={config.num_items})")
  dense = pc.list_flatten(table.column("cand_dense").combine_chunks())
  fail("cand_dense", per_row("cand_dense", np.asarray(pc.list_value_length(dense))
                             != config.cand_dense),
       f"must have {config.cand_dense} values per candidate (not transposed)")
  for name, depth in (("user_dense", 1), ("cand_dense", 2)):
    values = table.column(name)
    for _ in range(depth):
      values = pc.list_flatten(values)
    fail(name, per_row(name, ~np.isfinite(np.asarray(values)), depth), "must be finite")
  if "labels" in table.column_names:
    labels = np.asarray(pc.list_flatten(table.column("labels")))
    fail("labels", per_row("labels", (labels != 0) & (labels != 1)), "must be 0 or 1")
