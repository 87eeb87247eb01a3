"""The user-state cache: the slot table against a reference LRU and a simulated device table,
and the cached model against the uncached build on random request sequences."""

import collections
import concurrent.futures
import dataclasses

import httpx
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from ikbo_jax.data import Request
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.models import Ranker, RankerConfig
from ikbo_jax.serving import Bucket, BucketedModel
from ikbo_jax.serving.cached import CachedModel
from ikbo_jax.serving.http import create_app
from ikbo_jax.serving.user_cache import SlotTable, user_key
from ikbo_jax.testing import loopback


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


# The cached model on CPU: random request sequences against the uncached build as the oracle.

CONFIG = RankerConfig(num_items=300, max_history=16)
BUCKETS = [Bucket(32, 4, 16), Bucket(64, 8, 16)]


@pytest.fixture(scope="module")
def models():
  ranker = Ranker(CONFIG, rngs=nnx.Rngs(0))
  # Room for 10 users: a pool of 16 evicts all the time.
  cached = CachedModel(ranker, BUCKETS, cache_bytes=10 * _bytes_per_user(ranker))
  return cached, BucketedModel(ranker, BUCKETS)


def _bytes_per_user(ranker):
  return CachedModel(ranker, BUCKETS[:1], cache_bytes=10**9).bytes_per_user


def _pool(seed):
  """16 users' requests; users 12-15 are users 0-3 with a changed history."""
  requests = [r.validated(CONFIG) for r in ClickGenerator(
      CONFIG, seed=seed, mean_candidates=4, max_candidates=8).requests(16)]
  for u in range(12, 16):
    history = (requests[u - 12].history[::-1] + 1) % CONFIG.num_items
    requests[u] = dataclasses.replace(requests[u - 12], history=history.astype(np.int32))
  return requests


def _assert_matches_oracle(cached, oracle, batch):
  for got, want in zip(cached(batch), oracle(batch)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@settings(max_examples=15, deadline=None)
@given(batches=st.lists(st.lists(st.integers(0, 15), min_size=1, max_size=6), min_size=1,
                        max_size=12), seed=st.integers(0, 3))
def test_cached_scores_equal_the_uncached_build(models, batches, seed):
  cached, oracle = models
  cached.flush()
  pool = _pool(seed)
  for users in batches:
    _assert_matches_oracle(cached, oracle, [pool[u] for u in users])


def test_concurrent_batches_read_only_their_own_users(models):
  cached, oracle = models
  cached.flush()
  pool = _pool(7)
  rng = np.random.default_rng(0)
  batches = [[pool[u] for u in rng.integers(0, 16, size=5)] for _ in range(48)]
  with concurrent.futures.ThreadPoolExecutor(6) as threads:
    results = list(threads.map(cached, batches))
  for batch, got in zip(batches, results):
    for g, w in zip(got, oracle(batch)):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  assert cached.slots.stats.hits > 0 and cached.slots.stats.evictions > 0


def test_a_failed_step_forgets_the_table_and_the_next_batch_is_right(models, monkeypatch):
  cached, oracle = models
  cached.flush()
  pool = _pool(9)
  _assert_matches_oracle(cached, oracle, pool[:4])
  bucket = cached.bucket_for(pool[:4])

  def fail(*args):
    raise RuntimeError("the device went away")

  monkeypatch.setitem(cached._readers, bucket, fail)
  with pytest.raises(RuntimeError, match="went away"):
    cached(pool[:4])
  monkeypatch.undo()
  flushes = cached.slots.stats.flushes
  _assert_matches_oracle(cached, oracle, pool[:4])
  assert len(cached.slots) == 4 and cached.slots.stats.flushes == flushes


def test_a_cache_too_small_for_a_batch_is_refused_with_the_minimum():
  ranker = Ranker(CONFIG, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"cache_bytes=1000 holds 0 user states of \d+ bytes; "
                                       r"the largest bucket has 8 users, so it needs at least"):
    CachedModel(ranker, BUCKETS, cache_bytes=1000)


def test_the_cache_over_http_reports_flushes_and_is_in_the_metrics(models):
  cached, oracle = models
  cached.flush()
  before = cached.report()
  request = _pool(11)[0]
  body = {f: np.asarray(getattr(request, f)).tolist()
          for f in ("user_dense", "history", "cand_items", "cand_dense")}
  with (loopback.serving(create_app(cached)) as served_at,
        httpx.Client(base_url=served_at.url, timeout=30) as client):
    for _ in range(3):
      response = client.post("/score", json=body)
      np.testing.assert_allclose(response.json()["scores"], oracle([request])[0], rtol=1e-5,
                                 atol=1e-6)
    report = client.get("/cache").json()
    assert report["hits"] - before["hits"] == 2 and report["misses"] - before["misses"] == 1
    assert report["entries"] == 1
    metrics = client.get("/metrics").text
    assert f"ikbo_cache_hits_total {report['hits']:.1f}" in metrics
    assert "ikbo_cache_entries 1.0" in metrics
    # A cross-site form could send this one; the flush takes JSON only.
    refused = client.post("/cache/flush", content=b"x", headers={"content-type": "text/plain"})
    assert refused.status_code == 415 and "application/json" in refused.json()["error"]
    assert client.get("/cache").json()["entries"] == 1
    flushed = client.post("/cache/flush", json={})
    assert flushed.status_code == 200 and flushed.json()["entries"] == 0
  with (loopback.serving(create_app(oracle)) as served_at,
        httpx.Client(base_url=served_at.url, timeout=30) as client):
    response = client.get("/cache")
    assert response.status_code == 404 and "--cache-mb" in response.json()["error"]


@pytest.mark.gpu
def test_cached_bfloat16_scores_on_the_gpu_match_the_uncached_build():
  """On the GPU kernels, with donation and in-place writes: evictions and changed histories."""
  config = RankerConfig(num_items=500, embed_dim=256, num_heads=2, max_history=128,
                        query_tokens=16, user_dense=32, cand_dense=16, user_dense_tokens=3,
                        cand_dense_tokens=3, compressed=16, tower=(64, 32), dtype="bfloat16")
  ranker = Ranker(config, rngs=nnx.Rngs(4))
  buckets = [Bucket(64, 4, 128), Bucket(128, 8, 128)]
  per_user = CachedModel(ranker, buckets[:1], cache_bytes=1 << 30).bytes_per_user
  cached = CachedModel(ranker, buckets, cache_bytes=10 * per_user)
  oracle = BucketedModel(ranker, buckets)
  requests = [r.validated(config) for r in ClickGenerator(
      config, seed=8, mean_candidates=6, max_candidates=12).requests(16)]
  for u in range(12, 16):  # users 0-3 again with a changed history
    changed = (requests[u - 12].history[::-1] + 1) % config.num_items
    requests[u] = dataclasses.replace(requests[u - 12], history=changed.astype(np.int32))
  rng, worst = np.random.default_rng(1), 0.0
  for _ in range(40):
    batch = [requests[u] for u in rng.integers(0, 16, size=rng.integers(1, 7))]
    for got, want in zip(cached(batch), oracle(batch)):
      worst = max(worst, float(np.max(np.abs(got - want))))
  report = cached.report()
  assert report["hits"] > 0 and report["evictions"] > 0, report
  # Two bfloat16 paths (fused build vs its two halves) differ by rounding; which state each
  # request reads is checked exactly by the CPU tests above.
  assert worst < 2e-2, worst
