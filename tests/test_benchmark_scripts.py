"""The benchmark scripts keep working: their --small mode runs on CPU."""

import json
import pathlib
import subprocess
import sys

import pytest

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


def test_attention_profile_summary_counts_cycles_per_item():
  """The profiler trace summary, on a synthetic trace of one CTA (two consumers, a producer)."""
  from benchmarks.attention_profile import TRACES_PER_CTA, summarize
  events = []

  def phase(tid, name, begin, end):
    events.append(dict(name=name, ph="B", ts=begin / 1e3, tid=tid))
    events.append(dict(name=name, ph="E", ts=end / 1e3, tid=tid))

  for wg in range(2):
    for item in range(4):  # item 0 is the warm-up; items 1-2 are whole, item 3 only starts
      start = 1000 * item + 7 * wg
      phase(wg + 1, "item_start", start, start + 10)
      for step in range(2):
        at = start + 10 + 300 * step
        events.append(dict(name="qk", ph="B", ts=at / 1e3, tid=wg + 1))
        phase(wg + 1, "turn", at + 5, at + 50)
        events.append(dict(name="qk", ph="E", ts=(at + 100) / 1e3, tid=wg + 1))
        phase(wg + 1, "softmax", at + 100, at + 250)
  phase(TRACES_PER_CTA, "producer_only", 0, 5)  # the producer's trace is not a consumer's
  summary = summarize(dict(traceEvents=events))
  for wg in range(2):
    consumer = summary[f"consumer{wg}"]
    assert consumer["items"] == 2 and consumer["steps_per_item"] == 2
    assert consumer["cycles_per_item"] == pytest.approx(1000)
    phases = consumer["phase_cycles_per_item"]
    assert phases == pytest.approx(
        {"item_start": 10, "qk": 200, "turn": 90, "softmax": 300,
         "outside phases": 1000 - 10 - 200 - 300})
  assert [name for name, _, _ in summary["timeline"]["consumer0"]][:3] == ["item_start", "qk", "turn"]
