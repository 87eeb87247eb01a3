"""The notebooks execute on CPU against a small result file made by the benchmark script."""

import os
import pathlib
import subprocess
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name,expected", [
    ("linear_compression", "baseline_materialized"),
    ("target_attention", "xla_materialized"),
    ("self_target_attention", "fused_xla"),
    ("ranking_system", "sustained QPS ratio"),
    ("rewrite", "fraction of the hand-written speedup"),
])
def test_notebook_executes_on_small_results(name, expected, tmp_path):
  results = tmp_path / "small.json"
  subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--small",
                  "--iterations", "2", "--out", str(results)], cwd=ROOT, check=True)
  nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
  os.environ["IKBO_RESULTS"] = str(results)
  try:
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
  finally:
    del os.environ["IKBO_RESULTS"]
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert expected in "".join(o.get("text", "") for o in outputs)
  assert any("image/png" in o.get("data", {}) for o in outputs), "the notebook drew no plot"
