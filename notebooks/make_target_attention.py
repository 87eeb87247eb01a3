"""Builds notebooks/target_attention.ipynb (run it, then execute the notebook)."""

import nbformat as nbf
from _maker import write

cells = [
    nbf.v4.new_markdown_cell(
        "# IKBO target attention: the sequence-length sweep\n\n"
        "Plots the benchmark results committed under `benchmarks/results/` (H200, bf16, "
        "B=2048 candidates of U=32 users, H=2, D=128, n_seed=64). Set `IKBO_RESULTS` to another "
        "JSON file to plot it instead; CI runs this notebook on CPU against a small result file "
        "it makes itself."),
    nbf.v4.new_code_cell(
        "import json, os\n"
        "import matplotlib.pyplot as plt\n"
        "path = os.environ.get('IKBO_RESULTS', '../benchmarks/results/target_attention_h200.json')\n"
        "res = json.load(open(path))\n"
        "print(res['date'], res['commit'][:10], res['device'], 'jax', res['jax_version'])\n"
        "print('shape', res['shape'], res['dtype'])\n"
        "sweep = res['sweep']\n"
        "seq_lens = sorted(sweep, key=int)\n"
        "names = sorted({n for s in seq_lens for n in sweep[s]})"),
    nbf.v4.new_markdown_cell(
        "## Forward: median kernel time and throughput\n\n"
        "TFLOP/s counts `4*B*H*n_seed*S*D` (forward) and 2.5x that for forward + backward; "
        "roofline is the fraction of the time that the FLOPs would take at the bf16 matmul rate "
        "measured in the same run (the bytes never bind here)."),
    nbf.v4.new_code_cell(
        "print(f\"{'S':>6s} {'variant':34s} {'ms':>8s} {'TFLOP/s':>8s} {'roofline':>8s}\")\n"
        "for s in seq_lens:\n"
        "    for name, r in sweep[s].items():\n"
        "        if 'ms' in r:\n"
        "            roofline = r.get('roofline_fraction', float('nan'))\n"
        "            print(f\"{s:>6s} {name:34s} {r['ms']:8.3f} {r['tflops']:8.0f} {roofline:8.2f}\")\n"
        "        else:\n"
        "            print(f\"{s:>6s} {name:34s} {r['error'][:40]}\")"),
    nbf.v4.new_code_cell(
        "fig, ax = plt.subplots(figsize=(8, 4))\n"
        "for name in names:\n"
        "    if name.startswith('fwd_bwd/'):\n"
        "        continue\n"
        "    xs = [int(s) for s in seq_lens if 'tflops' in sweep[s].get(name, {})]\n"
        "    ax.plot(xs, [sweep[str(x)][name]['tflops'] for x in xs], marker='o', label=name)\n"
        "ax.set_xscale('log', base=2); ax.set_xlabel('S (history length)')\n"
        "ax.set_ylabel('TFLOP/s'); ax.set_title(f\"target attention forward, {res['device']}\")\n"
        "ax.legend(fontsize=7); plt.tight_layout(); plt.show()"),
    nbf.v4.new_markdown_cell("## Speedups of the IKBO kernels over the baselines measured in the same run"),
    nbf.v4.new_code_cell(
        "for s in seq_lens:\n"
        "    for name, r in sweep[s].items():\n"
        "        ratios = {k.removeprefix('speedup_vs_'): round(v, 2) for k, v in r.items()\n"
        "                  if k.startswith('speedup_vs_')}\n"
        "        if ratios and ('mosaic' in name or 'triton' in name or 'xla' in name):\n"
        "            print(s, name, ratios)"),
]
write(cells, "target_attention")
