"""The host path's profile: stage clocks, the device stub, staged calls, Server-Timing."""

import asyncio
import gc
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from flax import nnx

from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.models import Ranker, RankerConfig
from ikbo_jax.serving import Batcher, BatchingConfig, Bucket, BucketedModel, bodies
from ikbo_jax.serving.http import create_app
from ikbo_jax.serving.stages import (StageClock, answer_row, marker, parse_server_timing,
                                     summarize)
from ikbo_jax.serving.stub import DeviceStub
from ikbo_jax.testing import loopback
from tests.serving_fakes import CONFIG, some_requests
from tests.test_serving_processes import _with_model_server

BUCKETS = (Bucket(32, 4, 16), Bucket(64, 8, 16))
IN_PROCESS = ("validate", "queue", "thread", "pack", "launch", "d2h", "answer")


def test_a_clock_adds_up_its_stages_and_survives_a_server_timing_header():
  clock = StageClock(10.0)
  clock.extend([("queue", 10.002), ("pack", 10.0025), ("queue", 10.0035)])
  ms = clock.durations_ms()
  assert list(ms) == ["queue", "pack"]  # a stage marked twice adds up, in first order
  assert ms["queue"] == pytest.approx(3.0) and ms["pack"] == pytest.approx(0.5)
  assert parse_server_timing(clock.server_timing()) == pytest.approx(ms, abs=1e-3)
  assert parse_server_timing('db;dur=x, cache;desc="hit", miss;dur=2.5') == {"miss": 2.5}
  assert answer_row("queue;dur=1.5, pack;dur=0.5", 3.0) == {"queue": 1.5, "pack": 0.5,
                                                            "outside": 1.0}
  marks = []
  marker(marks)("pack")
  marker(None)("pack")  # nobody profiles: nothing to mark
  assert [stage for stage, _ in marks] == ["pack"]


def test_a_summary_counts_a_missing_stage_as_zero_so_means_add_up():
  rows = [{"queue": 1.0, "pack": 2.0}, {"pack": 4.0}]
  summary = summarize(rows)
  assert list(summary) == ["queue", "pack", "total"]  # STAGES order, then the total
  assert summary["queue"]["mean"] == 0.5 and summary["pack"]["p50"] == 3.0
  assert summary["total"]["mean"] == pytest.approx(summary["queue"]["mean"]
                                                   + summary["pack"]["mean"])


def test_the_stub_device_runs_one_batch_at_a_time_for_its_bucket_time():
  stub = DeviceStub(CONFIG, BUCKETS, (4.0, 8.0))
  assert stub.device_ms == {BUCKETS[0]: 4.0, BUCKETS[1]: 8.0}
  requests = [r.validated(CONFIG) for r in some_requests(2)]
  np.testing.assert_array_equal(stub(requests[:1])[0],
                                (requests[0].cand_items / 300).astype(np.float32))
  out = [None, None]

  def call(i):
    out[i] = stub(requests[i:i + 1])

  start = time.perf_counter()
  threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  # Two one-request batches launched together queue on the one device: 4 ms after 4 ms.
  assert time.perf_counter() - start >= 0.008
  assert [o[0].shape for o in out] == [(r.num_candidates,) for r in requests]
  with pytest.raises(ValueError, match="device_ms"):
    DeviceStub(CONFIG, BUCKETS, (2.0, 1.0))


def test_a_clocked_request_gets_every_stage_of_the_batcher_in_order():
  stub = DeviceStub(CONFIG, BUCKETS, (1.0, 2.0))
  requests = some_requests(4)

  async def run():
    async with Batcher(stub, BatchingConfig()) as batcher:
      clocks = [StageClock() for _ in requests]
      scores = await asyncio.gather(*(batcher.score(r, clock=c)
                                      for r, c in zip(requests, clocks)))
      plain = await batcher.score(requests[0])  # no clock: the same answer
    return clocks, scores, plain

  clocks, scores, plain = asyncio.run(run())
  np.testing.assert_array_equal(plain, scores[0])
  for clock in clocks:
    assert [stage for stage, _ in clock.marks[1:]] == list(IN_PROCESS)
    assert all(b >= a for (_, a), (_, b) in zip(clock.marks, clock.marks[1:]))
    assert clock.durations_ms()["d2h"] >= 0.9  # the stub's device time is in the wait


def test_a_staged_call_gives_the_plain_call_s_scores_and_marks_its_stages():
  config = RankerConfig(num_items=300, max_history=16)
  served = BucketedModel(Ranker(config, rngs=nnx.Rngs(0)), [Bucket(64, 8, 16)])
  requests = [r.validated(config) for r in ClickGenerator(config, seed=1).requests(5)]
  plain = served(requests)
  for waited, stages in ((False, ["pack", "launch", "d2h"]),
                         (True, ["pack", "h2d", "execute", "d2h"])):
    marks = []
    for a, b in zip(plain, served.staged(requests, marks, waited)):
      np.testing.assert_array_equal(a, b)
    assert [stage for stage, _ in marks] == stages
  assert set(served.call_breakdown(requests)) == {"pack", "transfer", "execute", "fetch"}


def test_server_timing_tells_each_answer_its_stages_in_one_process_and_across_two():
  requests = some_requests(3)
  body = bodies.encode(requests[0], bodies.MSGPACK)
  headers = {"content-type": bodies.MSGPACK}
  stub = DeviceStub(CONFIG, BUCKETS, (1.0, 2.0))
  with loopback.serving(create_app(stub, server_timing=True)) as served_at:
    answer = httpx.post(f"{served_at.url}/score", content=body, headers=headers, timeout=30)
  stages = parse_server_timing(answer.headers["server-timing"])
  assert list(stages) == ["body", "decode", *IN_PROCESS, "encode"]
  with loopback.serving(create_app(stub)) as served_at:  # off by default
    assert "server-timing" not in httpx.post(f"{served_at.url}/score", content=body,
                                             headers=headers, timeout=30).headers

  async def remote_body(remote, server, path):
    await remote.ready()
    clock = StageClock()
    await remote.score(requests[1], clock=clock)
    return [stage for stage, _ in clock.marks[1:]]

  marks = asyncio.run(_with_model_server(lambda: stub, BatchingConfig(), remote_body))
  assert marks == ["validate", "send", *IN_PROCESS, "reply"]  # checked before it is sent


def test_a_serving_process_freezes_its_startup_heap_and_collects_young_less_often():
  from ikbo_jax.serving.launch import tune_gc

  threshold = gc.get_threshold()
  try:
    tune_gc()
    assert gc.get_freeze_count() > 0 and gc.get_threshold()[0] > threshold[0]
  finally:
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_the_in_process_profile_runs_on_the_stub(tmp_path):
  out = tmp_path / "stages.json"
  subprocess.run([sys.executable, "-m", "benchmarks.host_stages", "--stub", "0.2", "1.0",
                  "--preset", "small", "--mean-candidates", "8", "--rates", "200",
                  "--seconds", "0.5", "--lone", "20", "--iterations", "3", "--out", str(out)],
                 check=True, cwd=loopback.__file__.rsplit("/ikbo_jax/", 1)[0])
  import json

  stub = json.loads(out.read_text())["models"]["stub"]
  assert set(stub["call"]) == {"one_request_plain", "one_request_waited", "full_batch_plain",
                               "full_batch_waited"}
  assert "queue" in stub["lone"]["stages"] and stub["load"][0]["answered"] > 0


def test_the_http_profile_runs_on_the_stub_across_processes(tmp_path):
  out = tmp_path / "front.json"
  subprocess.run([sys.executable, "-m", "benchmarks.http_front", "--small", "--stub", "0.2",
                  "1.0", "--server-timing", "--out", str(out)], check=True,
                 cwd=loopback.__file__.rsplit("/ikbo_jax/", 1)[0])
  import json

  runs = json.loads(out.read_text())["runs"]
  for n, extra in (("1", []), ("2", ["send", "reply"])):  # one process; the model process
    first = runs[n]["ladder"][0]
    assert first["answered"] > 0 and not first["errors_by_kind"], first["errors_by_kind"]
    assert {"body", "decode", "queue", "d2h", "encode", "outside", *extra} <= set(
        first["stages"])
    assert first["server_cpu_ms_per_request"] > 0
