"""The server against hostile connections: request heads, idle and trickling clients, the
accept queue at shutdown, clients that leave mid-body.

Each starts the real HTTP server (uvicorn on a loopback port) over the fake scorer of
`serving_fakes`, and keeps its loops bounded in count and time.
"""

import asyncio
import collections
import contextlib
import json
import logging
import socket
import time

import httpx
import numpy as np
import pytest

from ikbo_jax.serving.draining import DrainingServer
from ikbo_jax.serving.http import HttpLimits, create_app
from ikbo_jax.serving.protocol import guarded_http
from ikbo_jax.testing import loopback
from serving_fakes import HEAD, SlowScorer, json_body, some_requests


def test_a_client_that_stops_sending_its_body_gets_408():
  limits = HttpLimits(body_timeout_s=0.3)
  with loopback.serving(create_app(SlowScorer(0.0), limits=limits)) as served_at:
    host, port = served_at.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
      conn.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: 1000\r\n\r\n{\"user_dense\": [")
      reply = conn.recv(4096).decode()
  assert reply.startswith("HTTP/1.1 408") and "did not arrive" in reply


def test_a_body_in_pieces_above_the_minimum_rate_is_scored_as_a_whole_one():
  """Five pieces 0.1 s apart, past the grace second's share: each moves the body's deadline,
  none passes it, and the scores are those of the same body sent at once."""
  request = some_requests(1)[0]
  body = json.dumps(json_body(request)).encode()
  limits = HttpLimits(min_body_rate=200.0, body_grace_s=0.15)
  with loopback.serving(create_app(SlowScorer(0.0), limits=limits)) as served_at:
    host, port = served_at.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
      conn.sendall(HEAD + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
      for piece in range(5):
        time.sleep(0.1)
        conn.sendall(body[piece * len(body) // 5:(piece + 1) * len(body) // 5])
      reply = b""
      while chunk := conn.recv(65536):
        reply += chunk
    whole = httpx.post(f"{served_at.url}/score", content=body,
                       headers={"content-type": "application/json"})
  head, _, answer = reply.partition(b"\r\n\r\n")
  assert head.startswith(b"HTTP/1.1 200"), reply[:300]
  assert json.loads(answer) == whole.json()
  assert whole.json()["scores"] == pytest.approx(np.asarray(request.cand_items) / 1000)


@pytest.mark.parametrize("drip", [False, True], ids=["idle", "one_byte_at_a_time"])
def test_a_connection_without_a_request_head_is_closed(drip):
  app = create_app(SlowScorer(0.0))
  with loopback.serving(app, http=guarded_http(0.4)) as served_at:
    host, port = served_at.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
      start = time.perf_counter()
      try:
        for byte in b"POST /score HTTP/1.1\r\n" if drip else b"":
          conn.sendall(bytes([byte]))
          time.sleep(0.05)
        closed = conn.recv(1) == b""
      except (ConnectionResetError, BrokenPipeError):
        closed = True
      took = time.perf_counter() - start
    with httpx.Client(base_url=served_at.url) as client:  # others are served meanwhile
      assert client.get("/health/live").status_code == 200
  assert closed and took < 3


def _raw_exchange(url: str, chunks, pause_s: float = 0.0) -> tuple[str, float]:
  """Sends `chunks` on one connection; the reply's first bytes ('' if reset) and the seconds."""
  host, port = url.removeprefix("http://").split(":")
  start = time.perf_counter()
  with socket.create_connection((host, int(port)), timeout=10) as conn:
    try:
      for chunk in chunks:
        conn.sendall(chunk)
        time.sleep(pause_s)
    except (ConnectionResetError, BrokenPipeError):
      pass
    try:
      reply = conn.recv(4096).decode()
    except ConnectionResetError:
      reply = ""
  return reply, time.perf_counter() - start




@pytest.mark.parametrize("attack", ["one_large_header", "a_header_that_never_ends",
                                    "too_many_headers"])
def test_a_request_head_over_its_limits_gets_431_and_others_are_served(attack):
  chunks = {
      "one_large_header": [HEAD + b"X-Big: " + b"a" * 40_000 + b"\r\n\r\n"],
      # 64 KiB at a time, 16 MiB in all: refused once 32 KiB of head arrived.
      "a_header_that_never_ends": [HEAD + b"X-Big: "] + [b"a" * 65536] * 256,
      "too_many_headers": [HEAD + b"".join(b"X-%d: 1\r\n" % i for i in range(150)) + b"\r\n"],
  }[attack]
  with loopback.serving(create_app(SlowScorer(0.0)), http=guarded_http(5.0)) as served_at:
    reply, took = _raw_exchange(served_at.url, chunks)
    with httpx.Client(base_url=served_at.url) as client:
      assert client.get("/health/live").status_code == 200
      request = some_requests(1)[0]
      headers = {f"X-Fine-{i}": "1" * 100 for i in range(50)}  # 50 fields, 5 KB: served
      assert client.post("/score", json=json_body(request), headers=headers).status_code == 200
  assert reply.startswith("HTTP/1.1 431") and took < 5, (reply[:200], took)


# Defect (issue 53): the head deadline was armed from the last request parsed, so a
# connection still answering requests it had parsed at once, pipelined, was closed at the
# deadline with most of them unanswered.
def test_pipelined_requests_are_all_answered_past_the_head_deadline():
  body = json.dumps(json_body(some_requests(1)[0])).encode()
  request = HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body
  count = 40  # at 0.02 s a batch, answering takes several head deadlines of 0.2 s
  app = create_app(SlowScorer(0.02))
  with loopback.serving(app, http=guarded_http(0.2)) as served_at:
    host, port = served_at.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
      conn.sendall(request * count)
      replies = b""
      while replies.count(b"HTTP/1.1 ") < count:
        chunk = conn.recv(65536)
        if not chunk:
          break
        replies += chunk
  assert replies.count(b"HTTP/1.1 200") == count, replies.count(b"HTTP/1.1 ")


# Defect (the first HTTP benchmark on the GPU host): a body that completed its request in
# one read of more than 32 KiB was counted as the next request's head, and the request was
# answered 431. A head is counted only from reads that begin in it and do not end it.
def test_a_large_body_in_one_read_is_not_taken_for_a_head():
  body = json.dumps(json_body(some_requests(1)[0])).encode() + b" " * 100_000
  request = HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body
  with loopback.serving(create_app(SlowScorer(0.0)), http=guarded_http(5.0)) as served_at:
    replies = [_raw_exchange(served_at.url, [request])[0] for _ in range(3)]
  assert all(r.startswith("HTTP/1.1 200") for r in replies), [r[:80] for r in replies]


def test_head_limits_are_checked():
  for bad in (dict(max_head_bytes=0), dict(max_headers=-1)):
    with pytest.raises(ValueError, match=next(iter(bad))):
      guarded_http(1.0, **bad)


def test_a_client_that_leaves_mid_body_is_counted_apart_from_server_errors(caplog):
  caplog.set_level(logging.INFO)
  with loopback.serving(create_app(SlowScorer(0.0)), log_config=None) as served_at:
    host, port = served_at.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
      conn.sendall(HEAD + b"Content-Length: 1000\r\n\r\n{\"user_dense\": [")
      time.sleep(0.2)
    with httpx.Client(base_url=served_at.url) as client:
      for _ in range(50):  # the server notices the close on its next read
        scrape = client.get("/metrics").text
        if 'ikbo_refused_total{reason="client_closed"} 1.0' in scrape:
          break
        time.sleep(0.05)
  assert 'ikbo_refused_total{reason="client_closed"} 1.0' in scrape
  assert 'status="500"' not in scrape
  assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_idle_connections_do_not_turn_requests_or_health_checks_away():
  """50 idle connections against a limit of 5: requests in progress are what it counts.

  Before, uvicorn counted every open connection, so the idle ones turned away real requests
  and `/health/live` with 503 until the head deadline closed them.
  """
  app = create_app(SlowScorer(0.0))
  with loopback.serving(app, http=guarded_http(30.0), limit_concurrency=5) as served_at:
    host, port = served_at.url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(50)]
    try:
      time.sleep(0.2)
      request = some_requests(1)[0]
      with httpx.Client(base_url=served_at.url, timeout=5) as client:
        start = time.perf_counter()
        assert client.get("/health/live").status_code == 200
        assert time.perf_counter() - start < 1
        assert client.post("/score", json=json_body(request)).status_code == 200
    finally:
      for conn in idle:
        conn.close()


def test_past_the_limit_of_requests_in_progress_scores_get_503_and_health_checks_pass():
  app = create_app(SlowScorer(1.0))
  with loopback.serving(app, http=guarded_http(30.0), limit_concurrency=3) as served_at:

    async def run():
      async with httpx.AsyncClient(base_url=served_at.url, timeout=30) as client:
        body = json_body(some_requests(1)[0])
        slow = [asyncio.create_task(client.post("/score", json=body)) for _ in range(3)]
        await asyncio.sleep(0.3)  # the three are in progress now
        refused = await client.post("/score", json=body)
        health = await client.get("/health/live")
        return refused.status_code, health.status_code, [(await t).status_code for t in slow]

    refused, health, slow = asyncio.run(run())
  assert (refused, health, slow) == (503, 200, [200, 200, 200])


def test_shutdown_answers_the_accept_queue_instead_of_resetting_it():
  """200 connections connect and send a request at once; the server is told to stop.

  Before, the listening socket closed at once and the kernel reset every connection still
  in its accept queue; now each gets an answer: 200 if it was served, 503 if it came late.
  """
  with loopback.serving(create_app(SlowScorer(0.0)), DrainingServer,
                        http=guarded_http(30.0)) as served_at:
    host, port = served_at.url.removeprefix("http://").split(":")
    body = json.dumps(json_body(some_requests(1)[0])).encode()
    head = HEAD + b"Content-Length: %d\r\n\r\n" % len(body)
    conns = [socket.create_connection((host, int(port)), timeout=10) for _ in range(200)]
    for conn in conns:
      conn.sendall(head + body)
    served_at.server.should_exit = True
    answers = collections.Counter()
    for conn in conns:
      try:
        reply = conn.recv(64)
        answers[reply[9:12].decode() if reply.startswith(b"HTTP/1.1") else "closed"] += 1
      except (ConnectionResetError, TimeoutError):
        answers["reset"] += 1
      finally:
        conn.close()
  assert set(answers) <= {"200", "503"} and sum(answers.values()) == 200, answers


def _start_bodies(served_at, count, source="127.0.0.1"):
  """`count` connections from `source` that each send a head and the first byte of a body."""
  host, port = served_at.url.removeprefix("http://").split(":")
  conns = [socket.create_connection((host, int(port)), timeout=10, source_address=(source, 0))
           for _ in range(count)]
  for conn in conns:
    conn.sendall(HEAD + b"Content-Length: 100000\r\n\r\n{")
  return conns


def _post_from(served_at, source):
  transport = httpx.HTTPTransport(local_address=source)
  with httpx.Client(base_url=served_at.url, transport=transport) as client:
    return client.post("/score", json=json_body(some_requests(1)[0]))


def test_bodies_that_trickle_are_cut_and_their_slots_come_back():
  """20 clients trickle bodies at the same time: each is cut (408) once its body falls
  below the minimum rate, and a real request is then served.

  Before, each held its slot for `body_timeout_s` (10 s), and real requests got 429."""
  limits = HttpLimits(max_active=20, min_body_rate=2000.0, body_grace_s=0.3)
  with loopback.serving(create_app(SlowScorer(0.0), limits=limits)) as served_at:
    start = time.perf_counter()
    replies = []
    for conn in _start_bodies(served_at, 20):
      with conn:
        replies.append(conn.recv(4096).decode())
    cut_after = time.perf_counter() - start
    assert _post_from(served_at, "127.0.0.1").status_code == 200
  assert all(r.startswith("HTTP/1.1 408") and "bytes/s" in r for r in replies), replies[0]
  assert cut_after < 3


def test_http_limits_are_checked():
  with pytest.raises(ValueError, match="HttpLimits.max_receiving_per_peer must be > 0, got 0"):
    HttpLimits(max_receiving_per_peer=0)


def test_bodies_still_arriving_hold_no_slot_of_the_requests_being_served():
  """40 bodies arriving slowly, twice `max_active`: a real request is served meanwhile.

  Before, a body being received held one of `max_active`'s slots: clients trickling bodies
  and reconnecting when cut kept every slot, and real requests got 429."""
  limits = HttpLimits(max_active=20, body_grace_s=5.0)
  with loopback.serving(create_app(SlowScorer(0.0), limits=limits)) as served_at:
    arriving = _start_bodies(served_at, 40)
    time.sleep(0.3)  # the server has read their heads
    assert _post_from(served_at, "127.0.0.1").status_code == 200
    for conn in arriving:
      conn.close()


def test_one_client_may_not_hold_most_of_the_bodies_being_received():
  """One address sending 12 bodies at once against a bound of 8 per client: the 4 past it
  get 429 at once; another address is served; once 10 bodies in all are arriving (the
  server's bound), another address gets 503."""
  limits = HttpLimits(max_receiving=10, max_receiving_per_peer=8, body_grace_s=5.0)
  with loopback.serving(create_app(SlowScorer(0.0), limits=limits)) as served_at:
    greedy = _start_bodies(served_at, 12)
    time.sleep(0.3)
    for conn in greedy:
      conn.settimeout(0.5)
    refused = []
    for conn in greedy:
      with contextlib.suppress(TimeoutError):
        refused.append(conn.recv(4096).decode())
    assert _post_from(served_at, "127.0.0.2").status_code == 200
    others = _start_bodies(served_at, 2, source="127.0.0.3")
    time.sleep(0.3)
    full = _post_from(served_at, "127.0.0.2")
    for conn in greedy + others:
      conn.close()
  assert len(refused) == 4, refused
  assert all(r.startswith("HTTP/1.1 429") and "already sending 8 bodies" in r for r in refused)
  assert full.status_code == 503 and "10 request bodies" in full.json()["error"], full.text


def test_the_renamed_body_reader_and_answer_class_still_work_with_a_warning():
  from ikbo_jax.serving import admission, http

  with pytest.warns(DeprecationWarning, match="use msgspec.json.encode"):
    response = http.FastJSON({"scores": [0.5]})
  assert json.loads(response.body) == {"scores": [0.5]}

  class OldRequest:  # what the old reader read: a Starlette request's receive and headers
    headers = {"content-length": "5"}

    @staticmethod
    async def receive():
      return {"type": "http.request", "body": b"12345", "more_body": False}

  with pytest.warns(DeprecationWarning, match="use admission.read_body"):
    body = asyncio.run(admission.receive_body(OldRequest(), 100, 1.0, 10.0, 1.0))
  assert body == b"12345"
