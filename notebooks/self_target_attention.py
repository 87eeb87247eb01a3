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
# # IKBO self + target attention: one launch vs two
#
# Plots the benchmark results committed under `benchmarks/results/` (H200, bf16, B=2048 candidates of U=32 users, H=2, D=128, n_seed=64). `fused` runs the users' self-attention and the candidates' target attention in one Mosaic GPU launch; `two_launches` runs cuDNN self-attention and then our target attention kernel; `materialized` is cuDNN self-attention plus broadcast + cuDNN target attention. Set `IKBO_RESULTS` to another JSON file to plot it instead; CI runs this notebook on CPU against a small result file it makes itself.

# %%
import json, os
import matplotlib.pyplot as plt
path = os.environ.get('IKBO_RESULTS',
                      '../benchmarks/results/self_target_attention_h200.json')
res = json.load(open(path))
print(res['date'], res['commit'][:10], res['device'], 'jax', res['jax_version'])
print('shape', res['shape'], res['dtype'], '| FLOPs:', res['flops'])
sweep = res['sweep']
seq_lens = sorted(sweep, key=int)

# %% [markdown]
# ## Every row: median kernel time, throughput, speedups

# %%
print(f"{'S':>5s} {'variant':42s} {'ms':>8s} {'TFLOP/s':>8s} {'roofline':>8s}  speedups")
for s in seq_lens:
    for name, r in sweep[s].items():
        if 'ms' not in r:
            print(f"{s:>5s} {name:42s} {r['error'][:40]}"); continue
        ratios = {k.removeprefix('speedup_vs_'): round(v, 3) for k, v in r.items()
                  if k.startswith('speedup_vs_')}
        tflops = f"{r['tflops']:8.0f}" if 'tflops' in r else ' ' * 8
        roofline = f"{r['roofline_fraction']:8.2f}" if 'roofline_fraction' in r else ' ' * 8
        print(f"{s:>5s} {name:42s} {r['ms']:8.3f} {tflops} {roofline}  {ratios or ''}")

# %% [markdown]
# ## Fused launch vs two launches
#
# Time of the two launches divided by the fused launch's: above 1 the fused launch is faster.

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
for prefix, label in (('', 'non-causal'), ('causal/', 'causal'),
                      ('fwd_bwd/', 'fwd+bwd, non-causal')):
    xs = [int(s) for s in seq_lens
          if 'speedup_vs_two_launches' in sweep[s].get(prefix + 'fused', {})]
    if xs:
        axes[0].plot(xs, [sweep[str(x)][prefix + 'fused']['speedup_vs_two_launches']
                          for x in xs], marker='o', label=label)
    xs = [int(s) for s in seq_lens if 'tflops' in sweep[s].get(prefix + 'fused', {})]
    axes[1].plot(xs, [sweep[str(x)][prefix + 'fused']['tflops'] for x in xs],
                 marker='o', label='fused, ' + label)
axes[0].axhline(1.0, color='gray', lw=0.8)
axes[0].set_ylabel('two launches / fused'); axes[1].set_ylabel('TFLOP/s (combined)')
for ax in axes:
    ax.set_xscale('log', base=2); ax.set_xlabel('S (history length)')
    ax.legend(fontsize=7)
fig.suptitle(f"self + target attention, {res['device']}")
plt.tight_layout(); plt.show()
