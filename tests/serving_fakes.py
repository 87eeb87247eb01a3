"""A fake scorer and request helpers shared by the server's fault tests.

`SlowScorer` (a fixed cost per batch, scores a known function of each request) stands for
the model, so that those tests run in seconds and every accepted answer can be checked.
"""

import dataclasses
import time

import numpy as np

from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.models import Build, RankerConfig
from ikbo_jax.serving import Bucket, bodies

CONFIG = RankerConfig(num_items=300, max_history=16)


class SlowScorer:
  """`seconds` per batch; each candidate's score is its item id / 1000 (NaN for item 299)."""

  config, build = CONFIG, Build.IKBO
  buckets = (Bucket(64, 8, 16),)

  def __init__(self, seconds: float = 0.01):
    self.seconds, self.seen = seconds, []

  @property
  def largest(self):
    return self.buckets[-1]

  def bucket_for(self, requests):
    return self.largest if self.largest.fits(requests) else None

  def __call__(self, requests):
    time.sleep(self.seconds)
    self.seen.extend(requests)
    return [np.where(r.cand_items == 299, np.nan, r.cand_items / 1000) for r in requests]


def some_requests(count, start=0):
  """`count` requests whose items stay below the NaN item 299."""
  gen = ClickGenerator(CONFIG, seed=3, mean_candidates=4, max_candidates=12)
  return [dataclasses.replace(r, cand_items=np.minimum(r.cand_items, 298))
          for r in gen.requests(count, start)]


def json_body(request) -> dict:
  """`request` as the JSON object `POST /score` takes."""
  return {f: np.asarray(getattr(request, f)).tolist() for f in bodies.FIELDS}


HEAD = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"  # a `POST /score` head, open
