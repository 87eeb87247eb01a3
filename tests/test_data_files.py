"""The Parquet contract: every bad file is refused before use, naming file, row and field.

Each case is one defect a real log had or could have (see ikbo_jax.data.files);
before the contract each of these was read silently (or failed deep inside training).
"""

import dataclasses
import logging
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ikbo_jax.data import files
from ikbo_jax.data import validate as validate_command
from ikbo_jax.data.page_checksums import has_page_checksums
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.models import RankerConfig
from ikbo_jax.training import __main__ as training_command

CONFIG = RankerConfig(num_items=300, max_history=16)


def _columns(rows=6) -> dict:
  gen = ClickGenerator(CONFIG, seed=4, mean_candidates=3, max_candidates=6)
  requests = gen.requests(rows)
  return {"user_dense": [r.user_dense.tolist() for r in requests],
          "history": [r.history.tolist() for r in requests],
          "cand_items": [r.cand_items.tolist() for r in requests],
          "cand_dense": [r.cand_dense.tolist() for r in requests],
          "labels": [r.labels.tolist() for r in requests]}


def _write(tmp_path, columns, schema=None) -> pathlib.Path:
  path = tmp_path / "requests.parquet"
  pq.write_table(pa.table(columns, schema=schema), path)
  return path


def _edit(column, row, value):
  def edit(columns):
    columns[column][row] = value(columns[column][row]) if callable(value) else value
    return columns
  return edit


CASES = {
    "null labels": (_edit("labels", 3, None), r"row 3: field labels is null"),
    "a null label": (_edit("labels", 2, lambda y: [None] + y[1:]), r"field labels is null"),
    "labels 5 and -1": (_edit("labels", 4, lambda y: [5.0] + y[1:]),
                        r"row 4: field labels must be 0 or 1"),
    "an unknown id": (_edit("cand_items", 1, lambda c: [300] + c[1:]),
                      r"row 1: field cand_items holds item ids outside \[0, num_items=300\)"),
    "a negative history id": (_edit("history", 5, lambda h: h + [-1]),
                              r"row 5: field history holds item ids outside"),
    "a transposed cand_dense": (
        _edit("cand_dense", 2, lambda d: np.asarray(d).T.tolist()),
        r"row 2: field cand_dense must have one row per candidate|row 2: field cand_dense must "
        r"have 4 values"),
    "a short user_dense": (_edit("user_dense", 0, lambda u: u[:-1]),
                           r"row 0: field user_dense must have 8 values"),
    "too long a history": (_edit("history", 3, lambda h: list(range(17))),
                           r"row 3: field history must have at most max_history=16"),
    "no candidates": (_edit("cand_items", 2, []), r"row 2: field cand_items must have at least"),
    "an infinite feature": (_edit("cand_dense", 1, lambda d: [[float("inf")] + d[0][1:]] + d[1:]),
                            r"row 1: field cand_dense must be finite"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_bad_row_is_refused_naming_file_row_and_field(tmp_path, name):
  edit, message = CASES[name]
  path = _write(tmp_path, edit(_columns()))
  with pytest.raises(files.DataError, match=message) as error:
    files.read_requests(path, CONFIG)
  assert str(path) in str(error.value)


@pytest.mark.parametrize("values, dtype, message", [
    ([[1.7, 2.9]], pa.float64(), r"must hold integer item ids, got list<\w+: double>"),
    ([["1", "2"]], pa.string(), r"must hold integer item ids, got list<\w+: string>"),
])
def test_ids_of_another_type_are_never_truncated_or_parsed(tmp_path, values, dtype, message):
  columns = _columns(1)
  columns["history"] = values
  schema = pa.schema([pa.field(n, pa.list_(dtype) if n == "history" else t)
                      for n, t in zip(files.SCHEMA.names, files.SCHEMA.types)])
  with pytest.raises(files.DataError, match=message):
    files.read_requests(_write(tmp_path, columns, schema), CONFIG)


def test_integer_ids_of_any_width_are_read(tmp_path):
  columns = _columns(3)
  schema = pa.schema([pa.field(n, pa.list_(pa.int64()) if n in ("history", "cand_items") else t)
                      for n, t in zip(files.SCHEMA.names, files.SCHEMA.types)])
  requests = files.read_requests(_write(tmp_path, columns, schema), CONFIG)
  assert [r.cand_items.tolist() for r in requests] == columns["cand_items"]
  assert requests[0].cand_items.dtype == np.int32


def test_an_empty_file_and_missing_labels_are_clear_errors(tmp_path):
  empty = _write(tmp_path, {n: [] for n in files.SCHEMA.names}, files.SCHEMA)
  with pytest.raises(files.DataError, match="has no rows"):
    files.read_requests(empty, CONFIG)
  columns = _columns()
  del columns["labels"]
  path = _write(tmp_path, columns)
  with pytest.raises(files.DataError, match=r"columns missing \['labels'\]"):
    files.read_requests(path, CONFIG)
  assert all(r.labels is None for r in files.read_requests(path, CONFIG, require_labels=False))


def test_a_corrupted_page_is_an_error_not_other_values(tmp_path):
  path = tmp_path / "requests.parquet"
  gen = ClickGenerator(CONFIG, seed=1)
  files.write_requests(gen.requests(200), path)
  data = bytearray(path.read_bytes())
  for offset in range(200, 260):  # inside the first column's data page
    data[offset] ^= 0x5A
  path.write_bytes(bytes(data))
  with pytest.raises(files.DataError, match="not a readable Parquet file"):
    files.read_requests(path, CONFIG)


def test_validate_prints_a_summary_or_the_first_failure(tmp_path, capsys):
  good = tmp_path / "good.parquet"
  files.write_requests(ClickGenerator(CONFIG, seed=2).requests(20), good)
  assert validate_command.main([str(good)]) == 0
  out = capsys.readouterr().out
  assert "20 requests" in out and "label rate" in out
  bad = _write(tmp_path, CASES["labels 5 and -1"][0](_columns()))
  assert validate_command.main([str(good), str(bad)]) == 1
  assert "invalid:" in capsys.readouterr().out


@pytest.mark.parametrize("dictionary", [True, False])
def test_page_checksums_are_detected_in_files_of_either_kind(tmp_path, dictionary):
  for checksums in (True, False):
    path = tmp_path / f"{checksums}.parquet"
    pq.write_table(pa.table(_columns()), path, write_page_checksum=checksums,
                   use_dictionary=dictionary)
    assert has_page_checksums(path) == checksums


def test_a_file_without_page_checksums_is_read_with_a_warning(tmp_path, caplog):
  path = _write(tmp_path, _columns())  # pyarrow's default: no checksums
  with caplog.at_level(logging.WARNING):
    assert len(files.read_requests(path, CONFIG)) == 6
  assert "carry no checksums" in caplog.text and str(path) in caplog.text
  files.write_requests(files.read_requests(path, CONFIG), path)  # written with checksums
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    files.read_requests(path, CONFIG)
  assert "checksums" not in caplog.text


@pytest.mark.parametrize("field, values", [
    ("cand_dense", lambda c: [np.ravel(d).tolist() for d in c["cand_dense"]]),  # one level up
    ("user_dense", lambda c: [[u] for u in c["user_dense"]]),  # one level down
    ("history", lambda c: [h[0] if h else 0 for h in c["history"]]),  # not a list at all
])
def test_a_field_nested_one_level_off_names_the_file_field_and_types(tmp_path, field, values):
  columns = _columns()
  columns[field] = values(columns)
  path = _write(tmp_path, columns)
  with pytest.raises(files.DataError, match=rf"{path}: field {field} must be list<.*, got .*"
                                            r"\(nested \d levels deep, not \d\)"):
    files.read_requests(path, CONFIG)


def test_a_request_with_a_null_field_is_refused_on_write(tmp_path):
  requests = ClickGenerator(CONFIG, seed=3).requests(3)
  requests[1] = dataclasses.replace(requests[1], history=None)
  with pytest.raises(files.DataError, match="request 1: field history is None"):
    files.write_requests(requests, tmp_path / "x.parquet")
  assert not (tmp_path / "x.parquet").exists()


def test_the_training_command_prints_a_data_error_in_one_line(tmp_path, capsys):
  bad = _write(tmp_path, CASES["labels 5 and -1"][0](_columns()))
  with pytest.raises(SystemExit) as exit_info:
    training_command.main(["--train-file", str(bad), "--eval-file", str(bad), "--steps", "2"])
  err = capsys.readouterr().err
  assert exit_info.value.code == 1 and "Traceback" not in err
  assert err.strip().count("\n") == 0 and "row 4: field labels" in err, err
