"""A server of several processes: the model process's protocol, and the whole server's faults.

The protocol runs in one event loop with the fake scorer (seconds); the whole server
(`--http-processes 2`, the small preset on the CPU) is started once and taken through
requests checked against the model, a killed HTTP process, a killed model process and
SIGTERM.
"""

import asyncio
import concurrent.futures
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from unittest import mock

import httpx
import numpy as np
import pytest

from ikbo_jax.data import Request, RequestError
from ikbo_jax.serving import bodies, frames
from ikbo_jax.serving.batcher import BatchingConfig, DeadlineExceeded, Overloaded
from ikbo_jax.serving.http import create_app
from ikbo_jax.serving.model_server import ModelServer
from ikbo_jax.serving.remote import ModelUnavailable, RemoteBatcher
from ikbo_jax.testing.loopback import free_port
from tests.serving_fakes import CONFIG, SlowScorer, some_requests


async def _with_model_server(build, config, body):
  """Runs `body(remote)` against a model server of `build()` on a fresh socket."""
  path = frames.private_socket_path()
  server = ModelServer(path, build, config)
  serving = asyncio.create_task(server.serve())
  try:
    async with RemoteBatcher(path, config) as remote:
      return await body(remote, server, path)
  finally:
    server.stop()
    await serving


@pytest.mark.parametrize("as_lists", [False, True])
def test_a_request_and_its_scores_cross_the_socket_unchanged(as_lists):
  request = some_requests(1)[0]
  if as_lists:  # a JSON body's fields before validation
    request = Request(**{f: getattr(request, f).tolist() for f in bodies.FIELDS})
  frame = frames.encode(("score", 7, request, 12.5, True))
  kind, request_id, got, deadline, timed = frames.decode(frame[4:])
  assert (kind, request_id, deadline, timed) == ("score", 7, 12.5, True)
  for field in dataclasses.fields(Request):
    want = getattr(request, field.name)
    if want is None:
      assert getattr(got, field.name) is None
    else:
      np.testing.assert_array_equal(getattr(got, field.name), np.asarray(want), strict=True)
  scores = np.array([0.25, np.nan, 1.0], np.float32)
  kind, request_id, back, marks = frames.decode(frames.encode(("scores", 3, scores, None))[4:])
  np.testing.assert_array_equal(back, scores, strict=True)
  assert marks is None
  marks = [("send", 1.5), ("queue", 2.25)]
  assert frames.decode(frames.encode(("scores", 3, scores, marks))[4:])[3] == marks
  assert frames.decode(frames.encode(("queue", 1.5, 2, 3, None))[4:]) == ("queue", 1.5, 2, 3,
                                                                           None)
  with pytest.raises(frames.FrameError, match="codec"):
    frames.decode(b"X" + frame[5:])


def test_a_stream_cut_anywhere_reads_back_whole_and_a_broken_one_is_a_frame_error():
  messages = [("queue", 0.5, 1, 2, None), ("cache", 3, "x" * 70_000), ("queue", 1.0, 0, 0, None)]
  stream = b"".join(map(frames.encode, messages))
  for piece in (1, 3, 4, 5, 4096, len(stream)):
    parser = frames.FrameParser()
    got = [m for at in range(0, len(stream), piece) for m in parser.feed(stream[at:at + piece])]
    assert got == messages and not parser.inside_a_frame, piece
  with pytest.raises(frames.FrameError, match="past the bound"):
    frames.FrameParser().feed(b"\xff\xff\xff\xff")

  def close(data: bytes):
    seen, endings = [], []
    protocol = frames.FrameProtocol(seen.append, endings.append)
    protocol.connection_made(mock.Mock())
    protocol.data_received(data)
    protocol.eof_received()
    protocol.connection_lost(None)
    return seen, endings

  assert close(stream) == (messages, [None])
  for broken, says in ((stream[:2], "inside a frame"), (stream[:-1], "inside a frame"),
                       (b"\xff\xff\xff\xff", "past the bound")):
    seen, (error,) = close(broken)
    assert isinstance(error, frames.FrameError) and says in str(error), (broken[:8], error)


def test_a_frame_read_past_its_deadline_is_refused_and_never_computed():
  # The deadline crosses the hop as a time of the host's one monotonic clock: a frame that
  # waited in the socket for a model process at its limit is not computed late.
  model = SlowScorer(0.0)

  async def body(remote, server, path):
    await remote.ready()
    request = some_requests(1)[0]
    with pytest.raises(DeadlineExceeded, match="before the model process read it"):
      await remote._ask("score", request, time.perf_counter() - 0.001, False, wait_s=1.0)
    np.testing.assert_array_equal(await remote.score(request), request.cand_items / 1000)
    assert len(model.seen) == 1

  asyncio.run(_with_model_server(lambda: model, BatchingConfig(), body))


def test_the_model_process_answers_as_its_batcher_does():
  config = BatchingConfig(max_queued_candidates=40, default_timeout_ms=2000)
  requests = some_requests(12)

  async def body(remote, server, path):
    description = await remote.ready()
    assert description.config == CONFIG and not description.has_cache
    scores = await asyncio.gather(*(remote.score(r) for r in requests[:3]))
    for got, r in zip(scores, requests):
      np.testing.assert_array_equal(got, r.cand_items / 1000)
    bad = requests[0].__class__(**{**requests[0].__dict__,
                                   "cand_items": requests[0].cand_items + 10_000})
    with pytest.raises(RequestError, match="cand_items"):
      await remote.score(bad)
    outcomes = await asyncio.gather(*(remote.score(r) for r in requests * 4),
                                    return_exceptions=True)
    assert any(isinstance(o, Overloaded) for o in outcomes)  # 48 requests, 40 candidates queued
    assert all(isinstance(o, (np.ndarray, Overloaded)) for o in outcomes)
    # Two batches hold the model's two slots for 200 ms; requests of 5 ms wait behind them.
    blockers = []
    for r in requests[:2]:  # one batch each
      blockers.append(asyncio.create_task(remote.score(r)))
      await asyncio.sleep(0.008)
    outcomes = await asyncio.gather(*(remote.score(r, timeout_ms=5) for r in requests[2:5]),
                                    return_exceptions=True)
    assert all(isinstance(o, DeadlineExceeded) for o in outcomes), outcomes
    await asyncio.gather(*blockers)

  asyncio.run(_with_model_server(lambda: SlowScorer(0.2), config, body))


def test_without_the_model_process_requests_are_unavailable_until_another_starts():
  config = BatchingConfig()
  request = some_requests(1)[0]

  async def body(remote, server, path):
    await remote.ready()
    server.stop()
    await asyncio.sleep(0.2)
    with pytest.raises(ModelUnavailable, match="retry"):
      await remote.score(request)
    replacement = ModelServer(path, SlowScorer, config)
    serving = asyncio.create_task(replacement.serve())
    try:
      for _ in range(100):
        await asyncio.sleep(0.05)
        try:
          return await remote.score(request)
        except ModelUnavailable:
          continue
      raise AssertionError("the batcher did not connect to the new model process")
    finally:
      replacement.stop()
      await serving

  scores = asyncio.run(_with_model_server(SlowScorer, config, body))
  np.testing.assert_array_equal(scores, request.cand_items / 1000)


def test_a_model_that_cannot_be_built_is_reported_with_its_reason():
  def build():
    raise ValueError("the parameters are broken")

  async def body(remote, server, path):
    with pytest.raises(RuntimeError, match="ValueError: the parameters are broken"):
      await remote.ready()

  asyncio.run(_with_model_server(build, BatchingConfig(), body))


def test_an_app_takes_a_model_or_a_model_process():
  with pytest.raises(ValueError, match="model_process"):
    create_app(None)
  with pytest.raises(ValueError, match="not both"):
    create_app(SlowScorer(), model_process="/tmp/x.sock")


def _post(url, request):
  """`POST /score` of `request` on a fresh connection: (status, scores or None)."""
  http = urllib.request.Request(f"{url}/score", data=bodies.encode(request),
                                headers={"Content-Type": bodies.JSON})
  try:
    with urllib.request.urlopen(http, timeout=60) as response:
      return response.status, np.asarray(json.loads(response.read())["scores"])
  except urllib.error.HTTPError as e:
    return e.code, None


def _scrape_count(url) -> float:
  with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
    text = response.read().decode()
  return sum(float(m) for m in re.findall(
      r'^ikbo_http_request_seconds_count\{route="/score",status="200"\} (\S+)$', text, re.M))


def _wait_for(condition, seconds, what, log):
  deadline = time.time() + seconds
  while time.time() < deadline:
    if condition():
      return
    time.sleep(0.1)
  log.seek(0)
  raise AssertionError(f"{what} within {seconds} s; the server's log ends:\n"
                       f"{log.read()[-3000:].decode(errors='replace')}")


def _ready(url) -> bool:
  try:
    with urllib.request.urlopen(f"{url}/health/ready", timeout=2) as response:
      return response.status == 200
  except (urllib.error.URLError, ConnectionError, TimeoutError):
    return False


def test_a_server_of_several_processes_through_its_faults():
  from benchmarks.serving_load import reference_scores
  from ikbo_jax.data.synthetic import ClickGenerator
  from ikbo_jax.models.config import PRESETS

  config = PRESETS["small"]()
  requests = ClickGenerator(config, seed=5).requests(32)
  expected = reference_scores(config, requests)
  port = free_port()
  url = f"http://127.0.0.1:{port}"
  log = tempfile.TemporaryFile()
  server = subprocess.Popen(
      [sys.executable, "-m", "ikbo_jax.serving", "--preset", "small", "--port", str(port),
       "--http-processes", "2", "--drain-seconds", "5", "--cache-mb", "16"],
      stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  pool = concurrent.futures.ThreadPoolExecutor(8)
  try:
    _wait_for(lambda: _ready(url), 300, "the server was not ready", log)
    log.seek(0)
    started = re.search(rb"HTTP processes \[(\d+), (\d+)\], model process (\d+)", log.read())
    http_pids, model_pid = [int(p) for p in started.groups()[:2]], int(started.group(3))

    # Answers checked against the model, from both HTTP processes' share of 32 connections,
    # twice: the second time every user's state comes from the one cache.
    for _ in range(2):
      answers = list(pool.map(lambda r: _post(url, r), requests))
      assert [status for status, _ in answers] == [200] * len(requests)
      for (_, got), want in zip(answers, expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    cache = httpx.get(f"{url}/cache", timeout=10).json()
    assert cache["hits"] >= len(requests) and cache["entries"] > 0, cache
    flushed = httpx.post(f"{url}/cache/flush", json={}, timeout=10).json()
    assert flushed["entries"] == 0, flushed
    assert _scrape_count(url) == 2 * len(requests)  # every process's count, from either one
    assert re.search(rb"^ikbo_cache_hits_total [1-9]", httpx.get(f"{url}/metrics").content,
                     re.M)

    # A killed HTTP process: the other answers meanwhile, and another takes its place.
    os.kill(http_pids[0], signal.SIGKILL)
    assert [_post(url, r)[0] for r in requests[:8]] == [200] * 8
    _wait_for(lambda: b"the http process" in (log.seek(0) or log.read()), 30,
              "the killed HTTP process was not replaced", log)
    assert _scrape_count(url) == 2 * len(requests) + 8  # the dead process's count is kept

    # A killed model process: 503 (retry) until another has compiled, then answers again.
    os.kill(model_pid, signal.SIGKILL)
    time.sleep(0.5)
    status, _ = _post(url, requests[0])
    assert status == 503
    _wait_for(lambda: _post(url, requests[0])[0] == 200, 300,
              "no answer from a replaced model process", log)
    status, got = _post(url, requests[1])
    assert status == 200
    np.testing.assert_allclose(got, expected[1], rtol=1e-4, atol=1e-5)

    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=60) == 0
  finally:
    pool.shutdown()
    if server.poll() is None:
      server.kill()
      server.wait()


def test_a_checkpoint_that_cannot_be_served_stops_the_whole_server(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "ikbo_jax.serving", "--preset", "small", "--port",
       str(free_port()), "--http-processes", "2", "--checkpoint-dir", str(tmp_path / "none")],
      capture_output=True, text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode == 1, result.stderr[-2000:]
  assert f"cannot serve {tmp_path / 'none'}" in result.stderr
  assert "cannot serve this command line" in result.stderr


def test_a_killed_supervisor_leaves_no_process_behind():
  port = free_port()
  log = tempfile.TemporaryFile()
  server = subprocess.Popen(
      [sys.executable, "-m", "ikbo_jax.serving", "--preset", "small", "--port", str(port),
       "--http-processes", "2", "--drain-seconds", "2"],
      stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  try:
    _wait_for(lambda: b"model process" in (log.seek(0) or log.read()), 120,
              "the server did not start its processes", log)
    log.seek(0)
    pids = [int(p) for p in re.search(rb"HTTP processes \[(\d+), (\d+)\], model process (\d+)",
                                      log.read()).groups()]
    server.kill()
    server.wait()

    def gone(pid):
      try:
        os.kill(pid, 0)
      except ProcessLookupError:
        return True
      with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited
        return stat.read().split(")")[-1].split()[0] == "Z"

    _wait_for(lambda: all(gone(p) for p in pids), 60, "children outlived the supervisor", log)
  finally:
    if server.poll() is None:
      server.kill()
