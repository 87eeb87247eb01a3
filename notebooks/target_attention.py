# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # IKBO target attention: the sequence-length sweep
#
# Plots the benchmark results committed under `benchmarks/results/` (H200, bf16, B=2048 candidates of U=32 users, H=2, D=128, n_seed=64). Set `IKBO_RESULTS` to another JSON file to plot it instead; CI runs this notebook on CPU against a small result file it makes itself.

# %%
import json, os
import matplotlib.pyplot as plt
path = os.environ.get('IKBO_RESULTS', '../benchmarks/results/target_attention_h200.json')
res = json.load(open(path))
print(res['date'], res['commit'][:10], res['device'], 'jax', res['jax_version'])
print('shape', res['shape'], res['dtype'])
sweep = res['sweep']
seq_lens = sorted(sweep, key=int)
names = sorted({n for s in seq_lens for n in sweep[s]})

# %% [markdown]
# ## Forward: median kernel time and throughput
#
# TFLOP/s counts `4*B*H*n_seed*S*D` (forward), 3.5x that for forward + backward and 2.5x for the backward alone (results before 2026-12-05 counted forward + backward as 2.5x); roofline is the fraction of the time that the FLOPs would take at the bf16 matmul rate measured in the same run (the bytes never bind here).

# %%
print(f"{'S':>6s} {'variant':34s} {'ms':>8s} {'TFLOP/s':>8s} {'roofline':>8s}")
for s in seq_lens:
    for name, r in sweep[s].items():
        if 'ms' in r:
            roofline = r.get('roofline_fraction', float('nan'))
            print(f"{s:>6s} {name:34s} {r['ms']:8.3f} {r['tflops']:8.0f} {roofline:8.2f}")
        else:
            print(f"{s:>6s} {name:34s} {r['error'][:40]}")

# %%
fig, ax = plt.subplots(figsize=(8, 4))
for name in names:
    if '/' in name:  # fwd_bwd/ and bwd/ rows: a different FLOP count
        continue
    xs = [int(s) for s in seq_lens if 'tflops' in sweep[s].get(name, {})]
    ax.plot(xs, [sweep[str(x)][name]['tflops'] for x in xs], marker='o', label=name)
ax.set_xscale('log', base=2); ax.set_xlabel('S (history length)')
ax.set_ylabel('TFLOP/s'); ax.set_title(f"target attention forward, {res['device']}")
ax.legend(fontsize=7); plt.tight_layout(); plt.show()

# %% [markdown]
# ## Speedups of the IKBO kernels over the baselines measured in the same run

# %%
for s in seq_lens:
    for name, r in sweep[s].items():
        ratios = {k.removeprefix('speedup_vs_'): round(v, 2) for k, v in r.items()
                  if k.startswith('speedup_vs_')}
        if ratios and ('mosaic' in name or 'triton' in name or 'xla' in name):
            print(s, name, ratios)
