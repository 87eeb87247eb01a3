"""`SlotTable`: which slot of a device-resident table holds which user's state, across requests.

A served batch's candidates read their user's state by index (`cand_to_user`),
so that index may as well point into a table that outlives the request: a
user scored a moment ago (another ranking stage, another surface, a popular
user) is a hit and costs its candidates' side alone. This module is the
table's host-side bookkeeping; the device arrays and the compiled steps that
write and read them live with the served model.

A user's key is the exact bytes of every user-side input (the profile, then
the history), so an entry is only ever found by a request whose user side is
the same computation: a changed history is a different key and can never hit
a stale entry, and no hash collision can alias two users (the dictionary
compares the full bytes on a match). Entries leave in least-recently-used
order (within a batch, its hits count as used before its new users are
written), when their time to live runs out, or on `flush`.

Slots in flight: the table is updated functionally, each batch's step taking
the table the previous batch's step returned, and the steps run in the order
their batches were placed (`place` and the step's dispatch happen under one
lock). A batch in flight therefore reads the table as it was placed, whatever
later batches evict and overwrite; and within a batch, the slots it reads are
the most recently used ones, which eviction reaches last, so a batch never
evicts a slot it reads itself as long as the table holds at least as many
slots as a batch has users (checked at construction against that bound).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from ikbo_jax.data import Request


def user_key(request: Request) -> bytes:
  """The exact bytes of a validated request's user-side inputs (profile, then history)."""
  return request.user_dense.tobytes() + request.history.tobytes()


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a batch's users are in the table.

  Attributes:
    slots: `int32[R]` the slot of each request's user.
    misses: `(request, slot)` of each user the batch must compute and write,
      one per distinct new user (later requests of that user in the batch hit
      the same slot).
  """

  slots: np.ndarray
  misses: tuple[tuple[int, int], ...]

  @property
  def hits(self) -> int:
    return len(self.slots) - len(self.misses)


@dataclasses.dataclass
class CacheStats:
  hits: int = 0
  misses: int = 0
  evictions: int = 0  # entries removed to make room
  expirations: int = 0  # entries found past their time to live
  flushes: int = 0


class SlotTable:
  """An LRU map from user keys to `capacity` slots, with an optional time to live.

  Args:
    capacity: slots in the table; at least `min_slots`.
    min_slots: the most distinct users one batch can hold (the largest
      bucket's user slots): a batch must never need to evict its own users.
    ttl_seconds: an entry older than this (since written) is a miss.
    clock: seconds, monotonic (tests pass a fake).

  >>> table = SlotTable(capacity=2, min_slots=2)
  >>> table.place([b"ann", b"bob", b"ann"]).misses   # ann's second request hits
  ((0, 0), (1, 1))
  >>> table.place([b"cid"]).misses                   # evicts the least recent: ann
  ((0, 0),)
  >>> table.place([b"bob"]).hits
  1
  """

  def __init__(self, capacity: int, *, min_slots: int = 1, ttl_seconds: float | None = None,
               clock: Callable[[], float] = time.monotonic):
    if not (isinstance(capacity, int) and isinstance(min_slots, int) and 1 <= min_slots):
      raise ValueError(f"capacity and min_slots must be positive ints, got {capacity!r} and "
                       f"{min_slots!r}")
    if capacity < min_slots:
      raise ValueError(f"capacity={capacity} slots is below min_slots={min_slots}: one batch "
                       f"could need to evict its own users")
    if ttl_seconds is not None and not ttl_seconds > 0:
      raise ValueError(f"ttl_seconds must be > 0 or None, got {ttl_seconds!r}")
    self.capacity, self.min_slots, self.ttl_seconds = capacity, min_slots, ttl_seconds
    self._clock = clock
    self._entries: collections.OrderedDict[bytes, tuple[int, float]] = collections.OrderedDict()
    self._free = list(range(capacity - 1, -1, -1))  # popped from the end: slot 0 first
    self.stats = CacheStats()

  def __len__(self) -> int:
    return len(self._entries)

  def place(self, keys: Sequence[bytes]) -> Placement:
    """Slots for one batch's users, in request order; new users get free or evicted slots."""
    distinct = len(set(keys))
    if distinct > self.min_slots:
      raise ValueError(f"a batch of {distinct} distinct users exceeds min_slots="
                       f"{self.min_slots}, the bound the table was sized for")
    # Hits first, so that the slots this batch reads are the most recent before any eviction.
    now, placed = self._clock(), {}
    for key in keys:
      if key not in placed and (slot := self._lookup(key, now)) is not None:
        placed[key] = slot
        self.stats.hits += 1
    slots, misses = [], []
    for r, key in enumerate(keys):
      if key not in placed:
        placed[key] = self._take_slot()
        self._entries[key] = (placed[key], now)
        misses.append((r, placed[key]))
        self.stats.misses += 1
      slots.append(placed[key])
    return Placement(np.asarray(slots, np.int32), tuple(misses))

  def flush(self) -> None:
    """Forgets every entry (the device table's contents become unreachable)."""
    self._entries.clear()
    self._free = list(range(self.capacity - 1, -1, -1))
    self.stats.flushes += 1

  def _lookup(self, key: bytes, now: float) -> int | None:
    entry = self._entries.get(key)
    if entry is None:
      return None
    slot, written = entry
    if self.ttl_seconds is not None and now - written >= self.ttl_seconds:
      del self._entries[key]
      self._free.append(slot)
      self.stats.expirations += 1
      return None
    self._entries.move_to_end(key)
    return slot

  def _take_slot(self) -> int:
    if self._free:
      return self._free.pop()
    _, (slot, _) = self._entries.popitem(last=False)
    self.stats.evictions += 1
    return slot
