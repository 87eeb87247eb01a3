"""The sweep's cases: seeded draws from the whole input space the README promises.

`draw_*_case(seed)` draws one problem (sizes aligned and not, tiny and large,
user/candidate ratios from 1 to 1000, users without candidates, sorted and
shuffled mappings, lengths of 0, 1, S and around block edges, every dtype; a
quarter of the attention cases have histories of at most 8 positions). A case
is a frozen record: the sweep (`sweep.py`) builds its inputs from the seed.

Attention cases also draw, from a stream of their own (so that the fields
above stay what earlier seeds gave), a peaked softmax (each user's key 0
aligned with its candidates' queries: weights of 0.5 to 0.999 on one key,
where `ds = p (dp - delta)` cancels as it does with one key) and, for target
attention, whether the lse gets a cotangent (without one, the dq and dk of a
one-key history are exactly zero, so rounding noise there is not hidden
behind the lse's share).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ikbo_jax.index import CandidateIndex
from ikbo_jax.two_level_index import TwoLevelIndex

DTYPES = ("bfloat16", "float16", "float32")
# Share of attention cases drawn from tiny histories (S <= 8), tiny n_seed and D in {32, 64}.
TINY_SHARE = 0.25
OPS = ("linear_compression", "target_attention", "self_target_attention",
       "two_level_linear_compression", "two_level_target_attention")
# Attention cases with a peaked softmax, their peaks, and target cases without an lse cotangent.
PEAKED_SHARE, PEAKS = 0.3, (0.8, 1.0, 1.2)
NO_LSE_COTANGENT_SHARE = 0.3


@dataclasses.dataclass(frozen=True)
class Mapping:
  """How candidates map to users: `num_users` users, `num_empty` of them without candidates."""

  num_users: int
  num_candidates: int
  num_empty: int
  sorted: bool

  def index(self, rng: np.random.Generator) -> CandidateIndex:
    live = rng.permutation(self.num_users)[: self.num_users - self.num_empty]
    ids = rng.choice(live, size=self.num_candidates)
    ids[: len(live)] = live[: self.num_candidates]  # every live user appears
    ids = np.sort(ids) if self.sorted else rng.permutation(ids)
    return CandidateIndex.from_mapping(jnp.asarray(ids, jnp.int32), self.num_users)


@dataclasses.dataclass(frozen=True)
class LinearCompressionCase:
  seed: int
  mapping: Mapping
  m: int
  n: int
  k_user: int
  k_cand: int
  dtype: str
  op = "linear_compression"


@dataclasses.dataclass(frozen=True)
class TwoLevelMapping:
  """Items -> groups -> users: `empty_groups` groups without items, `users_without_groups`
  users without groups; both levels sorted or both shuffled."""

  num_users: int
  num_groups: int
  num_items: int
  empty_groups: int
  users_without_groups: int
  sorted: bool

  def index(self, rng: np.random.Generator) -> TwoLevelIndex:
    group_to_user = Mapping(self.num_users, self.num_groups, self.users_without_groups,
                            self.sorted).index(rng).cand_to_user
    item_to_group = Mapping(self.num_groups, self.num_items, self.empty_groups,
                            self.sorted).index(rng).cand_to_user
    return TwoLevelIndex.from_mappings(item_to_group, group_to_user, self.num_users)


@dataclasses.dataclass(frozen=True)
class TwoLevelLinearCompressionCase:
  seed: int
  mapping: TwoLevelMapping
  m: int
  n: int
  k_user: int
  k_group: int
  k_item: int
  dtype: str
  op = "two_level_linear_compression"


@dataclasses.dataclass(frozen=True)
class TwoLevelAttentionCase:
  """Items attending to their user's and their group's histories, one softmax over both."""

  seed: int
  mapping: TwoLevelMapping
  n_seed: int
  seq_len_user: int
  seq_len_group: int
  heads: int
  head_dim: int
  kv_len_user: tuple[int, ...]
  kv_len_group: tuple[int, ...]
  dtype: str
  op = "two_level_target_attention"


@dataclasses.dataclass(frozen=True)
class AttentionCase:
  """Target attention, or self + target attention when `causal` is not None."""

  seed: int
  mapping: Mapping
  n_seed: int
  seq_len: int
  heads: int
  head_dim: int
  kv_len: tuple[int, ...]
  dtype: str
  causal: bool | None = None
  peak: float = 0.0  # > 0: key 0 of each user aligned with its queries, logit ~ peak^2 sqrt(D)
  lse_cotangent: bool = True  # target attention: the lse output gets a random cotangent

  @property
  def op(self) -> str:
    return "target_attention" if self.causal is None else "self_target_attention"


def _pick(rng, pool, low, high, pool_weight=0.7) -> int:
  """From `pool` (edge cases) most of the time, else uniform in `[low, high]`."""
  if rng.random() < pool_weight:
    return int(rng.choice(pool))
  return int(rng.integers(low, high + 1))


def _mapping(rng, user_pool, ratio_pool, max_candidates: int) -> Mapping:
  num_users = int(rng.choice(user_pool))
  ratio = float(rng.choice(ratio_pool))
  num_cands = int(np.clip(round(num_users * ratio * rng.uniform(0.7, 1.3)), 1, max_candidates))
  num_users = min(num_users, max(num_cands, 1))
  num_empty = int(rng.integers(0, num_users)) if rng.random() < 0.4 else 0
  num_empty = min(num_empty, num_users - 1)
  return Mapping(num_users, num_cands, num_empty, bool(rng.random() < 0.3))


def _dtype(rng) -> str:
  return str(rng.choice(DTYPES, p=(0.5, 0.25, 0.25)))


def draw_linear_compression_case(seed: int, max_elements: int = 30_000_000) -> LinearCompressionCase:
  rng = np.random.default_rng((seed, 0))
  m = _pick(rng, (1, 7, 8, 63, 64, 65, 70, 96, 128, 200, 433), 1, 600)
  n = _pick(rng, (1, 3, 8, 32, 63, 64, 65, 96, 128, 192, 256, 320), 1, 600)
  k_user = _pick(rng, (1, 5, 8, 16, 64, 100, 128, 300), 1, 600)
  k_cand = _pick(rng, (1, 5, 8, 16, 64, 100, 128, 300), 1, 600)
  # The candidate batch is capped so that each [B, *, N] tensor stays small.
  max_cands = max(1, min(2000, max_elements // (n * max(m, k_cand))))
  mapping = _mapping(rng, (1, 2, 3, 7, 15, 40, 257), (1, 2, 5, 10, 70, 300, 1000), max_cands)
  return LinearCompressionCase(seed, mapping, m, n, k_user, k_cand, _dtype(rng))


def _two_level_mapping(rng, max_items: int) -> TwoLevelMapping:
  """Ratios at each level from 1 to 500: one group, a group per item, groups of one item,
  groups without items, users without groups."""
  num_users = int(rng.choice((1, 2, 3, 4, 16, 64)))
  groups = int(np.clip(num_users * float(rng.choice((1, 2, 5, 8, 32, 100, 500))), 1, max_items))
  groups = 1 if rng.random() < 0.1 else groups
  num_users = min(num_users, groups)
  items = int(np.clip(groups * float(rng.choice((1, 1, 2, 4, 16, 64, 500))), 1, max_items))
  groups = min(groups, items)
  empty_groups = min(int(rng.integers(0, groups)) if rng.random() < 0.4 else 0, groups - 1)
  no_groups = min(int(rng.integers(0, num_users)) if rng.random() < 0.4 else 0, num_users - 1)
  return TwoLevelMapping(num_users, groups, items, empty_groups, no_groups,
                         bool(rng.random() < 0.3))


def draw_two_level_linear_compression_case(
    seed: int, max_elements: int = 30_000_000) -> TwoLevelLinearCompressionCase:
  rng = np.random.default_rng((seed, 5))
  m = _pick(rng, (1, 7, 8, 64, 65, 128, 433), 1, 600)
  n = _pick(rng, (1, 3, 8, 64, 65, 128, 256), 1, 600)
  k_user, k_group, k_item = (_pick(rng, (1, 5, 8, 64, 100, 128, 512), 1, 600) for _ in range(3))
  max_items = max(1, min(2000, max_elements // (n * max(m, k_item, k_group))))
  return TwoLevelLinearCompressionCase(seed, _two_level_mapping(rng, max_items), m, n, k_user,
                                       k_group, k_item, _dtype(rng))


def _lengths(rng, num_users: int, seq_len: int) -> tuple[int, ...]:
  edges = [0, 1, seq_len, seq_len - 1] + [e for e in (63, 64, 65, 127, 128, 129, 255, 256, 257)
                                          if e < seq_len]
  return tuple(int(rng.choice(edges)) if rng.random() < 0.6 else int(rng.integers(0, seq_len + 1))
               for _ in range(num_users))


def draw_attention_case(seed: int, self_attention: bool = False,
                        max_logits: int = 150_000_000) -> AttentionCase:
  rng = np.random.default_rng((seed, 2 if self_attention else 1))
  if rng.random() < TINY_SHARE:
    # Histories of a few positions, few query tokens, small heads: where
    # one-key softmaxes and sequences shorter than any block live.
    n_seed = int(rng.choice((1, 2, 3, 7)))
    seq_len = int(rng.choice((1, 2, 3, 5, 8)))
    head_dim = int(rng.choice((32, 64)))
  else:
    n_seed = _pick(rng, (1, 2, 7, 16, 24, 32, 64, 65, 100, 128, 256, 512), 1, 512)
    seq_len = _pick(rng, (1, 2, 63, 64, 127, 128, 129, 200, 1000, 2000, 5000), 1, 5000)
    head_dim = (int(rng.choice((64, 128))) if rng.random() < 0.7
                else int(rng.choice((16, 32, 48, 96))))
  heads = int(rng.choice((1, 2, 4)))
  if self_attention:  # one user's own S x S logits must fit the budget
    seq_len = max(1, min(seq_len, int(np.sqrt(max_logits / heads))))
  max_cands = max(1, min(600, max_logits // (n_seed * seq_len * heads)))
  mapping = _mapping(rng, (1, 2, 3, 5, 16, 32), (1, 2, 7, 64, 200), max_cands)
  if self_attention:  # the users' own S x S logits count too
    users = max(1, min(mapping.num_users, max_logits // (seq_len * seq_len * heads)))
    mapping = dataclasses.replace(mapping, num_users=users,
                                  num_empty=min(mapping.num_empty, users - 1),
                                  num_candidates=max(mapping.num_candidates, users))
  causal = bool(rng.random() < 0.5) if self_attention else None
  softmax_rng = np.random.default_rng((seed, 4 if self_attention else 3))
  peak = float(softmax_rng.choice(PEAKS)) if softmax_rng.random() < PEAKED_SHARE else 0.0
  lse_cotangent = self_attention or bool(softmax_rng.random() >= NO_LSE_COTANGENT_SHARE)
  return AttentionCase(seed, mapping, n_seed, seq_len, heads, head_dim,
                       _lengths(rng, mapping.num_users, seq_len), _dtype(rng), causal, peak,
                       lse_cotangent)


def draw_two_level_attention_case(seed: int,
                                  max_logits: int = 150_000_000) -> TwoLevelAttentionCase:
  rng = np.random.default_rng((seed, 6))
  n_seed = int(rng.choice((1, 2, 7, 32, 64)))
  seq_user = _pick(rng, (1, 2, 64, 129, 1024, 2000), 1, 2000)
  seq_group = _pick(rng, (1, 2, 16, 64, 256), 1, 512)
  heads, head_dim = int(rng.choice((1, 2, 4))), int(rng.choice((64, 128)))
  max_items = max(1, min(600, max_logits // (n_seed * (seq_user + seq_group) * heads)))
  mapping = _two_level_mapping(rng, max_items)
  return TwoLevelAttentionCase(seed, mapping, n_seed, seq_user, seq_group, heads, head_dim,
                               _lengths(rng, mapping.num_users, seq_user),
                               _lengths(rng, mapping.num_groups, seq_group), _dtype(rng))


def draw_case(op: str, seed: int, size: float = 1.0):
  """One case of `op`; `size` scales the budget on its largest tensors (CPU tests use less)."""
  match op:
    case "linear_compression":
      return draw_linear_compression_case(seed, max_elements=int(30_000_000 * size))
    case "target_attention":
      return draw_attention_case(seed, max_logits=int(150_000_000 * size))
    case "self_target_attention":
      return draw_attention_case(seed, self_attention=True, max_logits=int(150_000_000 * size))
    case "two_level_linear_compression":
      return draw_two_level_linear_compression_case(seed, max_elements=int(30_000_000 * size))
    case "two_level_target_attention":
      return draw_two_level_attention_case(seed, max_logits=int(150_000_000 * size))
  raise ValueError(f"op must be one of {OPS}, got {op!r}")
