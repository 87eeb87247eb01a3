# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Two levels of sharing: user -> group -> item
#
# In an ads request many candidate items share an ad group (or campaign, or advertiser), and
# all the groups share the request's user. Group features (the campaign's embedding, its bid
# and budget features) are the same for all of a group's items, as user features are for all
# of a user's candidates. One-level IKBO stops copying the user level; `TwoLevelIndex` and
# `two_level_linear_compression` stop copying the group level too: each level's GEMM runs at
# its own batch size, U users, G groups, B items, and the item GEMM adds the group level's
# result by index in its epilogue. The measurements come from `benchmarks/two_level.py`
# (set `IKBO_RESULTS` to plot another result file).

# %%
import glob, json, os
import jax, jax.numpy as jnp
import matplotlib.pyplot as plt
from ikbo_jax import TwoLevelIndex, two_level_linear_compression

index = TwoLevelIndex.from_mappings([0, 0, 0, 1, 1, 2, 3, 3, 3, 3], group_to_user=[0, 0, 1, 1],
                                    num_users=2)
print('items -> groups:', index.items.cand_to_user.tolist())
print('groups -> users:', index.groups.cand_to_user.tolist())
print('items -> users (composed):', index.item_to_user.cand_to_user.tolist())

# %% [markdown]
# ## The three batch sizes
#
# Each row of boxes is one level's batch; an arrow is a read by index, never a copy.

# %%
fig, ax = plt.subplots(figsize=(9, 3))
levels = [('users (U)', index.num_users, 2.0), ('groups (G)', index.num_groups, 1.0),
          ('items (B)', index.num_items, 0.0)]
centers = {}
for name, count, y in levels:
    xs = [(i + 0.5) * 10 / count for i in range(count)]
    centers[name] = xs
    for x in xs:
        ax.add_patch(plt.Rectangle((x - 0.35, y - 0.2), 0.7, 0.4, color='tab:blue', alpha=0.6))
    ax.text(-0.4, y, name, ha='right', va='center')
for upper, lower, ids in ((centers['users (U)'], centers['groups (G)'], index.groups.cand_to_user),
                          (centers['groups (G)'], centers['items (B)'], index.items.cand_to_user)):
    y_top = 2.0 if upper is centers['users (U)'] else 1.0
    for child, parent in enumerate(ids.tolist()):
        ax.annotate('', xy=(upper[parent], y_top - 0.2), xytext=(lower[child], y_top - 0.8),
                    arrowprops=dict(arrowstyle='->', color='gray'))
ax.set_xlim(-3, 10.5); ax.set_ylim(-0.5, 2.5); ax.axis('off')
ax.set_title('W_user @ E_user at U, W_group @ E_group at G, W_item @ E_item at B')
plt.show()

# %% [markdown]
# ## The op equals both levels copied and one GEMM

# %%
ks = jax.random.split(jax.random.key(0), 6)
shapes = [(4, 6), (4, 3), (4, 5), (2, 6, 8), (4, 3, 8), (10, 5, 8)]
args = [jax.random.normal(k, s) for k, s in zip(ks, shapes)]
fast = two_level_linear_compression(*args, index)
copied = two_level_linear_compression(*args, index, implementation='xla_materialized')
print('max difference', float(jnp.max(jnp.abs(fast - copied))))

# %% [markdown]
# ## Measured: speedups over the group ratio

# %%
# Every two-level result of one card, the newest run of each (G, U) point (runs are cut by
# the device's time limits, so each holds some points), or the one file IKBO_RESULTS names.
paths = ([os.environ['IKBO_RESULTS']] if 'IKBO_RESULTS' in os.environ
         else sorted(glob.glob('../benchmarks/results/two_level_h100*.json')))
points, items = {}, None
for path in paths:
    res = json.load(open(path))
    items = res['items']
    for key, point in res['points'].items():
        if 'rows' in point and (key not in points or points[key]['date'] < res['date']):
            points[key] = dict(point, date=res['date'], commit=res['commit'], device=res['device'])
if not points:
    print('no two-level results yet: run benchmarks/two_level.py on a GPU (gpu_run.sh STEPS=two_level)')
else:
    fig, (lce, attention) = plt.subplots(1, 2, figsize=(11, 4))
    for users in sorted({int(k.split('U=')[1]) for k in points}):
        keys = sorted((k for k in points if k.endswith(f'U={users}')),
                      key=lambda k: int(k.split(',')[0][2:]))
        ratio = [items / int(k.split(',')[0][2:]) for k in keys]
        lce.plot(ratio, [points[k]['speedup_vs_one_level_group_copied'] for k in keys],
                 marker='o', label=f'U={users}')
        with_attention = [k for k in keys if 'attention' in points[k]]
        attention.plot([items / int(k.split(',')[0][2:]) for k in with_attention],
                       [points[k]['attention']['speedup_vs_copy_timed'] for k in with_attention],
                       marker='o', label=f'U={users}')
    for ax, title in ((lce, 'linear compression: x one level, group copied'),
                      (attention, 'attention: x one level, per-group copy timed')):
        ax.axhline(1.0, color='gray', lw=0.5)
        ax.set_xscale('log'); ax.set_xlabel('items per group (B / G)'); ax.set_title(title)
        ax.legend()
    plt.show()
    for key, p in points.items():
        line = (f"{key} ({p['commit'][:7]}, {p['device']}): x{p['speedup_vs_one_level_group_copied']:.2f} "
                f"vs one level with the group copied, x{p['speedup_vs_materialized']:.2f} vs both "
                f"copied, {p['ratio_to_own_gemms_floor']:.2f}x its own GEMMs")
        if 'attention' in p:
            line += (f"; attention x{p['attention']['speedup_vs_copy_untimed']:.2f} vs per-group "
                     f"histories built beforehand, x{p['attention']['speedup_vs_copy_timed']:.2f} "
                     f"with the copy")
        print(line)

# %% [markdown]
# The target point (G = 128, U = 16; a later run, cut before it wrote the other
# points) and the reference ranker with a group level against its standard build:

# %%
target = '../benchmarks/results/two_level_g128_u16_h100.json'
ranker = '../benchmarks/results/ranking_groups_h100.json'
if os.path.exists(target):
    t = json.load(open(target))
    print(t['commit'], t['device'], {k: v for k, v in t['ratios'].items()})
if os.path.exists(ranker):
    r = json.load(open(ranker))
    rows = {**{k: v for k, v in r['inference'].items()}, 'training B1024': r['training']}
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.bar(range(len(rows)), [v['speedup'] for v in rows.values()])
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{k}\nU={v['num_users']} G={v['num_groups']}" for k, v in rows.items()],
                       fontsize=7)
    ax.set_ylabel('x standard build'); ax.set_title(f"ranker with groups, {r['device']}")
    plt.show()
