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
# # Automatic IKBO: one rewrite, step by step
#
# A DLRM-style layer written the standard way (user features copied to every candidate, concatenated with the candidate features, a dense layer), what `ikbo_jax.rewrite` makes of it, the change report, and the measured speedups of rewritten and hand-written IKBO code (`benchmarks/rewrite.py`; set `IKBO_RESULTS` to plot another result file).

# %%
import json, os
import jax, jax.numpy as jnp
import matplotlib.pyplot as plt
from ikbo_jax import rewrite

def model(user, cand_to_user, cand, w1, w2):
    x = jnp.concatenate([user[cand_to_user], cand], axis=1)
    return jax.nn.relu(x @ w1) @ w2

ks = jax.random.split(jax.random.key(0), 4)
args = (jax.random.normal(ks[0], (15, 512)), jnp.arange(1024, dtype=jnp.int32) % 15,
        jax.random.normal(ks[1], (1024, 128)), jax.random.normal(ks[2], (640, 256)) / 25,
        jax.random.normal(ks[3], (256, 1)) / 16)
where = dict(mapping=1, users=(0,))

# %% [markdown]
# ## Before: the copy `[1024, 512]` of 15 users' features, then the dense layer at batch B

# %%
print(jax.make_jaxpr(model)(*args).pretty_print(use_color=False))

# %% [markdown]
# ## After: the user half of the dense layer at batch U, its `[15, 256]` result added by index

# %%
fast = rewrite.rewrite(model, **where)
print(jax.make_jaxpr(fast)(*args).pretty_print(use_color=False))
print(rewrite.explain(model, *args, **where))
print('max difference', float(jnp.max(jnp.abs(fast(*args) - model(*args)))))

# %% [markdown]
# ## Measured: original vs rewritten vs hand-written IKBO

# %%
path = os.environ.get('IKBO_RESULTS', '../benchmarks/results/rewrite_h200.json')
res = json.load(open(path))
print(res['date'], res['commit'][:10], res['device'], res['dtype'])
cases = res['cases']
for name, r in cases.items():
    print(f"{name:18s} original {r['original']['ms']:8.3f} ms  rewritten "
          f"{r['rewritten']['ms']:8.3f} ms  by hand {r['ikbo']['ms']:8.3f} ms  "
          f"({r['fraction_of_ikbo_speedup']:.0%} of the hand-written speedup; "
          f"trace {r['trace_seconds']:.2f} s; relative error "
          f"{r.get('rewritten_relative_error', float('nan')):.1e})")
fig, ax = plt.subplots(figsize=(10, 3.5))
xs = range(len(cases))
ax.bar([x - 0.2 for x in xs], [r['speedup_rewritten'] for r in cases.values()], 0.4,
       label='rewritten')
ax.bar([x + 0.2 for x in xs], [r['speedup_ikbo'] for r in cases.values()], 0.4,
       label='hand-written IKBO')
ax.set_xticks(list(xs), list(cases), rotation=20); ax.axhline(1, color='gray', lw=0.8)
ax.set_ylabel('speedup over the original'); ax.legend()
plt.tight_layout(); plt.show()
print('fraction of the hand-written speedup per case:', {n: round(r['fraction_of_ikbo_speedup'], 2) for n, r in cases.items()})
