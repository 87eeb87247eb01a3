"""Prints the README's attention result tables (markdown) from the committed JSON.

    python -m benchmarks.readme_tables
"""

from __future__ import annotations

import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _ms(row: dict) -> str:
  return f"{row['ms']:.3f}" if "ms" in row else "error"


def target_attention_table(path=RESULTS / "target_attention_h200.json") -> str:
  sweep = json.loads(pathlib.Path(path).read_text())["sweep"]
  columns = ("cudnn_prebroadcast", "broadcast_cudnn", "cudnn_packed_sorted", "triton_shuffled",
             "mosaic_gpu_cta_per_tile_shuffled", "mosaic_gpu_sorted", "mosaic_gpu_shuffled")
  lines = ["| S | cuDNN pre-broadcast | broadcast + cuDNN | cuDNN packed (sorted) | Triton "
           "| Mosaic GPU, CTA per tile | Mosaic GPU sorted | **Mosaic GPU** (shuffled) "
           "| TFLOP/s | roofline | x broadcast + cuDNN | x pre-broadcast | x packed |",
           "|---" * 13 + "|"]
  for seq_len, rows in sweep.items():
    ours = rows["mosaic_gpu_shuffled"]
    cells = [_ms(rows[name]) for name in columns[:-1]] + [f"**{_ms(ours)}**"]
    cells += [f"{ours['tflops']:.0f}", f"{ours.get('roofline_fraction', float('nan')):.2f}"]
    cells += [f"{ours[f'speedup_vs_{base}']:.2f}" for base in
              ("broadcast_cudnn", "cudnn_prebroadcast", "cudnn_packed_sorted")]
    lines.append(f"| {seq_len} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def self_target_table(path=RESULTS / "self_target_attention_h200.json") -> str:
  sweep = json.loads(pathlib.Path(path).read_text())["sweep"]
  lines = ["| S | fused (one launch) | cuDNN self + our target (two launches) "
           "| of which cuDNN self / target | materialized | fused TFLOP/s | roofline "
           "| two launches / fused |", "|---" * 8 + "|"]
  for seq_len, rows in sweep.items():
    for prefix in ("", "causal/"):
      fused = rows[prefix + "fused"]
      parts = f"{_ms(rows[prefix + 'self_cudnn'])} / {_ms(rows[prefix + 'target_mosaic_gpu'])}"
      label = f"{seq_len}, causal" if prefix else seq_len
      lines.append(
          f"| {label} | {_ms(fused)} | {_ms(rows[prefix + 'two_launches'])} | {parts} "
          f"| {_ms(rows[prefix + 'materialized'])} | {fused['tflops']:.0f} "
          f"| {fused.get('roofline_fraction', float('nan')):.2f} "
          f"| {fused['speedup_vs_two_launches']:.3f} |")
  return "\n".join(lines)


if __name__ == "__main__":
  print(target_attention_table(), "\n")
  print(self_target_table())
