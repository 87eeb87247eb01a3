"""The HTTP endpoint (Starlette): `POST /score` takes one request, returns its scores.

    {"user_dense": [...], "history": [...], "cand_items": [...], "cand_dense": [[...], ...]}
    (JSON, or msgpack with each field a typed array of raw bytes: `serving.bodies`)
    -> 200 {"scores": [...]}   click probabilities, in candidate order
    -> 400 {"error": "..."}    this request is malformed (names the field and the values),
                               or a dense feature is past the model's valid range
    -> 408                     its body did not arrive within `HttpLimits.body_timeout_s`,
                               or kept arriving slower than `HttpLimits.min_body_rate`
    -> 413                     its body or its candidate count is over the limit
    -> 415                     its content type is neither application/json nor msgpack
    -> 422                     it is well formed but its scores are not finite (inputs overflow)
    -> 429 + Retry-After       the queue is at its bound: refused before it was queued; or
                               this client is sending too many bodies at once
    -> 503 + Retry-After       its deadline passed while it was read or queued (never
                               computed), or the queue's expected wait is past it (not
                               read), the server is still compiling, or receiving
                               `HttpLimits.max_receiving` bodies
    (499, nginx's "client closed request", in the metrics only: the client left before its
    body arrived; nothing is sent, and it is counted apart from the server's errors)

A request's deadline is the `X-Timeout-Ms` header or the batcher's default, counted from
when its handler starts (a CPU-bound server's wait is in reading and decoding bodies).
`GET /health/live` answers while the process runs, `GET /health/ready` only once
every bucket is compiled; `GET /health` reports the build, the buckets and the
request fields the loaded model takes; `GET /metrics` is Prometheus' (`metrics`);
`GET /openapi.json` describes `POST /score` (Starlette's schema generator reads
it from the handler's docstring); with a user-state cache (`CachedModel`),
`GET /cache` reports its size and use and `POST /cache/flush` empties it.
Nothing a client sends reaches the log as a traceback: every failure is one of
the statuses above, and an unexpected one is a 500 logged in one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable

import msgspec
import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.schemas import SchemaGenerator

from ikbo_jax import __version__
from ikbo_jax.data import RequestError
from ikbo_jax.serving import bodies
from ikbo_jax.serving.admission import Admission, Refusal, receive_body
from ikbo_jax.serving.batcher import Batcher, BatchingConfig, DeadlineExceeded, Overloaded
from ikbo_jax.serving.cached import CachedModel
from ikbo_jax.serving.metrics import ServingMetrics
from ikbo_jax.serving.remote import ModelUnavailable, RemoteBatcher
from ikbo_jax.serving.scorer import Scorer
from ikbo_jax.serving.stages import ARRIVED, StageClock

_LOG = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class HttpLimits:
  """What one request may be. Attributes:
    max_body_bytes: the largest body read (413 beyond).
    max_candidates: the most candidates in one request (413 beyond).
    body_timeout_s: how long the body may take to arrive (408 beyond).
    min_body_rate: bytes per second a body must keep arriving at, after its first
      `body_grace_s` (408 below): a client that trickles its body holds a slot of
      `max_active` for seconds at most, not for `body_timeout_s`.
    max_timeout_ms: the longest deadline `X-Timeout-Ms` may ask for (400 beyond): a
      request that may wait for ever holds its slot and memory for ever.
    retry_after_s: the `Retry-After` of a 429 or 503.
    max_active: `POST /score` requests whose body arrived, being decoded or scored
      at once; one more is answered 429 (before its body is read, if it is full
      then). The batcher's bounds hold what waits for the model; this one holds
      what waits for the host (JSON, the event loop), which is where an
      overloaded CPU-bound server queues.
    max_receiving: request bodies being received at once (503 beyond); with
      `max_body_bytes`, the memory that bodies in flight may hold.
    max_receiving_per_peer: bodies one client address may be sending at once (429
      beyond): a client trickling bodies on many connections cannot crowd out
      the others (`serving.admission`; behind a proxy, set it to `max_receiving`).
  """

  max_body_bytes: int = 8 << 20
  max_candidates: int = 8192
  body_timeout_s: float = 10.0
  min_body_rate: float = 64 * 1024
  body_grace_s: float = 1.0
  max_timeout_ms: float = 60_000.0
  retry_after_s: int = 1
  max_active: int = 256
  max_receiving: int = 1024
  max_receiving_per_peer: int = 128

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if not getattr(self, field.name) > 0:
        raise ValueError(f"HttpLimits.{field.name} must be > 0, got "
                         f"{getattr(self, field.name)!r}")


def create_app(model: Scorer | Callable[[], Scorer] | None,
               batching: BatchingConfig = BatchingConfig(), limits: HttpLimits = HttpLimits(),
               *, model_process: str | None = None, server_timing: bool = False) -> Starlette:
  """An ASGI app serving `model` (run it with uvicorn, or `python -m ikbo_jax.serving`).

  `model` may be a function that builds (compiles) the model: it then runs on a
  thread after the server starts, and the server answers 503 and reports not
  ready until it is done. If it fails (a smoke batch with non-finite scores,
  say), the server never becomes ready and `/health/live` fails too, with the
  reason, so that an orchestrator restarts it rather than waiting.

  With `model_process` (the Unix socket of a `serving.model_server`), `model` is
  None: this app is one of several HTTP processes (`serving.processes`) and the
  model, its batcher and cache live in that process; the app is ready once it
  is connected to that process and that process's model is built.

  With `server_timing`, every answer of `POST /score` carries its stages
  (`serving.stages`) in a `Server-Timing` header.
  """
  if (model is None) == (model_process is None):
    raise ValueError(f"give a model or a model_process, not both or neither: got model="
                     f"{model!r}, model_process={model_process!r}")
  metrics = ServingMetrics()

  @contextlib.asynccontextmanager
  async def lifespan(app: Starlette):
    app.state.batcher = app.state.model = app.state.failed = app.state.cache = None
    async with contextlib.AsyncExitStack() as stack:
      async def start():
        if model_process is not None:
          batcher = await stack.enter_async_context(RemoteBatcher(model_process, batching))
          served = await batcher.ready()
          if served.has_cache:
            metrics.watch_cache(lambda: batcher.cache_report)
            app.state.cache = batcher.cache
        else:
          served = model if isinstance(model, Scorer) else await asyncio.to_thread(model)
          batcher = await stack.enter_async_context(
              Batcher(served, batching, on_batch=metrics.observe_batch))
          if isinstance(served, CachedModel):
            metrics.watch_cache(served.report)
            app.state.cache = functools.partial(_local_cache, served)
        metrics.watch_queue(lambda: batcher.queued_requests, lambda: batcher.queued_candidates)
        app.state.model, app.state.batcher = served, batcher

      async def start_or_fail():
        try:
          await start()
        except Exception as e:  # the reason goes to the log and the probes, in one line
          app.state.failed = f"{type(e).__name__}: {e}"
          _LOG.error("the model could not be started: %s", app.state.failed)

      if isinstance(model, Scorer):
        await start()
        yield
      else:
        starting = asyncio.create_task(start_or_fail())
        yield
        starting.cancel()

  app = Starlette(routes=_ROUTES, lifespan=lifespan)
  app.state.metrics, app.state.limits = metrics, limits
  app.state.server_timing = server_timing
  app.state.admission = Admission(limits.max_active, limits.max_receiving,
                                  limits.max_receiving_per_peer)
  return app


class FastJSON(JSONResponse):
  """`POST /score`'s answers and refusals, encoded by msgspec (C) rather than `json.dumps`:
  on an HTTP process at its limit, encoding the scores was ~12% of a request's time (an
  answer of 70 scores: 39 us with `JSONResponse`, 5.7 with this; `http_server_cost.py`).
  Scores are finite here (a request with any that is not is refused 422 first)."""

  def render(self, content) -> bytes:
    return msgspec.json.encode(content)


async def _score_route(http_request: HttpRequest) -> Response:
  """Scores one request's candidates (the OpenAPI operation below, served at /openapi.json).
  ---
  summary: Click probabilities of one user's candidates, in candidate order.
  parameters:
    - {name: X-Timeout-Ms, in: header, required: false, schema: {type: number},
       description: the request's deadline in milliseconds (default the server's)}
  requestBody:
    required: true
    content:
      application/json:
        schema:
          type: object
          required: [user_dense, history, cand_items, cand_dense]
          additionalProperties: false
          properties:
            user_dense: {type: array, items: {type: number},
                         description: the user's profile features (GET /health gives how many)}
            history: {type: array, items: {type: integer, minimum: 0},
                      description: item ids of the behaviour history, most recent last}
            cand_items: {type: array, minItems: 1, items: {type: integer, minimum: 0},
                         description: the candidates' item ids}
            cand_dense: {type: array, items: {type: array, items: {type: number}},
                         description: per candidate, its statistics}
      application/msgpack:
        schema:
          type: object
          required: [user_dense, history, cand_items, cand_dense]
          additionalProperties: false
          description: >-
            the same fields, each a typed array {dtype, shape, data}: dtype in NumPy's
            array-interface form with its byte order, data a msgpack bin of the bytes
          properties:
            user_dense: {type: object, description: "dtype '<f4', shape [user_dense]"}
            history: {type: object, description: "dtype '<i4', shape [L]"}
            cand_items: {type: object, description: "dtype '<i4', shape [n]"}
            cand_dense: {type: object, description: "dtype '<f4', shape [n, cand_dense], row-major"}
  responses:
    200: {description: "{scores: [...]}, one probability per candidate"}
    400: {description: malformed (the error names the field)}
    408: {description: the body did not arrive in time}
    413: {description: body or candidate count over the limit}
    415: {description: the content type is neither application/json nor application/msgpack}
    422: {description: the scores are not finite (inputs overflow the model)}
    429: {description: "the queue is full; see Retry-After"}
    503: {description: "the deadline passed while read or queued, or not ready; see Retry-After"}
  """
  state = http_request.app.state
  limits, metrics = state.limits, state.metrics
  # The deadline counts from the request's first bytes read, where the protocol saw them.
  arrived = http_request.scope.get(ARRIVED)
  start = arrived or time.perf_counter()
  clock = StageClock(start) if state.server_timing else None
  if clock is not None and arrived is not None:
    clock.mark("head")
  try:
    response = FastJSON({"scores": await _score(http_request, limits, start, clock)})
    if clock is not None:
      clock.mark("encode")
      response.headers["Server-Timing"] = clock.server_timing()
  except Refusal as refusal:
    if refusal.status in (429, 499, 503):
      reason = refusal.reason or {429: "overloaded", 499: "client_closed"}.get(
          refusal.status, "deadline" if state.batcher else "not_ready")
      metrics.refused.labels(reason).inc()
    headers = {"Retry-After": str(limits.retry_after_s)} if refusal.retry else None
    response = FastJSON({"error": str(refusal)}, status_code=refusal.status, headers=headers)
  except Exception as e:  # a defect of ours: one line in the log, no traceback
    _LOG.error("POST /score failed: %s: %s", type(e).__name__, e)
    response = JSONResponse({"error": f"internal error ({type(e).__name__})"}, status_code=500)
  metrics.request_seconds.labels("/score", str(response.status_code)).observe(
      time.perf_counter() - start)
  return response


def _health(http_request: HttpRequest) -> JSONResponse:
  state = http_request.app.state
  if state.model is None:
    return JSONResponse({"status": "failed", "error": state.failed} if state.failed else
                        {"status": "starting"}, status_code=503)
  return JSONResponse({"status": "ok", "build": state.model.build,
                       "buckets": [dataclasses.asdict(b) for b in state.model.buckets],
                       "request": _request_schema(state.model, state.limits)})


def _live(http_request: HttpRequest) -> JSONResponse:
  failed = http_request.app.state.failed
  if failed:
    return JSONResponse({"status": "failed", "error": failed}, status_code=503)
  return JSONResponse({"status": "alive"})


def _ready(http_request: HttpRequest) -> JSONResponse:
  is_ready = http_request.app.state.batcher is not None
  return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 503)


async def _local_cache(model: CachedModel, action: str) -> dict:
  """`RemoteBatcher.cache` for a cache in this process: its report, after a flush if asked."""
  if action == "flush":
    await asyncio.to_thread(model.flush)
  return model.report()


async def _cache_report(http_request: HttpRequest, flush: bool) -> dict:
  state = http_request.app.state
  if state.model is None:
    raise Refusal(503, "the model is still compiling; retry later", retry=True)
  if state.cache is None:
    raise Refusal(404, "this server runs without a user-state cache (see --cache-mb)")
  try:
    return await state.cache("flush" if flush else "report")
  except ModelUnavailable as e:
    raise Refusal(503, str(e), retry=True) from None


async def _cache(http_request: HttpRequest) -> JSONResponse:
  """`GET /cache`: the user-state cache's size and use; `POST /cache/flush` empties it.

  The flush changes state, so it takes `Content-Type: application/json` only: a browser
  sends that cross-site only after a CORS preflight, which this server never grants, so a
  page elsewhere cannot make a visitor's browser flush the cache (a form's `text/plain`
  POST is refused with 415).
  """
  try:
    flush = http_request.method == "POST"
    if flush:
      content_type = http_request.headers.get("content-type", "").split(";")[0].strip()
      if content_type != bodies.JSON:
        raise Refusal(415, f"POST /cache/flush takes Content-Type: {bodies.JSON} (a request a "
                            f"browser cannot send cross-site unasked), got {content_type!r}")
    return JSONResponse(await _cache_report(http_request, flush))
  except Refusal as refusal:
    return JSONResponse({"error": str(refusal)}, status_code=refusal.status)


def _scrape(http_request: HttpRequest) -> Response:
  body, content_type = http_request.app.state.metrics.exposition()
  return Response(body, media_type=content_type)


_SCHEMAS = SchemaGenerator({"openapi": "3.0.0",
                            "info": {"title": "ikbo_jax ranking", "version": __version__}})


def _openapi(http_request: HttpRequest) -> JSONResponse:
  return JSONResponse(_SCHEMAS.get_schema(routes=http_request.app.routes))


_ROUTES = [Route("/score", _score_route, methods=["POST"]),
           Route("/health", _health, methods=["GET"]),
           Route("/health/live", _live, methods=["GET"]),
           Route("/health/ready", _ready, methods=["GET"]),
           Route("/metrics", _scrape, methods=["GET"]),
           Route("/cache", _cache, methods=["GET"], include_in_schema=False),
           Route("/cache/flush", _cache, methods=["POST"], include_in_schema=False),
           Route("/openapi.json", _openapi, methods=["GET"], include_in_schema=False)]


async def _score(http_request: HttpRequest, limits: HttpLimits, arrived: float,
                 clock: StageClock | None) -> list[float]:
  """The request's scores; its deadline counts from `arrived` (`time.perf_counter()`).
  `clock`, if any, gets its stages."""
  batcher: Batcher | None = http_request.app.state.batcher
  if batcher is None:
    raise Refusal(503, "the model is still compiling; retry later", retry=True)
  timeout_ms = (_timeout_ms(http_request.headers.get("x-timeout-ms"), limits.max_timeout_ms)
                or batcher.config.default_timeout_ms)
  content_type = http_request.headers.get("content-type", "").split(";")[0].strip().lower()
  if content_type not in bodies.CONTENT_TYPES:
    raise Refusal(415, f"the content type must be one of {list(bodies.CONTENT_TYPES)}, got "
                        f"{content_type!r}")
  # Under overload the queue's wait alone can pass the deadline: such a request would only
  # be read, decoded and queued to time out, so it is refused before its body is read.
  expected_ms = batcher.expected_wait_ms
  if expected_ms > timeout_ms:
    raise Refusal(503, f"the queue's expected wait ({expected_ms:.0f} ms) is past the "
                       f"request's deadline ({timeout_ms:g} ms); it was not read", retry=True,
                  reason="deadline")
  admission: Admission = http_request.app.state.admission
  admission.check_working()  # full of received requests: refused before reading the body
  with admission.receiving_body(http_request.client and http_request.client.host):
    body = await receive_body(http_request, limits.max_body_bytes, limits.body_timeout_s,
                              limits.min_body_rate, limits.body_grace_s)
  if clock is not None:
    clock.mark("body")
  with admission.working():
    return await _decode_and_score(body, content_type, batcher, limits, timeout_ms, arrived,
                                   clock)


async def _decode_and_score(body: bytes, content_type: str, batcher: Batcher,
                            limits: HttpLimits, timeout_ms: float, arrived: float,
                            clock: StageClock | None) -> list[float]:
  try:
    request = bodies.decode(content_type, body, batcher.model.config, limits.max_candidates)
  except bodies.BodyError as e:
    raise Refusal(e.status, str(e)) from None
  if clock is not None:
    clock.mark("decode")
  # On a CPU-bound server the wait is here, reading and decoding, before the batcher's queue:
  # a request whose deadline passed on the way is refused, never queued.
  left_ms = timeout_ms - 1e3 * (time.perf_counter() - arrived)
  if left_ms <= 0:
    raise Refusal(503, f"the request's deadline ({timeout_ms:g} ms) passed while it was read; "
                        "it was not computed", retry=True)
  try:
    scores = await batcher.score(request, left_ms, clock)
  except RequestError as e:
    raise Refusal(400, str(e)) from None
  except Overloaded as e:
    raise Refusal(429, str(e), retry=True) from None
  except DeadlineExceeded as e:
    raise Refusal(503, str(e), retry=True) from None
  except ModelUnavailable as e:
    raise Refusal(503, str(e), retry=True, reason="not_ready") from None
  finite = np.isfinite(scores)
  if not finite.all():
    raise Refusal(422, f"{int((~finite).sum())} of the request's {scores.size} scores are not "
                        "finite: its inputs overflow the model")
  return scores.tolist()


def _timeout_ms(header: str | None, most: float) -> float | None:
  if header is None:
    return None
  try:
    value = float(header)
  except ValueError:
    value = float("nan")
  if not 0 < value <= most:
    raise Refusal(400, f"X-Timeout-Ms must be a number of milliseconds in (0, {most:g}], got "
                        f"{header!r}")
  return value


def _request_schema(model: Scorer, limits: HttpLimits) -> dict:
  """The fields `POST /score` takes for the loaded model, with their shapes."""
  config = model.config
  return {
      "content_types": list(bodies.CONTENT_TYPES),
      "fields": {
          "user_dense": f"float[{config.user_dense}], finite",
          "history": f"int[L], L <= {config.max_history}, item ids in [0, {config.num_items})",
          "cand_items": f"int[n], 1 <= n <= {limits.max_candidates}, item ids in "
                        f"[0, {config.num_items})",
          "cand_dense": f"float[n, {config.cand_dense}], finite",
      },
      "headers": {"X-Timeout-Ms": "optional: the request's deadline in milliseconds"},
      "max_body_bytes": limits.max_body_bytes,
  }
