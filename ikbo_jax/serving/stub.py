"""`DeviceStub`: a served model whose device is a clock, to work on the host path without one.

It is a `Scorer` in every way the host path sees: it validates nothing the
batcher does not, packs each batch into the same flat host buffers as
`BucketedModel` (the same layouts, the same per-thread reuse), and answers
after the batch's device time. The device is one queue, as a GPU's stream is:
a batch launched while another runs starts when that one ends, so batches in
flight overlap their host work with the device's, and never their device time
with each other's. A bucket's device time is linear in its candidate slots,
through the smallest and the largest bucket's measured times (the benchmark
preset on an H100: 0.232 ms for one request's bucket, 1.057 ms for the full
one). A candidate's score is its item id over the model's item count, so that
a client can check that each answer is its own request's.

The wait for the device is a `time.sleep`, which gives the GIL up as a real
device wait does; the OS wakes the thread some tens of microseconds late,
about what a real call's event wait costs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from ikbo_jax.data import Request
from ikbo_jax.models import Build, RankerConfig
from ikbo_jax.serving import stages
from ikbo_jax.serving.buckets import Bucket, bucket_holding, checked_buckets, smallest_fitting
from ikbo_jax.serving.transfer import FlatLayout, HostBuffers


class DeviceStub:
  """Scores after a device time per bucket, from a clock instead of a device.

  Args:
    config: the model's sizes (what requests are validated and packed against).
    buckets: the static batch shapes, as `BucketedModel` takes them.
    device_ms: the (smallest bucket's, largest bucket's) device milliseconds; the
      others' are linear in candidate slots between them.
    build: the build this stands for (reported by `/health`).
  """

  def __init__(self, config: RankerConfig, buckets: Sequence[Bucket],
               device_ms: tuple[float, float], build: Build = Build.IKBO):
    first, last = device_ms
    if not 0 <= first <= last:
      raise ValueError(f"device_ms must be (smallest bucket's, largest bucket's) ms with "
                       f"0 <= smallest <= largest, got {device_ms!r}")
    self.config, self.build = config, Build.parse(build)
    self.buckets = checked_buckets(buckets, config)
    small, large = self.buckets[0].num_candidates, self.buckets[-1].num_candidates
    slope = (last - first) / (large - small) if large > small else 0.0
    self.device_ms = {b: first + slope * (b.num_candidates - small) for b in self.buckets}
    self._host_buffers = HostBuffers(config, {
        b: FlatLayout.of(config, b.num_users, b.num_candidates, b.history_slots)
        for b in self.buckets})
    self._lock = threading.Lock()
    self._free_at = 0.0  # when the device's queue runs dry (perf_counter seconds)

  @property
  def largest(self) -> Bucket:
    return self.buckets[-1]

  def bucket_for(self, requests: Sequence[Request]) -> Bucket | None:
    return smallest_fitting(self.buckets, requests)

  def __call__(self, requests: Sequence[Request]) -> list[np.ndarray]:
    return self.staged(requests, None)

  def staged(self, requests: Sequence[Request], marks: list[tuple[str, float]] | None,
             waited: bool = False) -> list[np.ndarray]:
    """As `BucketedModel.staged`; `waited` changes nothing (there are no transfers)."""
    mark = stages.marker(marks)
    bucket = bucket_holding(self.buckets, requests)
    self._host_buffers.pack(requests, bucket)  # the host's work of a real call
    mark("pack")
    with self._lock:  # enqueued behind the batches launched before it
      done = max(time.perf_counter(), self._free_at) + self.device_ms[bucket] / 1e3
      self._free_at = done
    mark("launch")
    if (wait := done - time.perf_counter()) > 0:
      time.sleep(wait)
    scores = [stub_scores(r, self.config) for r in requests]
    mark("d2h")
    return scores


def stub_scores(request: Request, config: RankerConfig) -> np.ndarray:
  """The scores a `DeviceStub` answers `request` with: each candidate's item id over the
  model's item count (what a client checks each answer against)."""
  return (np.asarray(request.cand_items) / config.num_items).astype(np.float32)
