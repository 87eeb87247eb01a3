"""Builds notebooks/self_target_attention.ipynb (run it, then execute the notebook)."""

import nbformat as nbf
from _maker import write

cells = [
    nbf.v4.new_markdown_cell(
        "# IKBO self + target attention: one launch vs two\n\n"
        "Plots the benchmark results committed under `benchmarks/results/` (H200, bf16, "
        "B=2048 candidates of U=32 users, H=2, D=128, n_seed=64). `fused` runs the users' "
        "self-attention and the candidates' target attention in one Mosaic GPU launch; "
        "`two_launches` runs cuDNN self-attention and then our target attention kernel; "
        "`materialized` is cuDNN self-attention plus broadcast + cuDNN target attention. Set "
        "`IKBO_RESULTS` to another JSON file to plot it instead; CI runs this notebook on CPU "
        "against a small result file it makes itself."),
    nbf.v4.new_code_cell(
        "import json, os\n"
        "import matplotlib.pyplot as plt\n"
        "path = os.environ.get('IKBO_RESULTS',\n"
        "                      '../benchmarks/results/self_target_attention_h200.json')\n"
        "res = json.load(open(path))\n"
        "print(res['date'], res['commit'][:10], res['device'], 'jax', res['jax_version'])\n"
        "print('shape', res['shape'], res['dtype'], '| FLOPs:', res['flops'])\n"
        "sweep = res['sweep']\n"
        "seq_lens = sorted(sweep, key=int)"),
    nbf.v4.new_markdown_cell("## Every row: median kernel time, throughput, speedups"),
    nbf.v4.new_code_cell(
        "print(f\"{'S':>5s} {'variant':42s} {'ms':>8s} {'TFLOP/s':>8s} {'roofline':>8s}  speedups\")\n"
        "for s in seq_lens:\n"
        "    for name, r in sweep[s].items():\n"
        "        if 'ms' not in r:\n"
        "            print(f\"{s:>5s} {name:42s} {r['error'][:40]}\"); continue\n"
        "        ratios = {k.removeprefix('speedup_vs_'): round(v, 3) for k, v in r.items()\n"
        "                  if k.startswith('speedup_vs_')}\n"
        "        tflops = f\"{r['tflops']:8.0f}\" if 'tflops' in r else ' ' * 8\n"
        "        roofline = f\"{r['roofline_fraction']:8.2f}\" if 'roofline_fraction' in r else ' ' * 8\n"
        "        print(f\"{s:>5s} {name:42s} {r['ms']:8.3f} {tflops} {roofline}  {ratios or ''}\")"),
    nbf.v4.new_markdown_cell(
        "## Fused launch vs two launches\n\n"
        "Time of the two launches divided by the fused launch's: above 1 the fused launch is "
        "faster."),
    nbf.v4.new_code_cell(
        "fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))\n"
        "for prefix, label in (('', 'non-causal'), ('causal/', 'causal'),\n"
        "                      ('fwd_bwd/', 'fwd+bwd, non-causal')):\n"
        "    xs = [int(s) for s in seq_lens\n"
        "          if 'speedup_vs_two_launches' in sweep[s].get(prefix + 'fused', {})]\n"
        "    if xs:\n"
        "        axes[0].plot(xs, [sweep[str(x)][prefix + 'fused']['speedup_vs_two_launches']\n"
        "                          for x in xs], marker='o', label=label)\n"
        "    xs = [int(s) for s in seq_lens if 'tflops' in sweep[s].get(prefix + 'fused', {})]\n"
        "    axes[1].plot(xs, [sweep[str(x)][prefix + 'fused']['tflops'] for x in xs],\n"
        "                 marker='o', label='fused, ' + label)\n"
        "axes[0].axhline(1.0, color='gray', lw=0.8)\n"
        "axes[0].set_ylabel('two launches / fused'); axes[1].set_ylabel('TFLOP/s (combined)')\n"
        "for ax in axes:\n"
        "    ax.set_xscale('log', base=2); ax.set_xlabel('S (history length)')\n"
        "    ax.legend(fontsize=7)\n"
        "fig.suptitle(f\"self + target attention, {res['device']}\")\n"
        "plt.tight_layout(); plt.show()"),
]
write(cells, "self_target_attention")
