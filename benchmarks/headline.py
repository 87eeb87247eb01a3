"""The README's headline table, generated from the committed results.

    python -m benchmarks.headline --write   # regenerate the table in README.md
    python -m benchmarks.headline --check   # fail if it is stale (CI does this)

Each row names the result file and the entries it reads, so a new run of a
benchmark changes the README only through this script. The table is the part of
`README.md` between the two `HEADLINE` markers.
"""

from __future__ import annotations

import json
import pathlib
import sys

from benchmarks import generated

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
START, END = "<!-- HEADLINE START (benchmarks/headline.py) -->", "<!-- HEADLINE END -->"


def _load(name: str) -> dict:
  return json.loads((RESULTS / name).read_text())


def _ms(x) -> float:
  return x["ms"] if isinstance(x, dict) else x


def _row(what: str, ours, baseline_text: str, *baselines) -> str:
  """`what | ours ms | baseline text | speedup over each baseline`."""
  speedups = " / ".join(f"{_ms(b) / _ms(ours):.2f}x" for b in baselines)
  return f"| {what} | {_ms(ours):.3f} ms | {baseline_text} | {speedups} |"


def rows() -> list[str]:
  lce = _load("linear_compression_h200.json")
  ladder, fwd_bwd = lce["ladder"], lce["fwd_bwd"]
  target = _load("target_attention_h200.json")["sweep"]["1024"]
  backward = _load("target_attention_backward_h200.json")["sweep"]["1024"]
  system = _load("ranking_system_h200.json")
  inference, training = system["inference"]["B1024_ratio70"], system["training"]
  ranker = _load("rewrite_h200.json")["cases"]["ranker"]
  # The default path: the Mosaic GPU forward with the Triton backward kernels.
  ours_bwd = backward["fwd_bwd/mosaic_gpu_shuffled"]
  return [
      _row("linear compression, B=1024, ratio 70 (Mosaic GPU, one launch)",
           ladder["mosaic_gpu_fused_padded_pre"],
           f"XLA/cuBLAS on a broadcast made outside the timing, "
           f"{_ms(ladder['baseline_prebroadcast']):.3f} ms", ladder["baseline_prebroadcast"]),
      _row("linear compression forward + backward", fwd_bwd["ikbo_mosaic_gpu"],
           f"the materialized model under plain autodiff, {fwd_bwd['materialized']:.3f} ms",
           fwd_bwd["materialized"]),
      _row("target attention forward, B=2048, U=32, S=1024", target["mosaic_gpu_shuffled"],
           f"broadcast + cuDNN {_ms(target['broadcast_cudnn']):.3f} ms / cuDNN on the sorted "
           f"packed per-user layout {_ms(target['cudnn_packed_sorted']):.3f} ms",
           target["broadcast_cudnn"], target["cudnn_packed_sorted"]),
      _row("target attention forward + backward, S=1024", ours_bwd,
           f"broadcast + cuDNN {_ms(backward['fwd_bwd/broadcast_cudnn']):.3f} ms / cuDNN on "
           f"the packed layout {_ms(backward['fwd_bwd/cudnn_packed_sorted']):.3f} ms",
           backward["fwd_bwd/broadcast_cudnn"], backward["fwd_bwd/cudnn_packed_sorted"]),
      _row("reference ranker, B=1024, ratio 70, inference", inference["ikbo"],
           f"the standard build, {_ms(inference['standard']):.3f} ms", inference["standard"]),
      _row("reference ranker, training step", training["ikbo"],
           f"the standard build, {_ms(training['standard']):.3f} ms", training["standard"]),
      f"| the rewrite on the standard ranker | {_ms(ranker['rewritten']):.3f} ms | hand-written "
      f"IKBO {_ms(ranker['ikbo']):.3f} ms (the original {_ms(ranker['original']):.3f} ms) | "
      f"{100 * ranker['fraction_of_ikbo_speedup']:.0f}% of by hand |",
  ]


def table() -> str:
  header = ["| what (published shapes) | IKBO | baseline in the same run | speedup |",
            "|---|---|---|---|"]
  return "\n".join([START, *header, *rows(), END])


def render(text: str) -> str:
  """`text` (the README) with its headline table regenerated."""
  return generated.between(text, START, END, table())


def main(argv=None) -> int:
  return generated.main(argv, prog="python -m benchmarks.headline", description=__doc__,
                        path=README, render=render)


if __name__ == "__main__":
  sys.exit(main())
