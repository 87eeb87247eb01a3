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
