"""`DeviceSet`: data-parallel serving, one compiled copy of the model per device.

Each batch is whole requests, so a batch never needs another device's data:
serving over several devices is a replica of the bucketed model on each, and
each batch goes to the replica with the fewest batches in flight. The batcher
keeps them busy when `BatchingConfig.max_in_flight` is at least twice the
number of devices (one batch running on each, one being packed for each).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np

from ikbo_jax.data import Request
from ikbo_jax.models import Build, Ranker
from ikbo_jax.serving.buckets import Bucket, BucketedModel


class DeviceSet:
  """A `BucketedModel` on each of `devices`; called like one, it runs each batch on one of them.

  Args:
    model: the trained `Ranker`.
    buckets: the shapes every replica compiles.
    build: which forward pass serves (`Build`, or its name).
    devices: where to serve (default: every local device).
    on_compiled: as for `BucketedModel`, for every replica's buckets.
  """

  def __init__(self, model: Ranker, buckets: Sequence[Bucket], build: Build = Build.IKBO, *,
               devices: Sequence[jax.Device] | None = None,
               on_compiled: Callable[[Bucket, float], None] | None = None):
    devices = list(jax.local_devices() if devices is None else devices)
    if not devices:
      raise ValueError("devices is empty: give at least one device")
    self.replicas = [BucketedModel(model, buckets, build, device=d, on_compiled=on_compiled)
                     for d in devices]
    self.config, self.buckets, self.build = model.config, self.replicas[0].buckets, Build.parse(build)
    self.max_abs_feature = self.replicas[0].max_abs_feature
    self.batches_per_device = [0] * len(devices)
    self._in_flight = [0] * len(devices)
    self._lock = threading.Lock()

  @property
  def largest(self) -> Bucket:
    return self.replicas[0].largest

  def bucket_for(self, requests: Sequence[Request]) -> Bucket | None:
    return self.replicas[0].bucket_for(requests)

  def __call__(self, requests: Sequence[Request]) -> list[np.ndarray]:
    """As `BucketedModel.__call__`, on the device with the fewest batches in flight."""
    with self._lock:
      device = int(np.argmin(self._in_flight))
      self._in_flight[device] += 1
      self.batches_per_device[device] += 1
    try:
      return self.replicas[device](requests)
    finally:
      with self._lock:
        self._in_flight[device] -= 1
