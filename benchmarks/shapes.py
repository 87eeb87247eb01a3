"""The benchmark shapes, named once, each with where it comes from.

Every script and diagnostic imports its shape from here (the pattern of
tokamax's `bench_arg_specs.py`), so that a result file's `shape` field and the
README's tables name the same thing.
"""

# Linear compression at the published IKBO benchmark shape: B=1024 candidates of U=15 users
# (ratio about 70), M=433 output rows, N=256, K_user=1178 user and K_cand=866 candidate rows.
LINEAR_COMPRESSION = dict(num_candidates=1024, num_users=15, m=433, n=256, k_user=1178,
                          k_cand=866)
# The published H100 times of that shape (ms), for the "published H100 ms" column.
LINEAR_COMPRESSION_PUBLISHED_H100_MS = {"baseline": 1.944, "decomposed": 1.389,
                                        "decomposed_padded": 0.798, "fused": 0.580,
                                        "persistent": 0.482}

# Target (and self + target) attention at the published IKBO benchmark shape: B=2048
# candidates of U=32 users, 2 heads of 128, 64 query tokens per candidate.
ATTENTION = dict(num_candidates=2048, num_users=32, heads=2, head_dim=128, n_seed=64)
# The --small attention shape: any backend, seconds on a CPU.
ATTENTION_SMALL = dict(num_candidates=16, num_users=4, heads=2, head_dim=16, n_seed=8)
