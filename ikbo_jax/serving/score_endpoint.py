"""`POST /score` as an ASGI app of its own: the one route that carries the load.

Starlette's function endpoints wrap every request in a `Request`, a `Response` and an
exception-handling layer around `send`; on an HTTP process at its limit those layers cost
~15% of a request's time (a py-spy profile of the CPU stub). This app reads the headers it
needs from the scope, the body from `receive`, and writes its answer as two ASGI messages.
What it answers is `serving.http`'s (the statuses are listed there). The app hands it
`POST /score` directly (`http._App`); Starlette answers 405 for other methods on /score and
reads the OpenAPI operation from `post`.
"""

from __future__ import annotations

import logging
import time

import msgspec
import numpy as np

from ikbo_jax.data import RequestError
from ikbo_jax.serving import bodies
from ikbo_jax.serving.admission import Admission, Refusal, read_body
from ikbo_jax.serving.batcher import Batcher, DeadlineExceeded, Overloaded
from ikbo_jax.serving.remote import ModelUnavailable
from ikbo_jax.serving.stages import ARRIVED, StageClock

_LOG = logging.getLogger(__name__)
_JSON = [(b"content-type", b"application/json")]
_WANTED = (b"content-type", b"content-length", b"x-timeout-ms")


class ScoreEndpoint:
  """The ASGI app of `POST /score`; the server's state is the Starlette app's (`scope["app"]`)."""

  async def __call__(self, scope, receive, send) -> None:
    await self.post(scope, receive, send)  # Starlette's route admits POST only

  async def post(self, scope, receive, send) -> None:
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
    state = scope["app"].state
    limits, metrics = state.limits, state.metrics
    # The deadline counts from the request's first bytes read, where the protocol saw them.
    arrived = scope.get(ARRIVED)
    start = arrived or time.perf_counter()
    clock = StageClock(start) if state.server_timing else None
    if clock is not None and arrived is not None:
      clock.mark("head")
    headers = []
    try:
      scores = await _score(scope, receive, state, start, clock)
      status, content = 200, {"scores": scores}
      if clock is not None:
        clock.mark("encode")
        headers.append((b"server-timing", clock.server_timing().encode()))
    except Refusal as refusal:
      if refusal.status in (429, 499, 503):
        reason = refusal.reason or {429: "overloaded", 499: "client_closed"}.get(
            refusal.status, "deadline" if state.batcher else "not_ready")
        metrics.count_refusal(reason)
      if refusal.retry:
        headers.append((b"retry-after", str(limits.retry_after_s).encode()))
      status, content = refusal.status, {"error": str(refusal)}
    except Exception as e:  # a defect of ours: one line in the log, no traceback
      _LOG.error("POST /score failed: %s: %s", type(e).__name__, e)
      status, content = 500, {"error": f"internal error ({type(e).__name__})"}
    # msgspec encodes in C: 5.5 us for an answer of 70 scores, json.dumps 39-64 us. The
    # scores are finite here (a request with any that is not is refused 422 first).
    body = msgspec.json.encode(content)
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON, (b"content-length", b"%d" % len(body)), *headers]})
    await send({"type": "http.response.body", "body": body})
    metrics.observe_request("/score", status, time.perf_counter() - start)


async def _score(scope, receive, state, arrived: float, clock: StageClock | None) -> list[float]:
  """The request's scores; its deadline counts from `arrived` (`time.perf_counter()`).
  `clock`, if any, gets its stages."""
  batcher: Batcher | None = state.batcher
  if batcher is None:
    raise Refusal(503, "the model is still compiling; retry later", retry=True)
  headers = {}
  for name, value in scope["headers"]:  # lower-cased by the server; the first of each counts
    if name in _WANTED and name not in headers:
      headers[name] = value.decode("latin-1")
  limits = state.limits
  timeout_ms = (_timeout_ms(headers.get(b"x-timeout-ms"), limits.max_timeout_ms)
                or batcher.config.default_timeout_ms)
  content_type = headers.get(b"content-type", "").split(";")[0].strip().lower()
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
  admission: Admission = state.admission
  admission.check_working()  # full of received requests: refused before reading the body
  client = scope.get("client")
  with admission.receiving_body(client[0] if client else None):
    body = await read_body(receive, headers.get(b"content-length"), limits.max_body_bytes,
                           limits.body_timeout_s, limits.min_body_rate, limits.body_grace_s)
  if clock is not None:
    clock.mark("body")
  with admission.working():
    return await _decode_and_score(body, content_type, batcher, limits, timeout_ms, arrived,
                                   clock)


async def _decode_and_score(body: bytes, content_type: str, batcher: Batcher, limits,
                            timeout_ms: float, arrived: float,
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
