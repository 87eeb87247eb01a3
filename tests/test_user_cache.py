"""The user-state slot table: random request sequences against a reference LRU and a simulated device table."""

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ikbo_jax.data import Request
from ikbo_jax.serving.user_cache import SlotTable, user_key


class FakeClock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


# A run: batches of user ids (some repeated within a batch), each after some seconds.
batches = st.lists(st.tuples(st.lists(st.integers(0, 11), min_size=1, max_size=4),
                             st.floats(0, 3)), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(run=batches, capacity=st.integers(4, 9), ttl=st.one_of(st.none(), st.floats(1, 10)),
       flush_at=st.one_of(st.none(), st.integers(0, 39)))
def test_every_request_reads_its_own_users_state_and_lru_matches_a_reference(
    run, capacity, ttl, flush_at):
  clock = FakeClock()
  table = SlotTable(capacity, min_slots=4, ttl_seconds=ttl, clock=clock)
  device = {}  # slot -> the key whose state the device table holds there
  reference = collections.OrderedDict()  # key -> time written, least recent first
  for step, (users, seconds) in enumerate(run):
    clock.now += seconds
    if step == flush_at:
      table.flush()
      reference.clear()
    keys = [f"user{u}".encode() for u in users]
    # The documented order: the batch's hits are touched first, then its new users inserted.
    fresh = {k for k in keys if k in reference and (ttl is None or clock.now - reference[k] < ttl)}
    for key in dict.fromkeys(keys):
      if key in fresh:
        reference.move_to_end(key)
    for key in dict.fromkeys(keys):
      if key not in fresh:
        reference.pop(key, None)
        reference[key] = clock.now
    while len(reference) > capacity:
      reference.popitem(last=False)
    expected_hits = [k in fresh or k in keys[:i] for i, k in enumerate(keys)]
    placement = table.place(keys)
    missed = {r for r, _ in placement.misses}
    assert [r not in missed for r in range(len(keys))] == expected_hits
    for r, slot in placement.misses:  # the step writes the new users' states, then reads
      device[slot] = keys[r]
    assert [device[s] for s in placement.slots] == keys  # never a stale or foreign slot
    assert len(set(placement.slots[[r for r, _ in placement.misses]])) == len(placement.misses)
    assert 0 <= placement.slots.min() and placement.slots.max() < capacity
    assert len(table) <= capacity


def test_the_key_is_every_user_input_exactly():
  base = Request(np.zeros(3, np.float32), np.array([4, 5], np.int32), np.array([1]),
                 np.zeros((1, 2), np.float32))
  other_history = Request(base.user_dense, np.array([4, 6], np.int32), base.cand_items,
                          base.cand_dense)
  other_profile = Request(np.array([0, 0, 1e-30], np.float32), base.history, base.cand_items,
                          base.cand_dense)
  new_candidates = Request(base.user_dense, base.history, np.array([7, 8]),
                           np.ones((2, 2), np.float32))
  assert user_key(base) == user_key(new_candidates)
  assert len({user_key(base), user_key(other_history), user_key(other_profile)}) == 3


def test_bad_sizes_are_refused_with_the_bound():
  with pytest.raises(ValueError, match="capacity=2 slots is below min_slots=4"):
    SlotTable(2, min_slots=4)
  with pytest.raises(ValueError, match="ttl_seconds must be > 0"):
    SlotTable(4, ttl_seconds=0)
  with pytest.raises(ValueError, match="5 distinct users exceeds min_slots=4"):
    SlotTable(8, min_slots=4).place([bytes([i]) for i in range(5)])
