"""`Scorer`: what the batcher and the HTTP app need of a served model.

`BucketedModel` (one device) and `DeviceSet` (a replica per device) both
satisfy it; anything else that scores packed requests in static buckets can
stand in for them (tests use it for fakes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from ikbo_jax.data import Request
from ikbo_jax.models import Build, RankerConfig
from ikbo_jax.serving.buckets import Bucket


@runtime_checkable
class Scorer(Protocol):
  """Click probabilities for batches of validated requests, in static shape buckets."""

  config: RankerConfig
  build: Build
  buckets: tuple[Bucket, ...]

  @property
  def largest(self) -> Bucket:
    """The bucket that bounds what one batch can hold."""
    ...

  def bucket_for(self, requests: Sequence[Request]) -> Bucket | None:
    """The smallest bucket that holds `requests`, or None."""
    ...

  def __call__(self, requests: Sequence[Request]) -> list[np.ndarray]:
    """Each request's click probabilities, in its candidate order."""
    ...
