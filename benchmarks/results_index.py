"""The index of `benchmarks/results/`: each file, what produced it, at which commit, who cites it.

    python -m benchmarks.results_index --write   # regenerate the index in docs/results.md
    python -m benchmarks.results_index --check   # fail if it is stale (CI does this)

The index is the part of `docs/results.md` between the two `INDEX` markers; the
rest of that file is written by hand. A result file that no document, notebook or
script cites belongs in `benchmarks/results/archive/`, where the index still
lists it.
"""

from __future__ import annotations

import fnmatch
import json
import pathlib
import re
import sys

from benchmarks import generated

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "results.md"
START, END = "<!-- INDEX START (benchmarks/results_index.py) -->", "<!-- INDEX END -->"

# File name prefix -> what writes such a file (longest prefix wins).
PRODUCERS = {
    "linear_compression": "benchmarks/linear_compression.py",
    "lce_diagnostics": "benchmarks/lce_diagnostics.py",
    "target_attention": "benchmarks/target_attention.py",
    "self_target_attention": "benchmarks/self_target_attention.py",
    "attention_diagnostics": "benchmarks/attention_diagnostics.py",
    "attention_precision": "benchmarks/attention_precision.py",
    "gpu_gate": "benchmarks/gpu_run.sh steps and probes of one device session (summarized by hand)",
    "attention_profile": "the attention profiler (removed; git history at 96ba4de)",
    "ranking_system": "benchmarks/ranking_system.py",
    "ranker_profile": "benchmarks/ranker_profile.py",
    "ranking_groups": "benchmarks/ranking_system.py --items-per-group (gpu_run.sh ranker_groups)",
    "two_level": "benchmarks/two_level.py",
    "two_level_g128": "benchmarks/two_level.py (from its log: the run was cut before writing)",
    "overload": "benchmarks/ranking_system.py --parts overload",
    "serving_profile": "benchmarks/serving_profile.py",
    "http_server_cost": "benchmarks/http_server_cost.py (three runs each, merged by hand)",
    "http_server_cost_overload": "benchmarks/http_server_cost.py --overload 3",
    "serving_ladder": "benchmarks/ranking_system.py --parts serving (from its log)",
    "host_path": "benchmarks/host_path.py",
    "host_stages": "benchmarks/host_stages.py",
    "reply_coalescing": "an experiment: /proc CPU of the model process around http_front.py --stub (the code left the library)",
    "checkpoint_cost": "benchmarks/checkpoint_cost.py (ranking_system --parts checkpoint; from its log)",
    "rewrite_fuzz": "tools/rewrite_fuzz.py",
    "rewrite_two_level": "tests/test_rewrite_two_level.py, long profile",
    "rewrite_old_code": "tools/rewrite_fuzz.py on the old code",
    "rewrite": "benchmarks/rewrite.py",
    "soak": "tools/soak.py",
    "cache_soak": "tools/cache_soak.py",
    "gpu_sweep": "tests/test_gpu_sweep.py",
    "gpu_checks": "pytest -m gpu and the GPU sweep, one device call (summarized by hand)",
    "correctness_sweep": "tests/test_gpu_sweep.py (an earlier form)",
    "gpu_rewrite_tests": "pytest tests/test_rewrite*.py on the GPU",
    "gpu_tests": "pytest -m gpu (benchmarks/gpu_run.sh)",
    "main_job": "python -m ikbo_jax (benchmarks/gpu_run.sh system)",
    "demo": "python -m ikbo_jax.demo",
    "ncu": "Nsight Compute (benchmarks/gpu_run.sh attention_ncu)",
    "nvidia_smi": "nvidia-smi (benchmarks/gpu_run.sh)",
    "old_code_repro": "a reproduction on the code before a fix",
    "sigterm_under_load": "tools/sigterm_under_load.py",
    "http_front": "benchmarks/http_front.py",
    "http_replicas": "benchmarks/http_front.py --replicas",
    "pytriton_front": "benchmarks/pytriton_front.py",
    "model_process_cost": "benchmarks/model_process_cost.py",
    "load_client_cost": "benchmarks/load_client_cost.py",
    "held_head_experiment": "an experiment: http_front.py --stub and load_client_cost.py around code since reverted",
    "model_process_experiments": "experiments: benchmarks/model_process_cost.py --rates around code since reverted",
}
# Where citations are looked for.
CITING = ("README.md", "docs/*.md", "notebooks/*.py", "benchmarks/*.py", "benchmarks/*.sh",
          "tests/*.py")


def _producer(name: str) -> str:
  matches = [p for p in PRODUCERS if name.startswith(p)]
  return PRODUCERS[max(matches, key=len)] if matches else "?"


def _facts(path: pathlib.Path) -> tuple[str, str, str]:
  """`(commit, date, device)` from a JSON result, else from the file name (`..._<commit>.log`)."""
  commit = date = device = ""
  if path.suffix == ".json":
    try:
      data = json.loads(path.read_text())
    except json.JSONDecodeError:
      data = {}
    if isinstance(data, dict):
      commit = str(data.get("commit", ""))[:10].split(" ")[0]
      date, device = str(data.get("date", ""))[:10], str(data.get("device", ""))
  if not commit and (found := re.search(r"_([0-9a-f]{7})\.\w+$", path.name)):
    commit = found.group(1)
  return commit or "-", date or "-", device or "-"


def _citations() -> dict[str, str]:
  """Text of every citing file (the generated index itself excluded), by relative path."""
  texts = {}
  for pattern in CITING:
    for path in sorted(ROOT.glob(pattern)):
      text = path.read_text(errors="ignore")
      if path == DOC and START in text:
        text = text[:text.index(START)] + text[text.index(END):]
      texts[str(path.relative_to(ROOT))] = text
  return texts


def _cited_by(name: str, texts: dict[str, str]) -> list[str]:
  """Files that name `name`, or a glob in backticks that matches it."""
  cited = []
  for source, text in texts.items():
    globs = [g.rsplit("/", 1)[-1] for g in re.findall(r"`([^`\s]*\*[^`\s]*)`", text)]
    if name in text or any(fnmatch.fnmatch(name, g) for g in globs if g):
      cited.append(source)
  return cited


def index() -> str:
  """The generated index, markers included."""
  texts = _citations()
  rows = ["| file | produced by | commit | date | device | cited by |", "|---|---|---|---|---|---|"]
  for path in sorted(p for p in RESULTS.rglob("*") if p.is_file()):
    rel = str(path.relative_to(RESULTS))
    commit, date, device = _facts(path)
    cited = ", ".join(_cited_by(path.name, texts))
    cited = cited or ("archived" if rel.startswith("archive/") else "nothing (archive it)")
    rows.append(f"| `{rel}` | {_producer(path.name)} | {commit} | {date} | {device} | {cited} |")
  return "\n".join([START, "", *rows, "", END])


def render(doc: str) -> str:
  """`doc` with its index replaced by a freshly generated one."""
  return generated.between(doc, START, END, index())


def main(argv=None) -> int:
  return generated.main(argv, prog="python -m benchmarks.results_index", description=__doc__,
                        path=DOC, render=render)


if __name__ == "__main__":
  sys.exit(main())
