"""Builds notebooks/ranking_system.ipynb (run it, then execute the notebook)."""

import nbformat as nbf
from _maker import write

cells = [
    nbf.v4.new_markdown_cell(
        "# The reference ranker end to end: IKBO build vs standard build\n\n"
        "Plots `benchmarks/ranking_system.py` results: one model, one set of parameters, run as "
        "the IKBO build (user work once per user, the mapping passed to the IKBO layers) and as "
        "the standard build (user inputs copied to every candidate first). Set `IKBO_RESULTS` "
        "to another JSON file to plot it instead; the test runs this notebook on CPU against a "
        "small result file it makes itself."),
    nbf.v4.new_code_cell(
        "import json, os\n"
        "import matplotlib.pyplot as plt\n"
        "path = os.environ.get('IKBO_RESULTS', '../benchmarks/results/ranking_system_h200.json')\n"
        "res = json.load(open(path))\n"
        "print(res['date'], res['commit'][:10], res['device'], 'jax', res['jax_version'])\n"
        "print(res['config'])"),
    nbf.v4.new_markdown_cell(
        "## Inference: the forward pass per batch\n\n"
        "B candidates of B / ratio users, history length S; median time of the jitted forward "
        "(CUPTI kernel time on a GPU)."),
    nbf.v4.new_code_cell(
        "rows = res['inference']\n"
        "print(f\"{'case':18s} {'U':>5s} {'ikbo ms':>9s} {'standard ms':>12s} {'speedup':>8s}\")\n"
        "for name, r in rows.items():\n"
        "    ms = lambda b: r[b]['ms'] if 'ms' in r[b] else float('nan')\n"
        "    print(f\"{name:18s} {r['num_users']:5d} {ms('ikbo'):9.3f} {ms('standard'):12.3f} \"\n"
        "          f\"{r.get('speedup', float('nan')):8.2f}\")"),
    nbf.v4.new_code_cell(
        "fig, ax = plt.subplots(figsize=(8, 3.5))\n"
        "names = [n for n in rows if 'speedup' in rows[n]]\n"
        "ax.bar(range(len(names)), [rows[n]['speedup'] for n in names])\n"
        "ax.set_xticks(range(len(names)), names, rotation=30, fontsize=8)\n"
        "ax.axhline(1, color='gray', lw=0.8)\n"
        "ax.set_ylabel('standard ms / IKBO ms'); ax.set_title(f\"inference speedup, {res['device']}\")\n"
        "plt.tight_layout(); plt.show()"),
    nbf.v4.new_markdown_cell("## Training: one optimizer step (forward, backward, AdamW)"),
    nbf.v4.new_code_cell(
        "t = res['training']\n"
        "print(f\"B={t['num_candidates']} U={t['num_users']}: ikbo {t['ikbo']['ms']:.3f} ms, \"\n"
        "      f\"standard {t['standard']['ms']:.3f} ms, speedup {t['speedup']:.2f}x\")"),
    nbf.v4.new_markdown_cell(
        "## Serving: p99 latency against the offered rate\n\n"
        "A Poisson stream through the batcher and the compiled buckets, at rising rates until "
        "the p99 budget or the rate is missed; the sustained rate is the last that kept both. "
        "With the H200 results, the serving run with two batches in flight (its own file) is "
        "drawn beside the run above."),
    nbf.v4.new_code_cell(
        "runs = [res['serving']]\n"
        "extra = '../benchmarks/results/ranking_system_serving_h200.json'\n"
        "if 'IKBO_RESULTS' not in os.environ and os.path.exists(extra):\n"
        "    runs.append(json.load(open(extra))['serving'])\n"
        "fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 3.5), squeeze=False)\n"
        "for ax, srv in zip(axes[0], runs):\n"
        "    for build in ('ikbo', 'standard'):\n"
        "        ladder = srv[build]['ladder']\n"
        "        ax.plot([s['offered_qps'] for s in ladder], [s['p99_ms'] for s in ladder],\n"
        "                marker='o', label=f\"{build} (sustained {srv[build]['sustained_qps']:.0f}/s)\")\n"
        "    ax.axhline(srv['budget_p99_ms'], color='gray', ls='--', label='p99 budget')\n"
        "    ax.set_xscale('log'); ax.set_yscale('log')\n"
        "    ax.set_title(f\"{srv.get('max_in_flight', 1)} batch(es) in flight\")\n"
        "    ax.set_xlabel('offered requests/s'); ax.set_ylabel('p99 latency, ms')\n"
        "    ax.legend(fontsize=8)\n"
        "    print(f\"{srv.get('max_in_flight', 1)} in flight: sustained QPS ratio, IKBO / standard:\",\n"
        "          round(srv['qps_ratio'], 2))\n"
        "plt.tight_layout(); plt.show()"),
]
write(cells, "ranking_system")
