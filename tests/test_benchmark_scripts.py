"""The benchmark scripts keep working: their --small mode runs on CPU."""

import json
import pathlib
import subprocess
import sys


ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_target_attention_benchmark_small(tmp_path):
  out = tmp_path / "ta.json"
  subprocess.run([sys.executable, "-m", "benchmarks.target_attention", "--small",
                  "--iterations", "2", "--out", str(out)], cwd=ROOT, check=True)
  result = json.loads(out.read_text())
  row = result["sweep"]["32"]["xla_materialized"]
  assert row["ms"] > 0 and 0 < row["roofline_fraction"] and row["tbps"] > 0


def test_self_target_attention_benchmark_small(tmp_path):
  out = tmp_path / "sta.json"
  subprocess.run([sys.executable, "-m", "benchmarks.self_target_attention", "--small",
                  "--iterations", "2", "--out", str(out)], cwd=ROOT, check=True)
  rows = json.loads(out.read_text())["sweep"]["32"]
  assert rows["fused_xla"]["ms"] > 0 and rows["block/user_sequence_block"]["ms"] > 0
  assert 0 < rows["fused_xla"]["roofline_fraction"] and rows["fused_xla"]["tbps"] > 0


def test_ranking_system_benchmark_small(tmp_path):
  out = tmp_path / "rs.json"
  subprocess.run([sys.executable, "-m", "benchmarks.ranking_system", "--small",
                  "--iterations", "2", "--requests-per-rate", "30", "--sizes", "64",
                  "--ratios", "8", "--rates", "100", "--buckets", "1", "--out", str(out)],
                 cwd=ROOT, check=True)
  result = json.loads(out.read_text())
  for row in (*result["inference"].values(), result["training"]):
    assert row["ikbo"]["ms"] > 0 and row["standard"]["ms"] > 0 and row["speedup"] > 0
  serving = result["serving"]
  assert serving["ikbo"]["ladder"] and serving["standard"]["ladder"]
  assert all(s["errors"] == 0 for s in serving["ikbo"]["ladder"])


def test_rewrite_benchmark_small(tmp_path):
  out = tmp_path / "rw.json"
  subprocess.run([sys.executable, "-m", "benchmarks.rewrite", "--small", "--iterations", "2",
                  "--out", str(out)], cwd=ROOT, check=True)
  cases = json.loads(out.read_text())["cases"]
  assert set(cases) == {"lce", "target_attention", "dlrm", "ranker"}
  for row in cases.values():
    assert row["original"]["ms"] > 0 and row["rewritten"]["ms"] > 0 and row["ikbo"]["ms"] > 0
    assert "materialized" not in row["changes"], row["changes"]
