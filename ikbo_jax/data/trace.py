"""A serving trace shaped like production traffic, from the synthetic stream.

Users are drawn by Zipf popularity, so a few come back often (within seconds at
any real rate) and most rarely; a user keeps its profile and history across its
requests, as a returning user does, and gets fresh candidates each time. The
candidate counts mix the stream's log-normal with a tail of large requests,
and histories range from empty to full (the stream's own mixture).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing

import numpy as np

from ikbo_jax.data.request import Request
from ikbo_jax.data.synthetic import ClickGenerator

# Streams of the generator that profiles and candidates are drawn from, apart
# from the ones training reads.
_USER_STREAM, _CANDIDATE_STREAM = 5 * 10**9, 6 * 10**9


def serving_trace(gen: ClickGenerator, count: int, *, num_users: int = 10_000,
                  zipf_exponent: float = 1.1, large_share: float = 0.05,
                  large_factor: float = 8.0, seed: int = 0,
                  processes: int = 1) -> list[Request]:
  """`count` requests of a returning-user population.

  Args:
    gen: the stream whose users, items and candidate counts are used.
    count: requests to draw.
    num_users: the population; user of rank `k` comes with probability
      proportional to `k ** -zipf_exponent`.
    large_share: the share of requests with `large_factor` times the stream's
      mean candidate count (capped by its maximum).
    seed: the draw of users and of large requests.
    processes: draw in this many processes (the same trace, sooner: a request of
      the benchmark preset takes milliseconds to draw).

  Example:

  >>> from ikbo_jax.data.synthetic import ClickGenerator
  >>> from ikbo_jax.data.trace import serving_trace
  >>> from ikbo_jax.models import RankerConfig
  >>> trace = serving_trace(ClickGenerator(RankerConfig(), seed=0), 200, num_users=50)
  >>> len({r.user_dense.tobytes() for r in trace}) < 50  # users come back
  True
  """
  if not (count >= 0 and num_users >= 1 and zipf_exponent > 0 and 0 <= large_share <= 1):
    raise ValueError(f"need count >= 0, num_users >= 1, zipf_exponent > 0 and large_share in "
                     f"[0, 1]; got {count}, {num_users}, {zipf_exponent}, {large_share}")
  if not (isinstance(processes, int) and processes >= 1):
    raise ValueError(f"processes must be a positive int, got {processes!r}")
  rng = np.random.default_rng(seed)
  popularity = np.arange(1, num_users + 1, dtype=np.float64) ** -zipf_exponent
  users = rng.choice(num_users, size=count, p=popularity / popularity.sum())
  large = ClickGenerator(gen.config, gen.seed, max_candidates=gen.max_candidates,
                         mean_candidates=min(gen.mean_candidates * large_factor,
                                             gen.max_candidates))
  is_large = rng.random(count) < large_share
  # Each draw is a pure function of its stream index: a returning user's profile is drawn
  # once, and the draws can go to other processes without changing the trace.
  distinct = list(dict.fromkeys(int(u) for u in users))
  draws = [(False, _USER_STREAM + u) for u in distinct]
  draws += [(bool(big), _CANDIDATE_STREAM + i) for i, big in enumerate(is_large)]
  drawn = _draw_all(gen, large, draws, processes)
  profiles = dict(zip(distinct, drawn[:len(distinct)]))
  return [dataclasses.replace(candidates, user_dense=profiles[int(u)].user_dense,
                              history=profiles[int(u)].history, labels=None)
          for u, candidates in zip(users, drawn[len(distinct):])]


def _draw(gen: ClickGenerator, large: ClickGenerator,
          draws: list[tuple[bool, int]]) -> list[Request]:
  return [(large if big else gen).request(i) for big, i in draws]


def _draw_all(gen: ClickGenerator, large: ClickGenerator, draws: list[tuple[bool, int]],
              processes: int) -> list[Request]:
  if processes == 1 or len(draws) < 64 * processes:
    return _draw(gen, large, draws)
  chunks = [draws[k::processes] for k in range(processes)]
  # Spawned, not forked: the caller may hold jax's threads.
  context = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
    parts = list(pool.map(_draw, [gen] * processes, [large] * processes, chunks))
  # Chunk k holds draws k, k + processes, ...: deal them back in order.
  drawn = [None] * len(draws)
  for k, part in enumerate(parts):
    drawn[k::processes] = part
  return drawn
