"""A synthetic click stream with a hidden rule a ranking model can learn.

Every item has a latent vector and a popularity; every user a latent taste.
A user's history is drawn from the items it likes; its dense profile and the
candidates' dense statistics are noisy linear views of the latents. A click
on candidate `c` of user `u` happens with probability

    sigmoid(2 * <taste_u, z_c> + 1.5 * max_{h in last 5 of history} <z_h, z_c>
            + 0.5 * popularity_c - 2)

so affinity, recency of similar items and popularity all matter, and the
history alone reveals the taste. For a model with a group level
(`RankerConfig.group_dense > 0`), a request's candidates fall into groups (ad
groups: about one per four candidates, some empty), each with a hidden quality
`q_g ~ N(0, 1)` that adds `1.5 q_g` to its candidates' logits and that the group's
dense features are a noisy linear view of. Request `i` of a generator depends only on
`(seed, i)`: a training run can resume, or be split, at any request.
"""

from __future__ import annotations

import numpy as np

from ikbo_jax.data.request import Request
from ikbo_jax.models.config import RankerConfig

_LATENT = 8
_RECENT = 5


class ClickGenerator:
  """Requests with 1 to `max_candidates` candidates (log-normal, mean about `mean_candidates`).

  Example:

  >>> from ikbo_jax.data.synthetic import ClickGenerator
  >>> from ikbo_jax.models import RankerConfig
  >>> gen = ClickGenerator(RankerConfig(), seed=0)
  >>> [r.num_candidates >= 1 for r in gen.requests(3)]
  [True, True, True]
  >>> bool((gen.request(7).cand_items == gen.request(7).cand_items).all())
  True
  """

  def __init__(self, config: RankerConfig, seed: int, *, mean_candidates: float = 8.0,
               max_candidates: int = 64):
    if not 1 <= mean_candidates <= max_candidates:
      raise ValueError(f"mean_candidates must lie in [1, max_candidates={max_candidates}], "
                       f"got {mean_candidates}")
    self.config, self.seed = config, seed
    self.mean_candidates, self.max_candidates = mean_candidates, max_candidates
    rng = np.random.default_rng((seed, 2**31))
    self.item_latent = rng.normal(size=(config.num_items, _LATENT)) / np.sqrt(_LATENT)
    self.popularity = rng.normal(size=config.num_items)
    self.user_view = rng.normal(size=(_LATENT, config.user_dense))
    self.cand_view = rng.normal(size=(_LATENT + 1, config.cand_dense))
    self.group_view = rng.normal(size=(1, config.group_dense))

  def request(self, i: int) -> Request:
    """Request number `i` of this stream, with labels."""
    c = self.config
    rng = np.random.default_rng((self.seed, i))
    taste = rng.normal(size=_LATENT)
    liking = 3.0 * self.item_latent @ taste
    p = np.exp(liking - liking.max())
    p /= p.sum()
    length = c.max_history if rng.random() < 0.2 else int(rng.integers(0, c.max_history + 1))
    history = rng.choice(c.num_items, size=length, p=p)
    n = int(np.clip(np.round(rng.lognormal(np.log(self.mean_candidates), 0.6)), 1,
                    self.max_candidates))
    # Half the candidates from the user's taste, half at random: both labels occur.
    liked = rng.random(n) < 0.5
    cand_items = np.where(liked, rng.choice(c.num_items, size=n, p=p),
                          rng.integers(0, c.num_items, size=n))
    z = self.item_latent[cand_items]
    recent = self.item_latent[history[-_RECENT:]]
    recency = (z @ recent.T).max(axis=1) if length else np.zeros(n)
    logit = 2.0 * z @ taste + 1.5 * recency + 0.5 * self.popularity[cand_items] - 2.0
    groups = self._groups(rng, n) if c.has_groups else {}
    if groups:
      logit = logit + 1.5 * groups.pop("quality")[groups["cand_groups"]]
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    user_dense = taste @ self.user_view + 0.5 * rng.normal(size=c.user_dense)
    stats = np.concatenate([z, self.popularity[cand_items, None]], axis=1)
    cand_dense = stats @ self.cand_view + 0.5 * rng.normal(size=(n, c.cand_dense))
    return Request(user_dense=user_dense.astype(np.float32), history=history.astype(np.int32),
                   cand_items=cand_items.astype(np.int32),
                   cand_dense=cand_dense.astype(np.float32), labels=labels, **groups)

  def _groups(self, rng: np.random.Generator, n: int) -> dict:
    """The request's groups: each candidate's, their qualities and dense features."""
    g = int(rng.integers(1, max(1, n // 2) + 1))
    quality = rng.normal(size=g)
    dense = quality[:, None] @ self.group_view + 0.5 * rng.normal(
        size=(g, self.config.group_dense))
    return dict(cand_groups=rng.integers(0, g, size=n).astype(np.int32), quality=quality,
                group_dense=dense.astype(np.float32))

  def requests(self, count: int, start: int = 0) -> list[Request]:
    """Requests `start, ..., start + count - 1`."""
    return [self.request(i) for i in range(start, start + count)]
