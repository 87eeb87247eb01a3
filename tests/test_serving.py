"""Serving: bucketed executables, the batcher, the HTTP endpoint and the load generator."""

import asyncio
import dataclasses
import re
import threading
import time

import httpx
import jax
import numpy as np
import pytest
from flax import nnx

from ikbo_jax.data import RequestError, pack_requests
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.models import Build, Ranker, RankerConfig
from ikbo_jax.serving import Batcher, BatchingConfig, Bucket, BucketedModel, DeviceSet, Scorer
from ikbo_jax.serving import bodies
from ikbo_jax.serving.http import create_app
from ikbo_jax.serving.load import run_load
from ikbo_jax.serving.transfer import FlatLayout
from ikbo_jax.testing import loopback

CONFIG = RankerConfig(num_items=300, max_history=16)
BUCKETS = [Bucket(16, 2, 16), Bucket(48, 4, 16)]
_COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, *_, **__: _COMPILES.append(event)
    if event == "/jax/core/compile/backend_compile_duration" else None)


@pytest.fixture(scope="module")
def ranker():
  return Ranker(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def served(ranker):
  return BucketedModel(ranker, BUCKETS, "ikbo")


def _requests(count, start=0, mean=4, most=40):
  return ClickGenerator(CONFIG, seed=5, mean_candidates=mean, max_candidates=most).requests(
      count, start)


def _alone(ranker, request):
  """The request scored by itself, in a batch of exactly its size."""
  batch = pack_requests([request.validated(CONFIG)], CONFIG, num_users=1,
                        num_candidates=request.num_candidates)
  return np.asarray(jax.nn.sigmoid(nnx.jit(lambda m, b: m(b))(ranker, batch)))


async def _score_all(served, requests, **batching):
  async with Batcher(served, BatchingConfig(**batching)) as batcher:
    return await asyncio.gather(*(batcher.score(r) for r in requests), return_exceptions=True)


def test_batched_scores_equal_each_request_scored_alone(ranker, served):
  reqs = _requests(12)
  edge = dataclasses.replace(reqs[0], cand_items=np.arange(48) % 300,
                             cand_dense=np.ones((48, CONFIG.cand_dense)), labels=None)
  single = dataclasses.replace(reqs[1], cand_items=reqs[1].cand_items[:1],
                               cand_dense=reqs[1].cand_dense[:1], labels=None)
  oversized = dataclasses.replace(edge, cand_items=np.arange(100) % 300,
                                  cand_dense=np.ones((100, CONFIG.cand_dense)))  # split in 3
  full_history = dataclasses.replace(reqs[2], history=np.arange(16))
  mixed = [edge, single, oversized, full_history, *reqs[3:]]
  scores = asyncio.run(_score_all(served, mixed, batch_timeout_ms=5.0))
  for request, got in zip(mixed, scores):
    assert got.shape == (request.num_candidates,)
    np.testing.assert_allclose(got, _alone(ranker, request), rtol=1e-5, atol=1e-6)


class _SlowModel:
  """`served` behind a 20 ms sleep that records how many batches run at once."""

  def __init__(self, served):
    self.served, self.running, self.most = served, 0, 0
    self.lock = threading.Lock()

  def __getattr__(self, name):
    return getattr(self.served, name)

  def __call__(self, requests):
    with self.lock:
      self.running += 1
      self.most = max(self.most, self.running)
    time.sleep(0.02)
    try:
      return self.served(requests)
    finally:
      with self.lock:
        self.running -= 1


def test_batches_in_flight_overlap_up_to_the_limit(ranker, served):
  model, reqs = _SlowModel(served), _requests(24)
  scores = asyncio.run(_score_all(model, reqs, max_batch_requests=1, batch_timeout_ms=0.0,
                                  max_in_flight=3))
  assert model.most == 3  # reached, never exceeded
  for request, got in zip(reqs[:2], scores):
    np.testing.assert_allclose(got, _alone(ranker, request), rtol=1e-5, atol=1e-6)


def test_a_bad_request_fails_alone(ranker, served):
  good = _requests(4, start=100)
  r = good[0]
  bad = {
      "cand_items is empty": dataclasses.replace(r, cand_items=np.zeros(0, int),
                                                 cand_dense=np.zeros((0, CONFIG.cand_dense))),
      "history has 17 items": dataclasses.replace(r, history=np.arange(17)),
      r"unknown item ids \[300\]": dataclasses.replace(r, history=np.array([1, 300])),
      r"cand_dense must have shape \(": dataclasses.replace(r, cand_dense=np.ones((1, 2))),
      "user_dense must be finite": dataclasses.replace(
          r, user_dense=np.full(CONFIG.user_dense, np.nan)),
      r"user_dense\[3\] = 1e\+19 is outside the model's valid range": dataclasses.replace(
          r, user_dense=np.where(np.arange(CONFIG.user_dense) == 3, 1e19, r.user_dense)),
      r"cand_dense\[0, 1\] = -3e\+16 is outside": dataclasses.replace(
          r, cand_dense=np.where(np.arange(CONFIG.cand_dense) == 1, -3e16, r.cand_dense)),
  }
  results = asyncio.run(_score_all(served, [*bad.values(), *good]))
  for (pattern, _), result in zip(bad.items(), results):
    assert isinstance(result, RequestError) and re.search(pattern, str(result)), (
        pattern, result)
  for request, got in zip(good, results[len(bad):]):
    np.testing.assert_allclose(got, _alone(ranker, request), rtol=1e-5, atol=1e-6)


def test_the_feature_bound_is_sound_and_what_it_refuses_overflowed(ranker, served):
  """Features at the bound score as the model does unbounded; far past it, every score was
  the same (the tower's LayerNorm overflowed), which is what the bound refuses."""
  from ikbo_jax.models.valid_range import max_abs_dense_feature
  bound = max_abs_dense_feature(ranker)
  assert served.max_abs_feature == bound and 1e6 < bound < 1e19
  r = _requests(1, start=7, mean=8)[0]
  signs = np.sign(np.random.default_rng(0).normal(size=r.cand_dense.shape))
  at_bound = dataclasses.replace(r, user_dense=np.full(CONFIG.user_dense, bound),
                                 cand_dense=signs * bound)
  scores = asyncio.run(_score_all(served, [at_bound]))[0]
  assert np.isfinite(scores).all() and np.ptp(_alone(ranker, at_bound)) > 0
  past = dataclasses.replace(r, user_dense=np.full(CONFIG.user_dense, 1e19),
                             cand_dense=signs * 1e19)
  assert np.ptp(_alone(ranker, past)) == 0  # what used to answer 200: one score for all


@pytest.mark.parametrize("dtype, most", [("bfloat16", 3.4e38), ("float16", 65504.0)])
def test_the_feature_bound_follows_the_compute_dtype(ranker, dtype, most):
  """The bound comes from the compute dtype's largest value (NumPy's `finfo` knows no
  bfloat16: a bfloat16 model, the GPU's, failed to start)."""
  from ikbo_jax.models.valid_range import max_abs_dense_feature
  low = Ranker(dataclasses.replace(CONFIG, dtype=dtype), rngs=nnx.Rngs(0))
  bound = max_abs_dense_feature(low)
  ratio = np.sqrt(most / np.finfo(np.float32).max)
  np.testing.assert_allclose(bound, max_abs_dense_feature(ranker) * ratio, rtol=1e-2)


def test_no_compilation_after_start_up(served):
  before = len(_COMPILES)
  requests = _requests(30, start=200, mean=6)
  scores = asyncio.run(_score_all(served, requests, batch_timeout_ms=1.0))
  assert all(isinstance(s, np.ndarray) for s in scores)
  assert len(_COMPILES) == before, "serving compiled after warm-up"
  jax.jit(lambda x: x * 1.25 + 0.5)(np.ones(7))  # the counter does see a compilation
  assert len(_COMPILES) > before


def test_bucket_and_batching_arguments_are_checked(ranker, served):
  with pytest.raises(ValueError, match="history_slots must be at most the model's max_history"):
    BucketedModel(ranker, [Bucket(8, 1, 17)])
  with pytest.raises(ValueError, match="build must be"):
    BucketedModel(ranker, BUCKETS, "fast")
  with pytest.raises(ValueError, match="max_batch_requests=5 exceeds"):
    Batcher(served, BatchingConfig(max_batch_requests=5))
  with pytest.raises(ValueError, match="batch_timeout_ms must be >= 0"):
    BatchingConfig(batch_timeout_ms=-1)
  with pytest.raises(ValueError, match="max_in_flight must be a positive int, got 0"):
    BatchingConfig(max_in_flight=0)


def test_http_endpoint_over_loopback(ranker, served):
  with (loopback.serving(create_app(served)) as served_at,
        httpx.Client(base_url=served_at.url, timeout=30) as client):
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["build"] == "ikbo"
    request = _requests(1, start=300)[0]
    body = {f: np.asarray(getattr(request, f)).tolist()
            for f in ("user_dense", "history", "cand_items", "cand_dense")}
    response = client.post("/score", json=body)
    assert response.status_code == 200
    np.testing.assert_allclose(response.json()["scores"], _alone(ranker, request),
                               rtol=1e-5, atol=1e-6)
    packed = client.post("/score", content=bodies.encode(request, bodies.MSGPACK),
                         headers={"content-type": bodies.MSGPACK})
    np.testing.assert_allclose(packed.json()["scores"], response.json()["scores"], rtol=1e-6)
    bad = client.post("/score", json={**body, "cand_items": [10**6]})
    assert bad.status_code == 400 and "cand_items" in bad.json()["error"]
    assert client.post("/score", content=b"{not json",
                       headers={"content-type": "application/json"}).status_code == 400
    missing = client.post("/score", json={"history": []})
    assert missing.status_code == 400
    assert "missing required field `user_dense`" in missing.json()["error"]


def test_load_generator_reports_percentiles():
  async def score(request):
    await asyncio.sleep(0.001)
    if request.num_candidates > 10:
      raise RequestError("too many")
    return np.zeros(request.num_candidates)

  requests = _requests(60, start=400)
  stats = asyncio.run(run_load(score, requests, qps=500.0))
  rejected = sum(r.num_candidates > 10 for r in requests)
  assert stats["requests"] == 60 and stats["errors"] == rejected
  assert 1.0 <= stats["p50_ms"] <= stats["p90_ms"] <= stats["p99_ms"] < 1000


def test_both_served_models_are_scorers(ranker, served):
  assert isinstance(served, Scorer) and served.build is Build.IKBO
  device_set = DeviceSet(ranker, BUCKETS, "standard", devices=jax.devices()[:1])
  assert isinstance(device_set, Scorer) and device_set.build is Build.STANDARD
  with pytest.raises(ValueError, match="build must be one of"):
    BucketedModel(ranker, BUCKETS, "fast")


def test_a_batch_packed_into_a_reused_flat_buffer_comes_back_bit_for_bit():
  requests = [r.validated(CONFIG) for r in _requests(4, start=500)]
  layout = FlatLayout.of(CONFIG, num_users=4, num_candidates=48, history_slots=16)
  flat, views = layout.host_buffer()
  assert flat.dtype == np.int32 and flat.shape == (layout.size,)
  unflatten = jax.jit(layout.unflatten)
  # The second packing reuses the buffer with fewer requests: nothing of the first may remain.
  for chosen in (requests[:3], requests[3:]):
    pack_requests(chosen, CONFIG, num_users=4, num_candidates=48, history_slots=16, out=views)
    fresh = pack_requests(chosen, CONFIG, num_users=4, num_candidates=48, history_slots=16)
    back = unflatten(flat)
    for name, _ in layout.fields:
      expected = np.asarray(getattr(fresh, name))
      assert np.asarray(getattr(back, name)).dtype == expected.dtype, name
      np.testing.assert_array_equal(np.asarray(getattr(back, name)), expected, err_msg=name)
  _, narrow = FlatLayout.of(CONFIG, 4, 48, 8).host_buffer()
  with pytest.raises(ValueError, match=r"out.history is int32\[4, 8\]; the batch needs int32\[4, 16\]"):
    pack_requests(requests[:1], CONFIG, num_users=4, num_candidates=48, history_slots=16,
                  out=narrow)


def test_overload_with_the_model_answers_every_request_and_mixes_none_up(ranker, served):
  """A burst far past capacity through HTTP: 200 with the request's own scores, or 429/503."""
  requests = _requests(240, start=600)
  batching = BatchingConfig(max_queued_candidates=64, default_timeout_ms=100)

  async def offer(url):
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
      bodies = [{f: np.asarray(getattr(r, f)).tolist()
                 for f in ("user_dense", "history", "cand_items", "cand_dense")}
                for r in requests]
      return await asyncio.gather(*(client.post("/score", json=b) for b in bodies),
                                  return_exceptions=True)

  with loopback.serving(create_app(served, batching), backlog=1024) as served_at:
    responses = asyncio.run(offer(served_at.url))
  assert not [r for r in responses if isinstance(r, Exception)]
  statuses = [r.status_code for r in responses]
  assert set(statuses) <= {200, 429, 503} and 200 in statuses and len(set(statuses)) > 1
  answered = [(q, r) for q, r in zip(requests, responses) if r.status_code == 200]
  for request, response in answered[:: max(len(answered) // 6, 1)]:
    np.testing.assert_allclose(response.json()["scores"], _alone(ranker, request),
                               rtol=1e-5, atol=1e-6)
