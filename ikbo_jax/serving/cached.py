"""`CachedModel`: the IKBO build with each user's side kept in device memory across requests.

A request's cost at low candidate counts is mostly its user's side (the
self-attention over the history, the user tower), and the same users come
back within seconds. `CachedModel` splits the ranker at that boundary
(`Ranker.user_state`, `Ranker.score_candidates`) and keeps a table of user
states in device memory, `capacity` slots sized from a byte budget, whose
bookkeeping is a `SlotTable`. A batch runs as at most two compiled steps:

1. for the users the table does not hold, their user side, written into the
   slots the table gave them (the table is donated, so it is updated in
   place); one executable per power of two of new users;
2. for every candidate, the candidate side against its user's state: the
   batch's users' rows are gathered from the table (one row per request, not
   per candidate) and the IKBO ops read them by index; one executable per
   bucket.

So a batch whose users are all cached costs its candidate side alone. The
placement and both dispatches happen under one lock, so each step sees the
table as the steps before it left it (`user_cache` says why no batch in
flight can read a slot that a later batch reuses). A step that fails may have
consumed the donated table: the table is then zeroed and every entry
forgotten, so nothing after a failure reads a half-written state.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ikbo_jax.data import Request
from ikbo_jax.data.packing import pack_candidates, pack_users
from ikbo_jax.index import CandidateIndex
from ikbo_jax.models import Build, Ranker
from ikbo_jax.models.valid_range import max_abs_dense_feature
from ikbo_jax.serving.buckets import (Bucket, bucket_holding, checked_buckets, per_request,
                                     smallest_fitting)
from ikbo_jax.serving.precast import jit_hoisted
from ikbo_jax.serving.transfer import FlatLayout
from ikbo_jax.serving.user_cache import SlotTable, user_key


class CachedModel:
  """Click probabilities for packed requests, reading cached user states where it can.

  Args:
    model: the trained `Ranker`.
    buckets: the batch shapes of the candidate side (`Bucket.history_slots`
      only bounds what a batch takes: cached histories are `max_history` long).
    cache_bytes: the table's device memory; it must hold the largest bucket's users.
    ttl_seconds: a cached state older than this is computed again.
    device: where the parameters and the table live (default: jax's default device).
    on_compiled: called with each compiled step's name and its compile time in seconds.
  """

  build = Build.IKBO

  def __init__(self, model: Ranker, buckets: Sequence[Bucket], *, cache_bytes: int,
               ttl_seconds: float | None = None, device: jax.Device | None = None,
               on_compiled: Callable[[str, float], None] | None = None):
    self.config = model.config
    self.buckets = checked_buckets(buckets, model.config)
    self.max_abs_feature = max_abs_dense_feature(model)  # the batcher refuses larger features
    graphdef, params = nnx.split(model)
    self._placement = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    params = jax.device_put(params, self._placement)
    row = _one_user_state(model)
    self.bytes_per_user = _nbytes(row)
    users = self.largest.num_users
    capacity = int(cache_bytes) // self.bytes_per_user
    if capacity < users:
      raise ValueError(f"cache_bytes={cache_bytes} holds {capacity} user states of "
                       f"{self.bytes_per_user} bytes; the largest bucket has {users} users, so "
                       f"it needs at least {users * self.bytes_per_user}")
    self.slots = SlotTable(capacity, min_slots=users, ttl_seconds=ttl_seconds)
    self._empty_table = lambda: jax.tree.map(
        lambda x: jnp.zeros((capacity, *x.shape[1:]), x.dtype, device=self._placement), row)
    self._table = self._empty_table()
    self._lock = threading.Lock()
    compile_step = functools.partial(_compile, graphdef, params, self._table,
                                     on_compiled=on_compiled, casts={})
    # Each step's parameters are bound to it (cast once where it only reads them cast).
    self._writers = {m: compile_step(f"user side, {m} new users", _write_users,
                                     self._writer_layout(m), donate=True)[0]
                     for m in _powers_of_two_to(users)}
    readers = {b: compile_step(f"candidate side, {b}", _score_candidates,
                               self._reader_layout(b)) for b in self.buckets}
    self._readers = {b: compiled for b, (compiled, _) in readers.items()}
    self._traceable_readers = {b: jitted for b, (_, jitted) in readers.items()}
    self._run_padding()

  def _run_padding(self) -> None:
    """Runs every compiled step once on padding (a program's first run costs more than
    the next ones: paid here, it never lands on a request). Padding users' slots are
    out of range, so the writers leave the table as it is."""
    for m, writer in self._writers.items():
      self._table = writer(self._table, jax.device_put(self._pack_users(m, [], []),
                                                       self._placement))
    for bucket, reader in self._readers.items():
      flat = self._pack_candidates(bucket, [], np.zeros(0, np.int32))
      jax.block_until_ready(reader(self._table, jax.device_put(flat, self._placement)))

  @property
  def largest(self) -> Bucket:
    return self.buckets[-1]

  @property
  def capacity(self) -> int:
    return self.slots.capacity

  def bucket_for(self, requests: Sequence[Request]) -> Bucket | None:
    """The smallest bucket that holds `requests`, or None."""
    return smallest_fitting(self.buckets, requests)

  def __call__(self, requests: Sequence[Request]) -> list[np.ndarray]:
    """Each request's click probabilities, in its candidate order (validated requests)."""
    bucket = bucket_holding(self.buckets, requests)
    keys = [user_key(r) for r in requests]
    with self._lock:
      placement = self.slots.place(keys)
      try:
        if placement.misses:
          self._table = self._write(requests, placement.misses)
        candidates = jax.device_put(self._pack_candidates(bucket, requests, placement.slots),
                                    self._placement)
        probabilities = self._readers[bucket](self._table, candidates)
      except BaseException:
        self._forget_all()  # a failed step may have consumed the donated table
        raise
    probabilities.copy_to_host_async()
    return per_request(np.asarray(probabilities), requests)

  def device_call(self, requests: Sequence[Request]) -> tuple[Callable[[jax.Array], jax.Array],
                                                              jax.Array]:
    """What a call of `requests` runs on the device once their users are cached.

    Scores `requests` (caching their users), then returns the bucket's candidate
    side as a jitted function of the packed batch, and that batch on the device:
    a call's device cost when every user hits (benchmarks time it alone). The
    function reads the table as it is now: time it before the next call.
    """
    self(requests)
    bucket = bucket_holding(self.buckets, requests)
    with self._lock:
      placement = self.slots.place([user_key(r) for r in requests])
      if placement.misses:
        raise RuntimeError("the requests' users left the cache at once (a time to live "
                           "shorter than a call?)")
      flat = jax.device_put(self._pack_candidates(bucket, requests, placement.slots),
                            self._placement)
      table = self._table
    return functools.partial(self._traceable_readers[bucket], table), flat

  def report(self) -> dict:
    """The table's size and use: what `GET /cache` and the metrics show."""
    stats, looked_up = self.slots.stats, self.slots.stats.hits + self.slots.stats.misses
    return dict(capacity=self.capacity, entries=len(self.slots),
                bytes_per_user=self.bytes_per_user, table_bytes=self.capacity * self.bytes_per_user,
                ttl_seconds=self.slots.ttl_seconds, hits=stats.hits, misses=stats.misses,
                hit_rate=stats.hits / looked_up if looked_up else None,
                evictions=stats.evictions, expirations=stats.expirations, flushes=stats.flushes)

  def flush(self) -> None:
    """Forgets every cached user and zeroes the table."""
    with self._lock:
      self._forget_all()

  def _forget_all(self) -> None:
    self.slots.flush()
    self._table = self._empty_table()

  def _writer_layout(self, m: int) -> FlatLayout:
    c = self.config
    return FlatLayout((("user_dense", (m, c.user_dense)), ("history", (m, c.max_history)),
                       ("history_len", (m,)), ("slots", (m,))))

  def _reader_layout(self, bucket: Bucket) -> FlatLayout:
    b = bucket.num_candidates
    return FlatLayout((("slots", (bucket.num_users,)), ("cand_to_user", (b,)),
                       ("cand_items", (b,)), ("cand_dense", (b, self.config.cand_dense))))

  def _write(self, requests: Sequence[Request], misses) -> jax.Array:
    """The table with the new users' states written into their slots."""
    m = next(n for n in self._writers if n >= len(misses))
    flat = self._pack_users(m, requests, misses)
    return self._writers[m](self._table, jax.device_put(flat, self._placement))

  def _pack_users(self, m: int, requests: Sequence[Request], misses) -> np.ndarray:
    """The `m`-row writer's input: each miss `(request index, slot)`'s user in its slot."""
    flat, views = self._writer_layout(m).host_views()
    views["slots"][:] = self.capacity  # padding rows: out of range, dropped
    views["slots"][:len(misses)] = [slot for _, slot in misses]
    pack_users([requests[r] for r, _ in misses], views["user_dense"], views["history"],
               views["history_len"])
    return flat

  def _pack_candidates(self, bucket: Bucket, requests: Sequence[Request],
                       slots: np.ndarray) -> np.ndarray:
    flat, views = self._reader_layout(bucket).host_views()
    views["slots"][:len(slots)] = slots
    pack_candidates(requests, bucket.num_users, views["cand_to_user"], views["cand_items"],
                    views["cand_dense"])
    return flat


def _one_user_state(model: Ranker):
  """The shapes and dtypes of one user's state."""
  c = model.config
  return nnx.eval_shape(lambda m: m.user_state(
      jnp.zeros((1, c.max_history), jnp.int32), jnp.zeros((1, c.user_dense)),
      jnp.zeros((1,), jnp.int32)), model)


def user_state_bytes(model: Ranker) -> int:
  """Device bytes of one user's cached state (a slot of the table)."""
  return _nbytes(_one_user_state(model))


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _write_users(graphdef, layout: FlatLayout, params, table, flat):
  f = layout.fields_of(flat)
  fresh = nnx.merge(graphdef, params).user_state(f["history"], f["user_dense"], f["history_len"])
  return jax.tree.map(lambda t, x: t.at[f["slots"]].set(x, mode="drop"), table, fresh)


def _score_candidates(graphdef, layout: FlatLayout, params, table, flat):
  f = layout.fields_of(flat)
  local = jax.tree.map(lambda t: t[f["slots"]], table)  # the batch's users' rows
  index = CandidateIndex.from_mapping(f["cand_to_user"], f["slots"].shape[0])
  logits = nnx.merge(graphdef, params).score_candidates(local, f["cand_items"], f["cand_dense"],
                                                        index)
  return jax.nn.sigmoid(logits)


def _compile(graphdef, params, table, name: str, step, layout: FlatLayout, *, on_compiled,
             casts: dict, donate: bool = False) -> tuple[Callable, Callable]:
  """`step(graphdef, layout, params, table, flat)` for this layout's flat buffer, as
  `fn(table, flat)`: compiled, and jitted (traceable by a profiler). The parameters
  are bound, cast once where the step only reads them cast (`precast`, sharing `casts`)."""
  start = time.perf_counter()
  flat = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
  jitted, leaves = jit_hoisted(functools.partial(step, graphdef, layout), params, table, flat,
                               cache=casts, donate_argnums=(1,) if donate else ())
  compiled = jitted.lower(leaves, table, flat).compile()
  if on_compiled is not None:
    on_compiled(name, time.perf_counter() - start)
  return functools.partial(compiled, leaves), functools.partial(jitted, leaves)


def _powers_of_two_to(n: int) -> list[int]:
  sizes = [1]
  while sizes[-1] < n:
    sizes.append(min(2 * sizes[-1], n))
  return sizes
