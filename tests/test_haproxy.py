"""Replicas behind HAProxy: the configuration, the user id it hashes, and a user's requests
meeting one replica (the last needs Debian's `haproxy` on PATH and is skipped without it)."""

import contextlib
import shutil
import subprocess
import tempfile
import time

import httpx
import numpy as np
import pytest

from ikbo_jax.serving import bodies, haproxy
from ikbo_jax.serving.http import create_app
from ikbo_jax.serving.stub import DeviceStub
from ikbo_jax.testing import loopback
from tests.serving_fakes import CONFIG, some_requests
from tests.test_host_stages import BUCKETS

HAPROXY = shutil.which("haproxy")


def test_a_user_id_is_its_user_side_whatever_the_dtypes_and_candidates():
  a, b = some_requests(2)
  as_lists = a.__class__(a.user_dense.astype(np.float64).tolist(), a.history.tolist(),
                         b.cand_items, b.cand_dense)
  assert haproxy.user_id(a) == haproxy.user_id(as_lists)  # what the cache keys on
  assert haproxy.user_id(a) != haproxy.user_id(b)
  assert len(haproxy.user_id(a)) == 16


def test_the_configuration_names_every_replica_and_hashes_the_user_header():
  cfg = haproxy.config([("127.0.0.1", 9001), ("10.0.0.2", 9002)], 9000)
  assert "server replica0 127.0.0.1:9001 check" in cfg
  assert "server replica1 10.0.0.2:9002 check" in cfg
  assert f"balance hdr({haproxy.USER_HEADER})" in cfg and "hash-type consistent" in cfg
  assert "option httpchk GET /health/ready" in cfg and "bind 127.0.0.1:9000" in cfg
  with pytest.raises(ValueError, match="backends"):
    haproxy.config([], 9000)


@pytest.mark.skipif(HAPROXY is None, reason="Debian's haproxy is not installed")
def test_haproxy_accepts_the_configuration():
  with tempfile.NamedTemporaryFile("w", suffix=".cfg") as f:
    f.write(haproxy.config([("127.0.0.1", 9001), ("127.0.0.1", 9002)], 9000))
    f.flush()
    check = subprocess.run([HAPROXY, "-c", "-f", f.name], capture_output=True, text=True)
  assert check.returncode == 0, check.stdout + check.stderr


def _answered(url: str) -> float:
  """How many POST /score requests a server answered 200 (its /metrics)."""
  text = httpx.get(f"{url}/metrics", timeout=10).text
  return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith("ikbo_http_request_seconds_count") and 'status="200"' in line)


@pytest.mark.skipif(HAPROXY is None, reason="Debian's haproxy is not installed")
def test_each_user_s_requests_meet_one_replica_behind_haproxy():
  requests = some_requests(6)
  with contextlib.ExitStack() as stack:
    replicas = [stack.enter_context(loopback.serving(create_app(
        DeviceStub(CONFIG, BUCKETS, (0.1, 0.2))))).url for _ in range(2)]
    port = loopback.free_port()
    cfg = stack.enter_context(tempfile.NamedTemporaryFile("w", suffix=".cfg"))
    cfg.write(haproxy.config([("127.0.0.1", int(u.rsplit(":", 1)[1])) for u in replicas], port))
    cfg.flush()
    proxy = subprocess.Popen([HAPROXY, "-db", "-f", cfg.name], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    stack.callback(proxy.wait, 10)
    stack.callback(proxy.terminate)
    url, deadline = f"http://127.0.0.1:{port}", time.time() + 20
    while time.time() < deadline:  # both replicas up in HAProxy's checks
      with contextlib.suppress(httpx.HTTPError):
        if httpx.get(f"{url}/health/ready", timeout=2).status_code == 200:
          break
      time.sleep(0.2)
    time.sleep(1.5)  # a second check round: both replicas marked up
    before = [_answered(u) for u in replicas]
    with httpx.Client(base_url=url, timeout=30) as client:
      for request in requests:  # each user five times
        headers = {"content-type": bodies.MSGPACK, haproxy.USER_HEADER: haproxy.user_id(request)}
        for _ in range(5):
          answer = client.post("/score", content=bodies.encode(request, bodies.MSGPACK),
                               headers=headers)
          assert answer.status_code == 200
          np.testing.assert_allclose(answer.json()["scores"], request.cand_items / 300,
                                     rtol=1e-6)
        counts = [_answered(u) - b for u, b in zip(replicas, before)]
        before = [_answered(u) for u in replicas]
        assert sorted(counts) == [0, 5], counts  # all five at one replica
