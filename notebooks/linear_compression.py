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
# # IKBO linear compression: the ladder and the sweeps
#
# Plots the benchmark results committed under `benchmarks/results/` (H200, bf16). Set `IKBO_RESULTS` to another JSON file to plot it instead; CI runs this notebook on CPU against a small result file it makes itself.

# %%
import json, os
import matplotlib.pyplot as plt
path = os.environ.get('IKBO_RESULTS', '../benchmarks/results/linear_compression_h200.json')
res = json.load(open(path))
print(res['date'], res['commit'][:10], res['device'], 'jax', res['jax_version'])
print('ceilings', res['ceilings'])

# %% [markdown]
# ## The ladder at the published shape

# %%
ladder = res['ladder']
print(f"{'variant':32s} {'ms':>7s} {'TFLOP/s':>8s} {'x base':>7s} {'/floor':>7s}")
for name, r in ladder.items():
    print(f"{name:32s} {r['ms']:7.3f} {r['tflops']:8.0f} "
          f"{r['speedup_vs_prebroadcast_baseline']:7.2f} {r['ratio_to_floor']:7.2f}")
fig, ax = plt.subplots(figsize=(8, 3.5))
ax.barh(list(ladder), [r['ms'] for r in ladder.values()])
ax.invert_yaxis(); ax.set_xlabel('ms (median kernel time)')
ax.set_title(f"linear compression, {res['device']}")
plt.tight_layout(); plt.show()

# %% [markdown]
# ## Training step: forward + backward
#
# The same cotangent through the materialized model and through the IKBO op (its default implementation: on the H200, the Mosaic GPU kernels forward and backward).

# %%
fwd_bwd = res['fwd_bwd']
for name, value in fwd_bwd.items():
    unit = 'x' if name == 'speedup' else 'ms'
    print(f'{name:24s} {value:7.3f} {unit}')

# %% [markdown]
# ## Sweeps: candidates at ratio 70, and the candidates-per-user ratio

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
for ax, key, xlabel in ((axes[0], 'sweep_b', 'B (candidates)'),
                        (axes[1], 'sweep_ratio', 'candidates per user')):
    sweep = res.get(key, {})
    xs = sorted(sweep, key=float)
    if not xs:
        ax.set_title(f'{key}: not in this result file'); continue
    for name in sweep[xs[0]]:
        if name == 'baseline_prebroadcast':
            continue
        ax.plot([float(x) for x in xs],
                [sweep[x][name]['speedup_vs_prebroadcast_baseline'] for x in xs],
                marker='o', label=name)
    ax.set_xlabel(xlabel); ax.set_ylabel('speedup vs pre-broadcast baseline')
    if key == 'sweep_ratio':
        ax.set_xscale('log')
axes[1].legend(fontsize=7)
plt.tight_layout(); plt.show()
