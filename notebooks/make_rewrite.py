"""Builds notebooks/rewrite.ipynb (run it, then execute the notebook)."""

import nbformat as nbf
from _maker import write

cells = [
    nbf.v4.new_markdown_cell(
        "# Automatic IKBO: one rewrite, step by step\n\n"
        "A DLRM-style layer written the standard way (user features copied to every candidate, "
        "concatenated with the candidate features, a dense layer), what `ikbo_jax.rewrite` makes "
        "of it, the change report, and the measured speedups of rewritten and hand-written IKBO "
        "code (`benchmarks/rewrite.py`; set `IKBO_RESULTS` to plot another result file)."),
    nbf.v4.new_code_cell(
        "import json, os\n"
        "import jax, jax.numpy as jnp\n"
        "import matplotlib.pyplot as plt\n"
        "from ikbo_jax import rewrite\n\n"
        "def model(user, cand_to_user, cand, w1, w2):\n"
        "    x = jnp.concatenate([user[cand_to_user], cand], axis=1)\n"
        "    return jax.nn.relu(x @ w1) @ w2\n\n"
        "ks = jax.random.split(jax.random.key(0), 4)\n"
        "args = (jax.random.normal(ks[0], (15, 512)), jnp.arange(1024, dtype=jnp.int32) % 15,\n"
        "        jax.random.normal(ks[1], (1024, 128)), jax.random.normal(ks[2], (640, 256)) / 25,\n"
        "        jax.random.normal(ks[3], (256, 1)) / 16)\n"
        "where = dict(mapping=1, users=(0,))"),
    nbf.v4.new_markdown_cell("## Before: the copy `[1024, 512]` of 15 users' features, then the "
                             "dense layer at batch B"),
    nbf.v4.new_code_cell("print(jax.make_jaxpr(model)(*args).pretty_print(use_color=False))"),
    nbf.v4.new_markdown_cell("## After: the user half of the dense layer at batch U, its "
                             "`[15, 256]` result added by index"),
    nbf.v4.new_code_cell(
        "fast = rewrite.rewrite(model, **where)\n"
        "print(jax.make_jaxpr(fast)(*args).pretty_print(use_color=False))\n"
        "print(rewrite.explain(model, *args, **where))\n"
        "print('max difference', float(jnp.max(jnp.abs(fast(*args) - model(*args)))))"),
    nbf.v4.new_markdown_cell("## Measured: original vs rewritten vs hand-written IKBO"),
    nbf.v4.new_code_cell(
        "path = os.environ.get('IKBO_RESULTS', '../benchmarks/results/rewrite_h200.json')\n"
        "res = json.load(open(path))\n"
        "print(res['date'], res['commit'][:10], res['device'], res['dtype'])\n"
        "cases = res['cases']\n"
        "for name, r in cases.items():\n"
        "    print(f\"{name:18s} original {r['original']['ms']:8.3f} ms  rewritten \"\n"
        "          f\"{r['rewritten']['ms']:8.3f} ms  by hand {r['ikbo']['ms']:8.3f} ms  \"\n"
        "          f\"({r['fraction_of_ikbo_speedup']:.0%} of the hand-written speedup; \"\n"
        "          f\"trace {r['trace_seconds']:.2f} s; relative error \"\n"
        "          f\"{r.get('rewritten_relative_error', float('nan')):.1e})\")\n"
        "fig, ax = plt.subplots(figsize=(10, 3.5))\n"
        "xs = range(len(cases))\n"
        "ax.bar([x - 0.2 for x in xs], [r['speedup_rewritten'] for r in cases.values()], 0.4,\n"
        "       label='rewritten')\n"
        "ax.bar([x + 0.2 for x in xs], [r['speedup_ikbo'] for r in cases.values()], 0.4,\n"
        "       label='hand-written IKBO')\n"
        "ax.set_xticks(list(xs), list(cases), rotation=20); ax.axhline(1, color='gray', lw=0.8)\n"
        "ax.set_ylabel('speedup over the original'); ax.legend()\n"
        "plt.tight_layout(); plt.show()\n"
        "print('fraction of the hand-written speedup per case:', "
        "{n: round(r['fraction_of_ikbo_speedup'], 2) for n, r in cases.items()})"),
]
write(cells, "rewrite")
