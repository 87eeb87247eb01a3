"""Open-loop load on a running server's `POST /score`, from several client processes.

One Python process with one event loop tops out well below a server's rate
(JSON and HTTP per request), and then measures itself. So the requests are
serialized once, dealt round robin to `processes` spawned clients, and each
client sends its share at `qps / processes` Poisson arrivals over up to
`connections` connections; their tallies merge into one set of percentiles.
With `cycle`, a bounded pool of requests stands for a longer trace: each
client sends its share over and over until `max_seconds` (a minute at ten
thousand requests a second is too many distinct bodies to hold).
Statuses other than 200 are counted by status, connection failures by type.
Bodies are JSON or msgpack (`serving.bodies`; msgpack costs the server less).
Where the server sends each answer's stages (`--server-timing`), the stats
hold their percentiles, with `outside`: the client's latency beyond their sum.
Given the scores each request should get (`expected`), every answer is checked
against them: one off by more than `score_tolerance`, or of another length, is
counted as a `wrong_score` instead of an answer. An `Endpoint` says how a request
is sent and its scores read back: `POST /score` by default; another server's API
(an existing serving engine measured on the same trace) is a subclass.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import time
from collections.abc import Mapping, Sequence

import msgspec
import numpy as np
import uvloop

from ikbo_jax.data import Request, RequestError
from ikbo_jax.serving import bodies, haproxy, http_wire, stages
from ikbo_jax.serving.load import Refused, Tally, drive, summarize

_ANSWER_TIMEOUT_S = 60.0


class Endpoint:
  """This library's `POST /score`: a request's body and headers, an answer's scores.

  Instances go to the client processes by pickling: a subclass lives at a module's top level.
  """

  path = "/score"

  def encode(self, request: Request, content_type: str) -> tuple[bytes, dict[str, str]]:
    return bodies.encode(request, content_type), {"content-type": content_type}

  def scores(self, answer: bytes, headers: Mapping[str, str]) -> np.ndarray:
    """The answer's scores; raises ValueError (or msgspec's errors) if it holds none."""
    return np.asarray(msgspec.json.decode(answer)["scores"], np.float32)


def over_http(url: str | Sequence[str], requests: Sequence[Request], *, qps: float,
              max_seconds: float = 60.0, processes: int = 1, connections: int = 256,
              cycle: bool = False,
              content_type: str = bodies.JSON, expected: Sequence[np.ndarray] | None = None,
              score_tolerance: float = 0.0, user_header: bool = False,
              endpoint: Endpoint = Endpoint()) -> dict:
  """Latency stats of `requests` sent to `url` at `qps`, from `processes` processes.

  `url` may be several servers' (replicas of one model): client `p` sends to
  `url[p % len(url)]`, so `processes` a multiple of their number splits the load
  evenly, as a round-robin balancer in front of them would.

  Each request goes once, or with `cycle` over and over until `max_seconds`, as
  bodies of `content_type` (`serving.bodies.CONTENT_TYPES`); with `expected`
  (each request's probabilities), answers further than `score_tolerance` from
  them count as `wrong_score`. With `user_header`, each request carries its user's
  `X-User-Id` (`serving.haproxy.user_id`), what a balancer in front of replicas hashes on.
  `endpoint` says where the requests go and how their scores come back.
  """
  if not (processes >= 1 and connections >= 1 and qps > 0 and len(requests) >= processes):
    raise ValueError(f"need processes >= 1, connections >= 1, qps > 0 and a request per "
                     f"process, got {processes}, {connections}, {qps}, {len(requests)} requests")
  urls = [url] if isinstance(url, str) else list(url)
  if not 1 <= len(urls) <= processes:
    raise ValueError(f"need between 1 and processes={processes} urls, got {len(urls)}")
  if expected is not None and len(expected) != len(requests):
    raise ValueError(f"expected holds {len(expected)} score arrays for {len(requests)} requests")
  payloads = []
  for i, r in enumerate(requests):
    body, headers = endpoint.encode(r, content_type)
    if user_header:
      headers[haproxy.USER_HEADER] = haproxy.user_id(r)
    payloads.append((body, None if expected is None else np.asarray(expected[i], np.float32),
                     headers))
  counts = [r.num_candidates for r in requests]
  arrivals = qps * max_seconds if cycle else 0
  shares = [(urls[p % len(urls)], *_share(payloads, counts, p, processes, arrivals),
             qps / processes, max_seconds, connections, p, score_tolerance, endpoint)
            for p in range(processes)]
  if processes == 1:
    return summarize([_client(*shares[0])], qps)
  # Spawned, not forked: the parent may hold jax's threads.
  context = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
    tallies = list(pool.map(_client, *zip(*shares)))
  return summarize(tallies, qps)


def _share(payloads: list, counts: list[int], p: int, processes: int,
           arrivals: float) -> tuple[list, list[int]]:
  """Client `p`'s bodies and candidate counts, repeated to outlast `arrivals` Poisson sends.

  The repeats are references to the same bytes: pickling them to the client is cheap.
  """
  mine, mine_counts = payloads[p::processes], counts[p::processes]
  expected = arrivals / processes
  # Ten standard deviations past the expected number of arrivals: never runs short.
  repeats = -(-int(expected + 10 * expected**0.5 + 1) // len(mine))
  return mine * max(repeats, 1), mine_counts * max(repeats, 1)


def _client(url: str, payloads: list, counts: list[int], qps: float, max_seconds: float,
            connections: int, seed: int, score_tolerance: float,
            endpoint: Endpoint = Endpoint()) -> Tally:
  """One client process: its share of the requests (`(body, expected scores or None,
  headers)`), open loop.

  Through `http_wire.WirePool` rather than aiohttp: on the host the server runs on, the
  client's CPU and its event loop's delays are part of what it measures
  (`benchmarks/load_client_cost.py`).
  """

  rows = []

  async def run() -> Tally:
    # Idle connections are dropped well before the server's keep-alive timeout
    # (5 s by default): one the server closes as a request goes out is a reset.
    pool = http_wire.WirePool.to(url, connections, idle_s=1.0)

    async def send(payload: tuple[bytes, np.ndarray | None, dict]):
      body, want, headers = payload
      start = time.perf_counter()
      async with asyncio.timeout(_ANSWER_TIMEOUT_S):  # a TimeoutError, counted by its name
        status, answer_headers, answer = await pool.request(endpoint.path, body, headers)
      client_ms = 1e3 * (time.perf_counter() - start)
      if status == 400:
        raise RequestError(answer.decode("utf-8", "replace"))
      if status != 200:
        raise Refused(str(status))
      if want is not None and not _matches(endpoint, answer, answer_headers, want,
                                           score_tolerance):
        raise Refused("wrong_score")
      timing = answer_headers.get("server-timing")
      if timing is not None:  # an answer's stages (a wrong score is no answer)
        rows.append(stages.answer_row(timing, client_ms))

    try:
      return await drive(send, payloads, qps=qps, candidates=counts, seed=seed,
                         max_seconds=max_seconds)
    finally:
      await pool.close()

  tally = uvloop.run(run())
  tally.stage_rows = rows
  return tally


def _matches(endpoint: Endpoint, answer: bytes, headers: Mapping[str, str], want: np.ndarray,
             tolerance: float) -> bool:
  """Whether a 200 answer's scores are `want`'s, each within `tolerance`."""
  try:
    got = endpoint.scores(answer, headers)
  except (msgspec.DecodeError, KeyError, TypeError, ValueError):
    return False
  return got.shape == want.shape and bool(np.all(np.abs(got - want) <= tolerance))
