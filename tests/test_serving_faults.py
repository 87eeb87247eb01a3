"""The server on the fault space: overload, deadlines, bad bodies, start-up, shutdown.

A fake scorer (`serving_fakes.SlowScorer`) stands for the model, so that these run in
seconds and every accepted answer can be checked. The real model's answers over HTTP are
`test_serving.py`'s; hostile connections (heads, idle and trickling clients, the accept
queue) are `test_serving_hostile_clients.py`'s.
"""

import asyncio
import collections
import json
import logging
import threading
import time

import httpx
import numpy as np
import pytest

from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.data.trace import serving_trace
from ikbo_jax.serving import Batcher, BatchingConfig, bodies, http_load, stages
from ikbo_jax.serving.batcher import DeadlineExceeded, Overloaded
from ikbo_jax.serving.draining import DrainingServer
from ikbo_jax.serving.http import HttpLimits, create_app
from ikbo_jax.serving.protocol import guarded_http
from ikbo_jax.testing import loopback
from serving_fakes import CONFIG, SlowScorer, json_body, some_requests

def test_the_queue_bound_counts_candidates_and_refuses_before_queueing():
  model = SlowScorer(seconds=0.05)
  requests = some_requests(40)

  async def run():
    config = BatchingConfig(max_queued_candidates=30, max_in_flight=1, default_timeout_ms=60e3)
    async with Batcher(model, config) as batcher:
      results = await asyncio.gather(*(batcher.score(r) for r in requests),
                                     return_exceptions=True)
      return results, batcher.refused

  results, refused = asyncio.run(run())
  overloaded = [r for r in results if isinstance(r, Overloaded)]
  assert overloaded and refused == len(overloaded)
  assert "30" in str(overloaded[0]) and "retry later" in str(overloaded[0])
  answered = [(q, r) for q, r in zip(requests, results) if isinstance(r, np.ndarray)]
  assert len(answered) + len(overloaded) == len(requests)
  for request, scores in answered:
    np.testing.assert_array_equal(scores, request.cand_items / 1000)
  assert len(model.seen) == len(answered)  # refused requests were never computed


def test_an_idle_model_takes_a_batch_at_once_and_a_busy_one_lets_the_next_fill():
  model, sizes = SlowScorer(seconds=0.3), []
  requests = some_requests(5)

  async def run():
    config = BatchingConfig(batch_timeout_ms=2000, max_in_flight=2, default_timeout_ms=10e3)
    async with Batcher(model, config, on_batch=lambda r, b, s: sizes.append(len(r))) as batcher:
      loop = asyncio.get_running_loop()
      start = loop.time()
      first = asyncio.create_task(batcher.score(requests[0]))
      await asyncio.sleep(0.05)  # the first batch is with the model
      rest = await asyncio.gather(*(batcher.score(r) for r in requests[1:]))
      return await first, rest, loop.time() - start

  first, rest, seconds = asyncio.run(run())
  # The second batch filled while the first ran and went when it was done (0.6 s in all);
  # a batch that waited its 2 s timeout would end after 2.3 s.
  assert sizes == [1, 4], sizes
  assert seconds < 1.5, seconds
  np.testing.assert_array_equal(first, requests[0].cand_items / 1000)
  for request, scores in zip(requests[1:], rest):
    np.testing.assert_array_equal(scores, request.cand_items / 1000)


def test_a_request_past_its_deadline_in_the_queue_is_never_computed():
  model = SlowScorer(seconds=0.2)
  requests = some_requests(6)

  async def run():
    async with Batcher(model, BatchingConfig(max_batch_requests=1, max_in_flight=1)) as batcher:
      first = asyncio.create_task(batcher.score(requests[0], timeout_ms=5e3))
      await asyncio.sleep(0.05)  # the first batch is with the model
      rest = await asyncio.gather(*(batcher.score(r, timeout_ms=50) for r in requests[1:]),
                                  return_exceptions=True)
      return await first, rest, batcher.timed_out

  first, rest, timed_out = asyncio.run(run())
  np.testing.assert_array_equal(first, requests[0].cand_items / 1000)
  assert all(isinstance(r, DeadlineExceeded) for r in rest) and timed_out == 5
  assert [r.cand_items.tolist() for r in model.seen] == [requests[0].cand_items.tolist()]


def test_a_request_whose_deadline_passes_while_its_body_arrives_is_never_computed():
  model = SlowScorer(0.0)
  payload = json.dumps(json_body(some_requests(1)[0])).encode()

  async def slowly():  # the body in two halves, 0.3 s apart
    yield payload[:len(payload) // 2]
    await asyncio.sleep(0.3)
    yield payload[len(payload) // 2:]

  async def send(url, timeout_ms):
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
      return await client.post("/score", content=slowly(), headers={
          "content-type": "application/json", "x-timeout-ms": str(timeout_ms)})

  with loopback.serving(create_app(model)) as served_at:
    late = asyncio.run(send(served_at.url, 100))
    in_time = asyncio.run(send(served_at.url, 5000))
  assert late.status_code == 503 and "passed while it was read" in late.json()["error"]
  assert late.headers["retry-after"] == "1"
  assert in_time.status_code == 200 and len(model.seen) == 1


def test_a_request_held_past_its_deadline_before_its_handler_starts_is_never_computed():
  # An event loop at its limit holds parsed requests before their handlers start: the
  # deadline counts from the first bytes read (`stages.ARRIVED`), so that wait counts too.
  model = SlowScorer(0.0)
  app = create_app(model, server_timing=True)
  body = json_body(some_requests(1)[0])

  async def backlogged(scope, receive, send):
    if scope["type"] == "http" and scope["path"] == "/score":
      time.sleep(0.3)  # the loop busy with other requests before this one's handler
    await app(scope, receive, send)

  with (loopback.serving(backlogged, http=guarded_http(10.0)) as served_at,
        httpx.Client(base_url=served_at.url, timeout=30) as client):
    late = client.post("/score", json=body, headers={"x-timeout-ms": "100"})
    in_time = client.post("/score", json=body, headers={"x-timeout-ms": "5000"})
  assert late.status_code == 503 and "passed while it was read" in late.json()["error"]
  assert in_time.status_code == 200 and len(model.seen) == 1
  assert stages.parse_server_timing(in_time.headers["server-timing"])["head"] >= 300


def test_bad_clients_get_a_status_and_no_traceback(caplog):
  body = json_body(some_requests(1)[0])
  limits = HttpLimits(max_body_bytes=20_000, max_candidates=20)
  caplog.set_level(logging.INFO)
  app = create_app(SlowScorer(0.0), limits=limits)
  with (loopback.serving(app, log_config=None) as served_at,
        httpx.Client(base_url=served_at.url, timeout=30) as client):
    post = lambda **kw: client.post("/score", **kw)
    json_type = {"content-type": "application/json"}
    cases = {
        415: post(content=b"{}", headers={"content-type": "text/plain"}),
        413: post(content=b"[" * 30_000, headers=json_type),
        400: post(content=b"[" * 10_000 + b"]" * 10_000, headers=json_type),
    }
    assert post(json={**body, "cand_items": list(range(21)),
                      "cand_dense": [[0.0] * CONFIG.cand_dense] * 21}).status_code == 413
    assert post(content=b'{"user_dense": [' + b"9" * 5000 + b"]}",
                headers=json_type).status_code == 400
    assert post(content=b'{"user_dense": [NaN]}', headers=json_type).status_code == 400
    for history, named in (([1.5], "`$.history[0]`"), ([2**64 - 1], "`$.history[0]`"),
                           ([2**63], "<= 2147483647 - at `$.history[0]`"),
                           ([0, -1], ">= 0 - at `$.history[1]`")):
      wrong = post(json={**body, "history": history})
      assert wrong.status_code == 400 and named in wrong.json()["error"], wrong.text
    text = json.dumps(body)
    repeated = post(content=text[:-1] + ', "history": [1, 2]}', headers=json_type)
    assert repeated.status_code == 400 and "repeats a field (history)" in repeated.text
    nan = post(json={**body, "cand_items": [299] + body["cand_items"][1:]})
    assert nan.status_code == 422 and "not finite" in nan.json()["error"]
    assert post(json=body, headers={"x-timeout-ms": "soon"}).status_code == 400
    for forever in ("1e12", "inf", "0", "-5"):
      refused = post(json=body, headers={"x-timeout-ms": forever})
      assert refused.status_code == 400 and "(0, 60000]" in refused.json()["error"], refused.text
    for status, response in cases.items():
      assert response.status_code == status, (status, response.text)
      assert response.json()["error"]
    assert post(json=body).status_code == 200
  assert "Traceback" not in caplog.text


def test_overload_over_http_answers_every_request_and_resets_none():
  """Offered far past capacity: each request gets 200 (right scores), 429 or 503; none is reset."""
  model = SlowScorer(seconds=0.02)
  batching = BatchingConfig(max_queued_candidates=48, max_in_flight=1, default_timeout_ms=150)
  requests = some_requests(300, start=1000)

  async def offer(url):
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
      return await asyncio.gather(*(client.post("/score", json=json_body(r)) for r in requests),
                                  return_exceptions=True)

  # The client shares this process (and a 2-core host) with the server: starved, it once sent
  # a head and then no body for the default 10 s (a 408). Body timeouts are tested apart.
  limits = HttpLimits(body_timeout_s=60.0)
  with loopback.serving(create_app(model, batching, limits=limits), backlog=1024) as served_at:
    responses = asyncio.run(offer(served_at.url))
    after = httpx.post(f"{served_at.url}/score", json=json_body(requests[0]), timeout=30)
    metrics = httpx.get(f"{served_at.url}/metrics").text
  failures = [r for r in responses if isinstance(r, Exception)]
  assert not failures, failures[:3]  # no reset, no timeout: every request got a status
  statuses = [r.status_code for r in responses]
  assert set(statuses) <= {200, 429, 503} and statuses.count(200) >= 10
  assert statuses.count(429) + statuses.count(503) > 0
  for request, response in zip(requests, responses):
    if response.status_code == 200:
      np.testing.assert_allclose(response.json()["scores"], request.cand_items / 1000)
    else:
      assert response.headers["retry-after"] == "1"
  assert after.status_code == 200  # recovered once the load dropped
  assert 'ikbo_refused_total{reason="overloaded"}' in metrics or (
      'ikbo_refused_total{reason="deadline"}' in metrics)
  assert "ikbo_batch_candidates_bucket" in metrics


def test_not_ready_until_the_model_is_built():
  release = threading.Event()

  def build():
    release.wait(30)
    return SlowScorer(0.0)

  body = json_body(some_requests(1)[0])
  with (loopback.serving(create_app(build)) as served_at,
        httpx.Client(base_url=served_at.url) as client):
    assert client.get("/health/live").status_code == 200
    assert client.get("/health/ready").status_code == 503
    starting = client.post("/score", json=body)
    assert starting.status_code == 503 and starting.headers["retry-after"] == "1"
    release.set()
    deadline = time.time() + 30
    while client.get("/health/ready").status_code != 200 and time.time() < deadline:
      time.sleep(0.02)
    assert client.post("/score", json=body).status_code == 200
    health = client.get("/health").json()
    assert health["request"]["fields"]["cand_dense"].startswith("float[n, ")
    spec = client.get("/openapi.json").json()
    body = spec["paths"]["/score"]["post"]["requestBody"]["content"]["application/json"]
    assert set(body["schema"]["required"]) == set(bodies.FIELDS)
    assert {"200", "413", "429", "503"} <= set(map(str, spec["paths"]["/score"]["post"][
        "responses"]))
    # Only POST reaches the endpoint; the rest of /score is Starlette's routing.
    assert client.get("/score").status_code == 405


def test_shutdown_answers_what_is_in_flight_then_exits():
  """Graceful drain (what SIGTERM starts): queued and running requests are all answered."""
  model = SlowScorer(seconds=0.3)
  requests = some_requests(12, start=2000)
  batching = BatchingConfig(max_batch_requests=4, max_in_flight=1, default_timeout_ms=10e3)

  async def offer(served_at):
    async with httpx.AsyncClient(base_url=served_at.url, timeout=30) as client:
      sent = [asyncio.create_task(client.post("/score", json=json_body(r))) for r in requests]
      await asyncio.sleep(0.15)  # the first batch is with the model, the rest queued
      served_at.server.should_exit = True
      return await asyncio.gather(*sent, return_exceptions=True)

  with loopback.serving(create_app(model, batching), DrainingServer,
                        timeout_graceful_shutdown=10) as served_at:
    start = time.perf_counter()
    responses = asyncio.run(offer(served_at))
    served_at.thread.join(timeout=30)
    took = time.perf_counter() - start
  assert [getattr(r, "status_code", r) for r in responses] == [200] * len(requests)
  for request, response in zip(requests, responses):
    np.testing.assert_allclose(response.json()["scores"], request.cand_items / 1000)
  assert not served_at.thread.is_alive() and took < 5

def test_a_request_whose_deadline_the_queue_would_pass_gets_503_before_its_body_is_read():
  """One batch at a time of 0.15 s each: once the queue holds more than its deadline's worth
  of work, a request is refused at once (503, naming the expected wait), not read, queued
  and timed out; the ones accepted are all answered."""
  model = SlowScorer(seconds=0.15)
  batching = BatchingConfig(max_batch_requests=1, max_in_flight=1)
  requests = some_requests(12, start=5000)

  async def offer(url):
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
      assert (await client.post("/score", json=json_body(requests[0]))).status_code == 200
      started = time.perf_counter()
      responses = await asyncio.gather(*(
          client.post("/score", json=json_body(r), headers={"X-Timeout-Ms": "400"})
          for r in requests[1:]))
      return responses, time.perf_counter() - started

  with loopback.serving(create_app(model, batching)) as served_at:
    responses, took = asyncio.run(offer(served_at.url))
  statuses = [r.status_code for r in responses]
  shed = [r for r in responses if "expected wait" in r.text]
  assert statuses.count(200) >= 2 and shed and set(statuses) <= {200, 503}, statuses
  assert all(r.status_code == 503 and "it was not read" in r.json()["error"] for r in shed)
  assert len(model.seen) == 1 + statuses.count(200)  # nothing refused was computed
  assert took < 2.5


def test_requests_past_the_active_bound_get_429_before_their_body_is_read():
  model = SlowScorer(seconds=0.2)
  limits = HttpLimits(max_active=2)
  requests = some_requests(6, start=3000)

  async def offer(url):
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
      return await asyncio.gather(*(client.post("/score", json=json_body(r)) for r in requests))

  with loopback.serving(create_app(model, limits=limits)) as served_at:
    responses = asyncio.run(offer(served_at.url))
  statuses = sorted(r.status_code for r in responses)
  assert statuses.count(200) >= 2 and set(statuses) == {200, 429}, statuses
  busy = next(r for r in responses if r.status_code == 429)
  assert "2 requests are being served" in busy.json()["error"]


def test_the_load_generator_counts_refusals_by_kind_from_several_processes():
  model = SlowScorer(seconds=0.02)
  batching = BatchingConfig(max_queued_candidates=24, max_in_flight=1)
  requests = some_requests(120, start=4000)
  right = [r.cand_items / 1000 for r in requests]
  wrong = [x + 0.01 * (i % 2) for i, x in enumerate(right)]  # every other request's scores off
  with loopback.serving(create_app(model, batching)) as served_at:
    stats = http_load.over_http(served_at.url, requests, qps=2000, processes=2, connections=32,
                                expected=right, score_tolerance=1e-6)
    checked = http_load.over_http(served_at.url, requests, qps=200, processes=2,
                                  connections=32, expected=wrong, score_tolerance=1e-3)
  assert stats["requests"] == 120 and stats["answered"] + stats["errors"] == 120
  assert stats["answered"] > 0 and set(stats["errors_by_kind"]) <= {"429", "503"}
  # Answers checked against the scores each request should get: a wrong one is not an answer.
  assert 0 < checked["errors_by_kind"]["wrong_score"] <= 60 < checked["answered"] + 60


def test_a_serving_trace_brings_popular_users_back():
  gen = ClickGenerator(CONFIG, seed=3, mean_candidates=4, max_candidates=40)
  trace = serving_trace(gen, 400, num_users=1000, large_share=0.1)
  users = collections.Counter(r.user_dense.tobytes() for r in trace)
  assert users.most_common(1)[0][1] >= 20 and len(users) > 100  # a head and a long tail
  same_user = [r for r in trace if r.user_dense.tobytes() == users.most_common(1)[0][0]]
  assert all(np.array_equal(r.history, same_user[0].history) for r in same_user)
  assert len({r.cand_items.tobytes() for r in same_user}) > 1  # fresh candidates each time
  assert max(r.num_candidates for r in trace) > 3 * np.median([r.num_candidates for r in trace])


def test_a_serving_trace_drawn_in_processes_is_the_same_trace():
  gen = ClickGenerator(CONFIG, seed=5, mean_candidates=4, max_candidates=40)
  serial = serving_trace(gen, 200, num_users=100, large_share=0.1)
  spread = serving_trace(gen, 200, num_users=100, large_share=0.1, processes=2)
  fields = ("user_dense", "history", "cand_items", "cand_dense")
  assert len(serial) == len(spread) == 200
  assert all(np.array_equal(getattr(a, f), getattr(b, f)) for a, b in zip(serial, spread)
             for f in fields)
  with pytest.raises(ValueError, match="processes"):
    serving_trace(gen, 10, processes=0)


def test_a_model_that_fails_to_start_is_never_ready_and_not_live():
  def build():
    raise RuntimeError("a smoke request got non-finite scores")

  with (loopback.serving(create_app(build)) as served_at,
        httpx.Client(base_url=served_at.url) as client):
    deadline = time.time() + 30
    while client.get("/health/live").status_code == 200 and time.time() < deadline:
      time.sleep(0.02)
    live = client.get("/health/live")
    assert live.status_code == 503 and "non-finite" in live.json()["error"]
    assert client.get("/health/ready").status_code == 503
    assert client.post("/score", json=json_body(some_requests(1)[0])).status_code == 503


@pytest.mark.parametrize("name, value", [("max_queued_candidates", 0),
                                         ("default_timeout_ms", 0)])
def test_admission_arguments_are_checked(name, value):
  with pytest.raises(ValueError, match=name):
    BatchingConfig(**{name: value})
