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
# # The reference ranker end to end: IKBO build vs standard build
#
# Plots `benchmarks/ranking_system.py` results: one model, one set of parameters, run as the IKBO build (user work once per user, the mapping passed to the IKBO layers) and as the standard build (user inputs copied to every candidate first). Set `IKBO_RESULTS` to another JSON file to plot it instead; the test runs this notebook on CPU against a small result file it makes itself.

# %%
import json, os
import matplotlib.pyplot as plt
path = os.environ.get('IKBO_RESULTS', '../benchmarks/results/ranking_system_h200.json')
res = json.load(open(path))
print(res['date'], res['commit'][:10], res['device'], 'jax', res['jax_version'])
print(res['config'])

# %% [markdown]
# ## Inference: the forward pass per batch
#
# B candidates of B / ratio users, history length S; median time of the jitted forward (CUPTI kernel time on a GPU).

# %%
rows = res['inference']
print(f"{'case':18s} {'U':>5s} {'ikbo ms':>9s} {'standard ms':>12s} {'speedup':>8s}")
for name, r in rows.items():
    ms = lambda b: r[b]['ms'] if 'ms' in r[b] else float('nan')
    print(f"{name:18s} {r['num_users']:5d} {ms('ikbo'):9.3f} {ms('standard'):12.3f} "
          f"{r.get('speedup', float('nan')):8.2f}")

# %%
fig, ax = plt.subplots(figsize=(8, 3.5))
names = [n for n in rows if 'speedup' in rows[n]]
ax.bar(range(len(names)), [rows[n]['speedup'] for n in names])
ax.set_xticks(range(len(names)), names, rotation=30, fontsize=8)
ax.axhline(1, color='gray', lw=0.8)
ax.set_ylabel('standard ms / IKBO ms'); ax.set_title(f"inference speedup, {res['device']}")
plt.tight_layout(); plt.show()

# %% [markdown]
# ## Training: one optimizer step (forward, backward, AdamW)

# %%
t = res['training']
print(f"B={t['num_candidates']} U={t['num_users']}: ikbo {t['ikbo']['ms']:.3f} ms, "
      f"standard {t['standard']['ms']:.3f} ms, speedup {t['speedup']:.2f}x")

# %% [markdown]
# ## Serving: p99 latency against the offered rate
#
# A Poisson stream through the batcher and the compiled buckets, at rising rates until the p99 budget or the rate is missed; the sustained rate is the last that kept both. With the H200 results, the serving run with two batches in flight (its own file) is drawn beside the run above.

# %%
runs = [res['serving']]
extra = '../benchmarks/results/ranking_system_serving_h200.json'
if 'IKBO_RESULTS' not in os.environ and os.path.exists(extra):
    runs.append(json.load(open(extra))['serving'])
fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 3.5), squeeze=False)
for ax, srv in zip(axes[0], runs):
    for build in ('ikbo', 'standard'):
        ladder = srv[build]['ladder']
        ax.plot([s['offered_qps'] for s in ladder], [s['p99_ms'] for s in ladder],
                marker='o', label=f"{build} (sustained {srv[build]['sustained_qps']:.0f}/s)")
    ax.axhline(srv['budget_p99_ms'], color='gray', ls='--', label='p99 budget')
    ax.set_xscale('log'); ax.set_yscale('log')
    ax.set_title(f"{srv.get('max_in_flight', 1)} batch(es) in flight")
    ax.set_xlabel('offered requests/s'); ax.set_ylabel('p99 latency, ms')
    ax.legend(fontsize=8)
    print(f"{srv.get('max_in_flight', 1)} in flight: sustained QPS ratio, IKBO / standard:",
          round(srv['qps_ratio'], 2))
plt.tight_layout(); plt.show()
