"""`BucketedModel`: the model compiled once per static shape bucket, before any request.

A bucket fixes a batch's shape: `num_users` request slots, `num_candidates`
candidate slots and `history_slots` history positions. Each bucket's
executable is compiled ahead of time (`jax.jit(...).lower(...).compile()`),
so serving never compiles: a batch must be packed into one of the buckets,
and an executable called with any other shape raises instead of recompiling.
A batch goes to the device as one flat buffer (`transfer.FlatLayout`): one
transfer per batch instead of one per field, packed into a host buffer each
model thread reuses; its scores start back to the host as soon as they are
computed. Parameters each program only reads cast to the compute dtype are
held cast (`precast`), so no call casts them again.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ikbo_jax.data import Request
from ikbo_jax.models import Build, Ranker, RankerConfig, scores
from ikbo_jax.models.valid_range import max_abs_dense_feature
from ikbo_jax.serving import stages
from ikbo_jax.serving.precast import jit_hoisted
from ikbo_jax.serving.transfer import FlatLayout, HostBuffers


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
  """A static batch shape (ordered by size: candidates, then users, then history)."""

  num_candidates: int
  num_users: int
  history_slots: int

  def fits(self, requests: Sequence[Request]) -> bool:
    return self.holds(len(requests), sum(r.num_candidates for r in requests),
                      max(len(r.history) for r in requests))

  def holds(self, num_users: int, num_candidates: int, history: int) -> bool:
    """Whether a batch of these totals (its longest history) fits this bucket."""
    return (num_users <= self.num_users and num_candidates <= self.num_candidates
            and history <= self.history_slots)


def default_buckets(config: RankerConfig, *, max_batch_requests: int = 16,
                    mean_candidates: float = 8.0, count: int = 4) -> list[Bucket]:
  """`count` (1-4) buckets for full batches, then half, quarter and double (multiples of 32).

  A full batch is `max_batch_requests` requests of `mean_candidates` each.
  """
  if not 1 <= count <= 4:
    raise ValueError(f"count must lie in [1, 4], got {count}")
  full = max_batch_requests * mean_candidates
  shapes = ((1, max_batch_requests), (0.5, max(max_batch_requests // 2, 1)),
            (0.25, max(max_batch_requests // 4, 1)), (2, max_batch_requests))[:count]
  return sorted({Bucket(int(np.ceil(full * fraction / 32) * 32), users, config.max_history)
                 for fraction, users in shapes})


def checked_buckets(buckets: Sequence[Bucket], config: RankerConfig) -> tuple[Bucket, ...]:
  """`buckets` sorted and without repeats, or a ValueError naming the bad one."""
  if not buckets:
    raise ValueError("buckets is empty: give at least one Bucket")
  for b in buckets:
    if not all(isinstance(x, int) and x > 0 for x in dataclasses.astuple(b)):
      raise ValueError(f"bucket sizes must be positive ints, got {b}")
    if b.history_slots > config.max_history:
      raise ValueError(f"{b}: history_slots must be at most the model's max_history="
                       f"{config.max_history}")
  return tuple(sorted(set(buckets)))


def smallest_fitting(buckets: Sequence[Bucket], requests: Sequence[Request]) -> Bucket | None:
  """The smallest of the (sorted) `buckets` that holds `requests`, or None."""
  return next((b for b in buckets if b.fits(requests)), None)


def bucket_holding(buckets: Sequence[Bucket], requests: Sequence[Request]) -> Bucket:
  """`smallest_fitting`, or a ValueError saying what did not fit."""
  bucket = smallest_fitting(buckets, requests)
  if bucket is None:
    raise ValueError(f"{len(requests)} requests with {sum(r.num_candidates for r in requests)} "
                     f"candidates fit no bucket; the largest is {buckets[-1]}")
  return bucket


class BucketedModel:
  """Click probabilities for packed requests, one compiled executable per bucket.

  Args:
    model: the trained `Ranker` (its parameters are captured at construction).
    buckets: the shapes to compile; the largest bounds what one batch can hold.
      Every bucket's `history_slots` must be at most the model's `max_history`.
    build: which forward pass serves (`Build`, or its name).
    device: where the parameters live and the executables run (default: jax's default
      device); `ikbo_jax.serving.DeviceSet` keeps one `BucketedModel` per device.
    on_compiled: called with each bucket and its compile time in seconds as it
      is compiled (the command line prints them: compiling takes a while).
  """

  def __init__(self, model: Ranker, buckets: Sequence[Bucket], build: Build = Build.IKBO, *,
               device: jax.Device | None = None,
               on_compiled: Callable[[Bucket, float], None] | None = None):
    build = Build.parse(build)
    config = model.config
    if config.has_groups:
      raise ValueError(f"serving takes models without a group level; this one has one "
                       f"(RankerConfig.group_dense={config.group_dense}): its buckets would need "
                       "group slots, which the serving path does not pack yet")
    self.config, self.build = config, build
    self.buckets = checked_buckets(buckets, config)
    self.max_abs_feature = max_abs_dense_feature(model)  # the batcher refuses larger features
    graphdef, state = nnx.split(model)

    def probabilities(layout: FlatLayout, state, flat: jax.Array) -> jax.Array:
      model = nnx.merge(graphdef, state)
      return jax.nn.sigmoid(scores(model, layout.unflatten(flat), build))

    self.device = device or jax.devices()[0]
    self._placement = jax.sharding.SingleDeviceSharding(self.device)
    state = jax.device_put(state, self._placement)
    # By bucket: the parameter leaves its program takes, cast once where it only reads
    # them cast (`precast`; the cast copies are shared by the buckets).
    self._params, self._executables, self._layouts, self._jitted, casts = {}, {}, {}, {}, {}
    self._host_buffers = HostBuffers(config, self._layouts)
    for bucket in self.buckets:
      start = time.perf_counter()
      layout = FlatLayout.of(config, bucket.num_users, bucket.num_candidates,
                             bucket.history_slots)
      flat = jax.ShapeDtypeStruct((layout.size,), jnp.int32, sharding=self._placement)
      self._layouts[bucket] = layout
      self._jitted[bucket], self._params[bucket] = jit_hoisted(
          functools.partial(probabilities, layout), state, flat, cache=casts)
      self._executables[bucket] = self._jitted[bucket].lower(self._params[bucket],
                                                             flat).compile()
      self._run_padding(bucket)
      if on_compiled is not None:
        on_compiled(bucket, time.perf_counter() - start)

  def _run_padding(self, bucket: Bucket) -> None:
    """Runs the bucket's program once on a batch of padding, waiting for it.

    A program's first run costs more than the next ones (~12 ms on a CPU, a
    second on a slow one): paid here, it never lands on a request.
    """
    flat = self._host_buffers.pack([], bucket)
    jax.block_until_ready(self._executables[bucket](self._params[bucket],
                                                    jax.device_put(flat, self._placement)))

  @property
  def largest(self) -> Bucket:
    return self.buckets[-1]

  def bucket_for(self, requests: Sequence[Request]) -> Bucket | None:
    """The smallest bucket that holds `requests`, or None."""
    return smallest_fitting(self.buckets, requests)

  def __call__(self, requests: Sequence[Request]) -> list[np.ndarray]:
    """Each request's click probabilities, in its candidate order (validated requests)."""
    return self.staged(requests, None)

  def staged(self, requests: Sequence[Request], marks: list[tuple[str, float]] | None,
             waited: bool = False) -> list[np.ndarray]:
    """A call that appends each stage's (name, end time) to `marks` (`serving.stages`).

    Plain, its stages are `pack`, `launch` (the program called on the host buffer,
    which the call moves to the device; it does not wait for the device) and `d2h` (the program done
    and its scores on the host); `waited` waits for each of `pack`, `h2d`,
    `execute` and `d2h` apart, which separates them at the cost of a wait between.
    """
    mark = stages.marker(marks)
    bucket = bucket_holding(self.buckets, requests)
    host = self._host_buffers.pack(requests, bucket)
    mark("pack")
    if waited:
      flat = jax.block_until_ready(jax.device_put(host, self._placement))
      mark("h2d")
    else:
      # The call moves the host buffer itself: on an H100 a lone request's call took 0.70
      # ms so, against 1.06 ms with `jax.device_put` first (its Python path is the cost).
      flat = host
    probabilities = self._executables[bucket](self._params[bucket], flat)
    if waited:
      jax.block_until_ready(probabilities)
      mark("execute")
    else:
      probabilities.copy_to_host_async()  # the copy back starts when the batch is done
      mark("launch")
    out = per_request(np.asarray(probabilities), requests)
    mark("d2h")
    return out

  def device_call(self, requests: Sequence[Request]) -> tuple[Callable[[jax.Array], jax.Array],
                                                              jax.Array]:
    """What a call runs on the device: the bucket's program and the packed batch, there.

    `fn(flat)` computes the probabilities of every candidate slot; benchmarks
    time it alone (the device time of a call, with no host work around it). It
    is the jitted function the bucket's executable was compiled from, so that a
    profiler can trace it (an executable compiled ahead of time cannot be).
    """
    bucket = bucket_holding(self.buckets, requests)
    host = self._host_buffers.pack(requests, bucket)
    return (functools.partial(self._jitted[bucket], self._params[bucket]),
            jax.device_put(host.copy(), self._placement))

  def call_breakdown(self, requests: Sequence[Request]) -> dict[str, float]:
    """Seconds of each stage of one call, each waited for: pack, transfer, execute, fetch.

    The stages overlap in a plain call; this one separates them to show where a
    call's time goes (`benchmarks/ranking_system.py`).
    """
    marks = [("", time.perf_counter())]
    self.staged(requests, marks, waited=True)
    names = {"h2d": "transfer", "d2h": "fetch"}
    return {names.get(stage, stage): at - before
            for (_, before), (stage, at) in zip(marks, marks[1:])}


def per_request(probabilities: np.ndarray, requests: Sequence[Request]) -> list[np.ndarray]:
  """Each request's slice of a batch's scores (requests laid out in order, as packed)."""
  offsets = np.cumsum([0] + [r.num_candidates for r in requests])
  return [probabilities[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
