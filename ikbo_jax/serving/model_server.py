"""The model process of a server with several HTTP processes (`serving.processes`).

It holds the one model (and its user-state cache) and the one `Batcher`, and
listens on a Unix socket (`serving.frames`) for the requests that the HTTP
processes have read, decoded and checked against the model (`ModelDescription.check`,
which its batcher does not repeat). Every user's requests meet the
same cache, however many HTTP processes there are, and batches fill from all
of them. What it answers (HTTP process -> model process, and back):

    ("score", id, request, deadline, timed) -> ("scores", id, scores, marks)
                                        | ("refused", id, kind, message)
    ("cache", id, "report" | "flush")  -> ("cache", id, report)
    anything that fails otherwise      -> ("error", id, "Type: message")

`deadline` is the `time.perf_counter()` by which the request must be answered: one
clock for every process of a host (Linux's monotonic clock), so that the time a frame
waits in the socket for this process, when it is at its limit, counts against the
request's deadline too; one already past when its frame is read is refused, never queued.
`kind` names the batcher's exception (`REFUSALS`); `marks` are the request's
stages here (`serving.stages`, the first ending when its frame was read) where
`timed` asks for them, else None. A connection is greeted
with ("ready", ModelDescription) once the model is built, or ("failed",
reason) if it could not be; after that the process pushes ("queue",
expected_wait_ms, queued_requests, queued_candidates, cache_report) whenever
the queue changes, at most every `state_interval_s`, so that each HTTP
process can refuse what the queue cannot answer in time before reading it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import signal
import time
from collections.abc import Callable

from ikbo_jax.data import Request, RequestError
from ikbo_jax.models import Build, RankerConfig
from ikbo_jax.serving import frames
from ikbo_jax.serving.batcher import (Batcher, BatchingConfig, DeadlineExceeded, Overloaded,
                                     check_request)
from ikbo_jax.serving.buckets import Bucket
from ikbo_jax.serving.cached import CachedModel
from ikbo_jax.serving.metrics import ServingMetrics
from ikbo_jax.serving.scorer import Scorer
from ikbo_jax.serving.stages import StageClock

_LOG = logging.getLogger(__name__)

REFUSALS = {"request": RequestError, "overloaded": Overloaded, "deadline": DeadlineExceeded}


@dataclasses.dataclass(frozen=True)
class ModelDescription:
  """What an HTTP process needs to know of the model: to decode bodies, and for `/health`."""

  config: RankerConfig
  build: Build
  buckets: tuple[Bucket, ...]
  has_cache: bool
  max_abs_feature: float  # the model's valid range of dense features (`models.valid_range`)

  @classmethod
  def of(cls, model: Scorer) -> ModelDescription:
    return cls(model.config, model.build, tuple(model.buckets), isinstance(model, CachedModel),
               getattr(model, "max_abs_feature", math.inf))

  def check(self, request: Request) -> Request:
    """`request` checked as the model's batcher would (`batcher.check_request`)."""
    return check_request(request, self.config, self.max_abs_feature, self.buckets[-1])


class ModelServer:
  """Serves `build_model()`'s model on the Unix socket at `path` until `stop_signal` or `stop()`.

  If the model cannot be built, `serve` returns at once with the reason in `failed`.
  """

  state_interval_s = 0.002

  def __init__(self, path: str, build_model: Callable[[], Scorer], batching: BatchingConfig,
               stop_signal: int = signal.SIGTERM):
    self.path, self._build_model, self._batching = path, build_model, batching
    self._stop_signal = stop_signal
    self._writers: set[asyncio.Transport] = set()  # the HTTP processes', once greeted
    self._model_ready = asyncio.Event()
    self._stopping = asyncio.Event()
    self.description: ModelDescription | None = None
    self.failed: str | None = None
    self.batcher: Batcher | None = None
    self.model: Scorer | None = None

  def stop(self) -> None:
    self._stopping.set()

  async def serve(self) -> None:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(self.path)  # the socket of a process this one replaces
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: _HttpProcessConnection(self), path=self.path)
    with contextlib.suppress(RuntimeError, ValueError):  # not the main thread (tests)
      loop.add_signal_handler(self._stop_signal, self.stop)
    metrics = ServingMetrics()
    async with server, contextlib.AsyncExitStack() as stack:
      try:
        self.model = await asyncio.to_thread(self._build_model)
        self.batcher = await stack.enter_async_context(
            Batcher(self.model, self._batching, on_batch=metrics.observe_batch))
        self.description = ModelDescription.of(self.model)
      except Exception as e:  # every HTTP process reports it on its probes, in one line
        self.failed = f"{type(e).__name__}: {e}"
        _LOG.error("the model could not be started: %s", self.failed)
      self._model_ready.set()
      if self.failed:
        return
      pushing = asyncio.create_task(self._push_queue_state())
      await self._stopping.wait()
      pushing.cancel()
      for writer in list(self._writers):  # the HTTP processes see it go at once
        writer.close()

  async def _answer(self, message: tuple, writer: asyncio.Transport) -> None:
    kind, request_id, *rest = message
    try:
      if kind == "score":
        request, deadline, timed = rest
        clock = StageClock() if timed else None
        timeout_ms = 1e3 * (deadline - time.perf_counter())
        if timeout_ms <= 0:
          raise DeadlineExceeded("the request's deadline passed before the model process "
                                 "read it; it was not computed")
        # Checked by the HTTP process that read it (`RemoteBatcher.score`): the one process
        # every request goes through does no per-request work another process can do.
        scores = await self.batcher.score(request, timeout_ms, clock, checked=True)
        reply = ("scores", request_id, scores, clock and [("send", clock.marks[0][1]),
                                                          *clock.marks[1:]])
      elif kind == "cache" and isinstance(self.model, CachedModel):
        if rest == ["flush"]:
          await asyncio.to_thread(self.model.flush)
        reply = ("cache", request_id, self.model.report())
      else:
        raise ValueError(f"no such message: {kind!r} {rest!r}")
    except tuple(REFUSALS.values()) as e:
      name = next(k for k, cls in REFUSALS.items() if isinstance(e, cls))
      reply = ("refused", request_id, name, str(e))
    except Exception as e:  # a defect of ours: the HTTP process answers 500 and logs it
      reply = ("error", request_id, f"{type(e).__name__}: {e}")
    if not writer.is_closing():
      writer.write(frames.encode(reply))

  def _queue_state(self) -> tuple:
    batcher = self.batcher
    cache = self.model.report() if isinstance(self.model, CachedModel) else None
    return ("queue", batcher.expected_wait_ms, batcher.queued_requests,
            batcher.queued_candidates, cache)

  async def _push_queue_state(self) -> None:
    last = None
    while True:
      await asyncio.sleep(self.state_interval_s)
      state = self._queue_state()
      if state != last and self._writers:
        frame = frames.encode(state)
        for writer in list(self._writers):
          if not writer.is_closing():
            writer.write(frame)
        last = state


class _HttpProcessConnection(frames.FrameProtocol):
  """One HTTP process's connection: greeted once the model is ready (nothing is read
  before), then each message answered in a task of its own."""

  def __init__(self, server: ModelServer):
    super().__init__(self._received, self._closed)
    self._server = server
    self._tasks: set[asyncio.Task] = set()

  def connection_made(self, transport: asyncio.Transport) -> None:
    super().connection_made(transport)
    transport.pause_reading()
    self._spawn(self._greet())

  async def _greet(self) -> None:
    server, transport = self._server, self.transport
    await server._model_ready.wait()
    if transport.is_closing():
      return
    if server.failed:
      transport.write(frames.encode(("failed", server.failed)))
      transport.close()
      return
    transport.write(frames.encode(("ready", server.description)))
    server._writers.add(transport)
    transport.resume_reading()

  def _received(self, message: tuple) -> None:
    self._spawn(self._server._answer(message, self.transport))

  def _spawn(self, coroutine) -> None:
    task = asyncio.create_task(coroutine)
    self._tasks.add(task)  # the loop keeps only weak references to tasks
    task.add_done_callback(self._tasks.discard)

  def _closed(self, error: Exception | None) -> None:
    if error is not None:
      _LOG.warning("an HTTP process's connection failed: %s", error)
    self._server._writers.discard(self.transport)
