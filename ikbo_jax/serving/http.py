"""The HTTP endpoint (Starlette): `POST /score` takes one request as JSON, returns its scores.

    {"user_dense": [...], "history": [...], "cand_items": [...], "cand_dense": [[...], ...]}
    -> 200 {"scores": [...]}            (click probabilities, in candidate order)
    -> 400 {"error": "..."}             (this request only; names the field and the values)

`GET /health` reports the build and the compiled buckets. The batcher runs for
the app's lifetime, so concurrent HTTP requests share batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from ikbo_jax.data import Request, RequestError
from ikbo_jax.serving.batcher import Batcher, BatchingConfig
from ikbo_jax.serving.scorer import Scorer

_FIELDS = ("user_dense", "history", "cand_items", "cand_dense")


def create_app(model: Scorer, batching: BatchingConfig = BatchingConfig()) -> Starlette:
  """An ASGI app serving `model` (run it with uvicorn, or `python -m ikbo_jax.serving`)."""

  @contextlib.asynccontextmanager
  async def lifespan(app: Starlette):
    async with Batcher(model, batching) as batcher:
      app.state.batcher = batcher
      yield

  async def score(http_request: HttpRequest) -> JSONResponse:
    try:
      body = await http_request.json()
      request = _parse(body)
      scores = await http_request.app.state.batcher.score(request)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      return JSONResponse({"error": f"the body is not JSON: {e}"}, status_code=400)
    except RequestError as e:
      return JSONResponse({"error": str(e)}, status_code=400)
    return JSONResponse({"scores": scores.tolist()})

  async def health(http_request: HttpRequest) -> JSONResponse:
    return JSONResponse({"status": "ok", "build": model.build,
                         "buckets": [dataclasses.asdict(b) for b in model.buckets]})

  return Starlette(routes=[Route("/score", score, methods=["POST"]),
                           Route("/health", health, methods=["GET"])], lifespan=lifespan)


def _parse(body) -> Request:
  if not isinstance(body, dict):
    raise RequestError(f"the body must be a JSON object with fields {list(_FIELDS)}, "
                       f"got {type(body).__name__}")
  missing = [f for f in _FIELDS if f not in body]
  unknown = sorted(set(body) - set(_FIELDS))
  if missing or unknown:
    raise RequestError(f"expected fields {list(_FIELDS)}; missing {missing}, unknown {unknown}")
  return Request(**{f: body[f] for f in _FIELDS})
