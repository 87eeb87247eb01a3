"""The benchmark scripts run in their --small mode on CPU, and each notebook executes on the
result file its script wrote, drawing its plots."""

import json
import os
import pathlib
import subprocess
import sys

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The script's arguments beyond --small, and a line the notebook must print.
SCRIPTS = {
    "linear_compression": ([], "baseline_materialized"),
    "target_attention": ([], "xla_materialized"),
    "self_target_attention": ([], "fused_xla"),
    "ranking_system": (["--requests-per-rate", "30", "--seconds-per-rate", "0", "--sizes", "64",
                        "--ratios", "8", "--rates", "100", "200", "--buckets", "1",
                        "--repeats", "1", "--cache-mb", "1"],
                       "sustained QPS ratio"),
    "rewrite": ([], "fraction of the hand-written speedup"),
    "two_level": ([], "vs one level with the group copied"),
}


@pytest.fixture(scope="module", params=sorted(SCRIPTS))
def small_run(request, tmp_path_factory):
  """(script name, its JSON result) of one --small run."""
  name = request.param
  out = tmp_path_factory.mktemp(name) / "small.json"
  subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--small", "--iterations", "2",
                  *SCRIPTS[name][0], "--out", str(out)], cwd=ROOT, check=True)
  return name, out


def test_small_results_are_complete(small_run):
  name, out = small_run
  result = json.loads(out.read_text())
  assert result["date"] and result["commit"] and result["jax_version"]
  host = result["host"]  # which machine: the serving numbers are its as much as the device's
  assert host["cpus"] >= 1 and host["kernel"] and host["socket_round_trip_us"] > 0
  if name == "target_attention":
    row = result["sweep"]["32"]["xla_materialized"]
    assert row["ms"] > 0 and 0 < row["roofline_fraction"] and row["tbps"] > 0
  elif name == "self_target_attention":
    rows = result["sweep"]["32"]
    assert rows["fused_xla"]["ms"] > 0 and rows["block/user_sequence_block"]["ms"] > 0
    assert 0 < rows["fused_xla"]["roofline_fraction"] and rows["fused_xla"]["tbps"] > 0
  elif name == "ranking_system":
    for row in (*result["inference"].values(), result["training"]):
      assert row["ikbo"]["ms"] > 0 and row["standard"]["ms"] > 0 and row["speedup"] > 0
    serving = result["serving"]
    assert serving["ikbo"]["ladder"] and serving["standard"]["ladder"]
    for build in ("ikbo", "standard"):
      stages = serving[build]["breakdown"]["one_request"]
      assert all(stages[s] > 0 for s in ("pack", "transfer", "execute", "fetch"))
      assert serving[build]["device_bound_qps"] > 0 and stages["device"] > 0
      assert stages["whole_call"] > 0 and serving[build]["single_request"]["p50_ms"] > 0
      stress = result["overload"][build]
      assert stress["requests"] > 0 and stress["answered"] + stress["errors"] == stress["requests"]
      assert set(stress["errors_by_kind"]) <= {"429", "503"}, stress["errors_by_kind"]
      assert stress["drain_seconds"] < 30
    assert all(s["errors"] == 0 for s in serving["ikbo"]["ladder"])
    cache = result["cache"]["1.0MB"]
    assert cache["capacity"] > 0 and 0 <= cache["cache"]["hit_rate"] <= 1 and cache["ladder"]
    assert cache["full_batch_all_hits_ms"] > 0 and result["cache"]["full_batch"]["user_side_ms"] > 0
    assert all(row["user_side_ms"] > 0 and row["candidate_side_ms"] > 0
               for row in result["split"].values())
    saving = result["checkpoint"]["intervals"]["10"]
    assert saving["saves_per_round"] == 4 and saving["plain_ms_per_step"] > 0
  elif name == "rewrite":
    cases = result["cases"]
    towers = {"tower", "scan_tower", "lookup_tower"}
    assert set(cases) == {"lce", "lce_take", "target_attention", "dlrm", "ranker", "repeat_dlrm",
                          "pairwise", "gqa_attention", *towers}
    for case, row in cases.items():
      assert row["original"]["ms"] > 0 and row["rewritten"]["ms"] > 0 and row["ikbo"]["ms"] > 0
      assert all(row[build]["kernels"] > 0 for build in ("original", "rewritten", "ikbo"))
      assert row["rewritten_relative_error"] < 1e-4, (case, row["rewritten_relative_error"])
      # A tower's scores multiply user rows by candidate rows: that one copy is inherent.
      expected = "1 materialized" if case in towers else "materialized"
      assert (expected in row["changes"]) == (case in towers), row["changes"]
  elif name == "two_level":
    for point in result["points"].values():
      assert point["rows"]["two_level"]["ms"] > 0 and point["rows"]["floor_own_gemms"]["ms"] > 0
      assert point["rel_diff_vs_materialized"] < 1e-5 and point["fwd_bwd_ms"]["two_level"] > 0
      assert all(point["attention"]["rows"][name]["ms"] > 0 for name in (
          "two_level", "two_level_two_launches", "one_level_per_group",
          "one_level_per_group_pre"))
  elif name == "linear_compression":
    row = result["ladder"]["baseline_materialized"]
    assert row["ms"] > 0 and 0 < row["roofline_fraction"] and row["tbps"] > 0


def test_notebook_executes_and_plots(small_run):
  # From the text source (jupytext percent format), which is what gets edited and reviewed.
  name, out = small_run
  nb = jupytext.read(ROOT / "notebooks" / f"{name}.py")
  os.environ["IKBO_RESULTS"] = str(out)
  try:
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
  finally:
    del os.environ["IKBO_RESULTS"]
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert SCRIPTS[name][1] in "".join(o.get("text", "") for o in outputs)
  assert any("image/png" in o.get("data", {}) for o in outputs), "the notebook drew no plot"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_notebook_text_source_and_ipynb_are_in_sync(name):
  """Each `notebooks/<name>.py` is paired with its `.ipynb` (`jupytext --sync` after an edit)."""
  text = jupytext.read(ROOT / "notebooks" / f"{name}.py")
  stored = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
  assert [(c.cell_type, c.source) for c in text.cells] == [
      (c.cell_type, c.source) for c in stored.cells], f"run: jupytext --sync notebooks/{name}.py"


def test_http_server_cost_measures_the_server_process(tmp_path):
  out = tmp_path / "cost.json"
  subprocess.run([sys.executable, "-m", "benchmarks.http_server_cost", "--small", "--requests",
                  "100", "--content-type", "application/msgpack", "--timeout-ms", "5000",
                  "--out", str(out)],
                 cwd=ROOT, check=True)
  result = json.loads(out.read_text())
  assert result["statuses"] == {"200": 100} and result["server_cpu_ms_per_request"] > 0
