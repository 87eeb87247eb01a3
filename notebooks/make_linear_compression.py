"""Builds notebooks/linear_compression.ipynb (run it, then execute the notebook)."""

import nbformat as nbf
from _maker import write

cells = [
    nbf.v4.new_markdown_cell(
        "# IKBO linear compression: the ladder and the sweeps\n\n"
        "Plots the benchmark results committed under `benchmarks/results/` (H200, bf16). "
        "Set `IKBO_RESULTS` to another JSON file to plot it instead; CI runs this notebook "
        "on CPU against a small result file it makes itself."),
    nbf.v4.new_code_cell(
        "import json, os\n"
        "import matplotlib.pyplot as plt\n"
        "path = os.environ.get('IKBO_RESULTS', '../benchmarks/results/linear_compression_h200.json')\n"
        "res = json.load(open(path))\n"
        "print(res['date'], res['commit'][:10], res['device'], 'jax', res['jax_version'])\n"
        "print('ceilings', res['ceilings'])"),
    nbf.v4.new_markdown_cell("## The ladder at the published shape"),
    nbf.v4.new_code_cell(
        "ladder = res['ladder']\n"
        "print(f\"{'variant':32s} {'ms':>7s} {'TFLOP/s':>8s} {'x base':>7s} {'/floor':>7s}\")\n"
        "for name, r in ladder.items():\n"
        "    print(f\"{name:32s} {r['ms']:7.3f} {r['tflops']:8.0f} \"\n"
        "          f\"{r['speedup_vs_prebroadcast_baseline']:7.2f} {r['ratio_to_floor']:7.2f}\")\n"
        "fig, ax = plt.subplots(figsize=(8, 3.5))\n"
        "ax.barh(list(ladder), [r['ms'] for r in ladder.values()])\n"
        "ax.invert_yaxis(); ax.set_xlabel('ms (median kernel time)')\n"
        "ax.set_title(f\"linear compression, {res['device']}\")\n"
        "plt.tight_layout(); plt.show()"),
    nbf.v4.new_markdown_cell(
        "## Training step: forward + backward\n\n"
        "The same cotangent through the materialized model and through the IKBO op (its "
        "default implementation: on the H200, the Mosaic GPU kernels forward and backward)."),
    nbf.v4.new_code_cell(
        "fwd_bwd = res['fwd_bwd']\n"
        "for name, value in fwd_bwd.items():\n"
        "    unit = 'x' if name == 'speedup' else 'ms'\n"
        "    print(f'{name:24s} {value:7.3f} {unit}')"),
    nbf.v4.new_markdown_cell("## Sweeps: candidates at ratio 70, and the candidates-per-user ratio"),
    nbf.v4.new_code_cell(
        "fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))\n"
        "for ax, key, xlabel in ((axes[0], 'sweep_b', 'B (candidates)'),\n"
        "                        (axes[1], 'sweep_ratio', 'candidates per user')):\n"
        "    sweep = res.get(key, {})\n"
        "    xs = sorted(sweep, key=float)\n"
        "    if not xs:\n"
        "        ax.set_title(f'{key}: not in this result file'); continue\n"
        "    for name in sweep[xs[0]]:\n"
        "        if name == 'baseline_prebroadcast':\n"
        "            continue\n"
        "        ax.plot([float(x) for x in xs],\n"
        "                [sweep[x][name]['speedup_vs_prebroadcast_baseline'] for x in xs],\n"
        "                marker='o', label=name)\n"
        "    ax.set_xlabel(xlabel); ax.set_ylabel('speedup vs pre-broadcast baseline')\n"
        "    if key == 'sweep_ratio':\n"
        "        ax.set_xscale('log')\n"
        "axes[1].legend(fontsize=7)\n"
        "plt.tight_layout(); plt.show()"),
]
write(cells, "linear_compression")
