"""Random IKBO problems for tests: mappings, operands, and the error rule applied to one output.

Shared by the test suite and anyone testing code built on the ops.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ikbo_jax.index import CandidateIndex
from ikbo_jax.testing import error_rule


def random_index(rng: np.random.Generator, num_users: int, num_candidates: int,
                 sorted_: bool = False, empty_users: int = 0) -> CandidateIndex:
  """An unsorted (unless `sorted_`) mapping in which `empty_users` users get no candidates."""
  live = rng.permutation(num_users)[: num_users - empty_users]
  ids = rng.choice(live, size=num_candidates)
  ids[: len(live)] = live[: num_candidates]  # every live user appears at least once
  ids = np.sort(ids) if sorted_ else rng.permutation(ids)
  return CandidateIndex.from_mapping(jnp.asarray(ids, jnp.int32), num_users)


def random_lce_args(seed: int, m, k_user, k_cand, n, num_users, num_candidates, dtype):
  keys = jax.random.split(jax.random.key(seed), 4)
  shapes = ((m, k_user), (m, k_cand), (num_users, k_user, n), (num_candidates, k_cand, n))
  return tuple((jax.random.normal(key, s, jnp.float32) / np.sqrt(s[-1] if len(s) == 2 else s[1]))
               .astype(dtype) for key, s in zip(keys, shapes))


def random_attention_args(seed: int, num_users, num_candidates, t, s, h, d, dtype):
  """Fresh normal `q [B, T, H, D]`, `k, v [U, S, H, D]` in `dtype`."""
  keys = jax.random.split(jax.random.key(seed), 3)
  shapes = ((num_candidates, t, h, d), (num_users, s, h, d), (num_users, s, h, d))
  return tuple(jax.random.normal(key, shape, jnp.float32).astype(dtype)
               for key, shape in zip(keys, shapes))


def rel_err(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  assert np.isfinite(x).all(), "non-finite output"
  return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def assert_within_reference_error(out, same_precision_ref, f32_ref, dtype=None, name="output"):
  """The project's error rule (`ikbo_jax.testing.error_rule`): globally and per row, at most
  twice the same-precision XLA error plus the floor of `dtype` (default: `out`'s dtype)."""
  error_rule.assert_within_reference_error(
      name, out, same_precision_ref, f32_ref, out.dtype if dtype is None else dtype)


def attention_inputs(d=16, dtype=jnp.float32, t=3, s=20, num_users=3, num_cands=6):
  """`((q, k, v), index)`: a small target-attention problem with an unsorted mapping."""
  index = random_index(np.random.default_rng(0), num_users, num_cands)
  return random_attention_args(0, num_users, num_cands, t, s, 2, d, dtype), index
