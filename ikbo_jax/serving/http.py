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
when its first bytes were read (a CPU-bound server's wait is in its event loop's backlog and
in reading and decoding bodies). `serving.score_endpoint` answers `POST /score`.
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
import warnings
from collections.abc import Callable

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.schemas import SchemaGenerator

from ikbo_jax import __version__
from ikbo_jax.serving import bodies
from ikbo_jax.serving.admission import Admission, Refusal
from ikbo_jax.serving.batcher import Batcher, BatchingConfig
from ikbo_jax.serving.cached import CachedModel
from ikbo_jax.serving.metrics import ServingMetrics
from ikbo_jax.serving.remote import ModelUnavailable, RemoteBatcher
from ikbo_jax.serving.scorer import Scorer
from ikbo_jax.serving.score_endpoint import ScoreEndpoint

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

  app = _App(routes=_ROUTES, lifespan=lifespan)
  app.state.metrics, app.state.limits = metrics, limits
  app.state.server_timing = server_timing
  app.state.admission = Admission(limits.max_active, limits.max_receiving,
                                  limits.max_receiving_per_peer)
  return app


class _App(Starlette):
  """Starlette, but `POST /score` goes straight to its endpoint, past the middleware and the
  router: it answers every failure itself (a 500 included), so the middleware has nothing to
  do for it, and skipping those layers saved ~6% of a one-process server's CPU per request
  (`http_server_cost.py`, alternated runs). Every other request, and any other method on
  /score (405), is Starlette's."""

  async def __call__(self, scope, receive, send) -> None:
    if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == "/score":
      scope["app"] = self
      await _SCORE(scope, receive, send)
    else:
      await super().__call__(scope, receive, send)


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


_SCORE = ScoreEndpoint()
_ROUTES = [Route("/score", _SCORE, methods=["POST"]),
           Route("/health", _health, methods=["GET"]),
           Route("/health/live", _live, methods=["GET"]),
           Route("/health/ready", _ready, methods=["GET"]),
           Route("/metrics", _scrape, methods=["GET"]),
           Route("/cache", _cache, methods=["GET"], include_in_schema=False),
           Route("/cache/flush", _cache, methods=["POST"], include_in_schema=False),
           Route("/openapi.json", _openapi, methods=["GET"], include_in_schema=False)]


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


class _FastJSON(JSONResponse):
  """A `JSONResponse` encoded by msgspec: what `POST /score` answered with before it had an
  endpoint of its own; kept for the deprecated name `FastJSON`."""

  def render(self, content) -> bytes:
    return msgspec.json.encode(content)


def __getattr__(name: str):
  if name == "FastJSON":
    warnings.warn("serving.http.FastJSON is deprecated: POST /score's endpoint "
                  "(serving.score_endpoint) encodes its answers; use msgspec.json.encode "
                  "or starlette's JSONResponse", DeprecationWarning, stacklevel=2)
    return _FastJSON
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
