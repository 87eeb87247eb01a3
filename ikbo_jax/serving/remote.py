"""`RemoteBatcher`: an HTTP process's stand-in for the `Batcher` of the model process.

It speaks `serving.model_server`'s messages over the model process's Unix
socket, and offers the HTTP app what a `Batcher` does: `score`,
`expected_wait_ms` and the queue's depths (as the model process last pushed
them, within milliseconds of any change), and `model` (a `ModelDescription`).
While the model process is gone (it died, and the supervisor starts another),
`score` raises `ModelUnavailable` (HTTP 503, retry), and the batcher connects
again in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

import numpy as np

from ikbo_jax.data import Request
from ikbo_jax.serving import frames
from ikbo_jax.serving.batcher import BatchingConfig, DeadlineExceeded
from ikbo_jax.serving.model_server import REFUSALS, ModelDescription
from ikbo_jax.serving.stages import StageClock


class ModelUnavailable(RuntimeError):
  """The model process cannot be reached now (it is starting, or being replaced); retry."""


class RemoteBatcher:
  """The model process's batcher, seen from an HTTP process. An async context manager."""

  reconnect_s = 0.05
  # Past its deadline the model process answers by itself; this much longer, the HTTP
  # process stops waiting for a model process that hangs.
  answer_grace_s = 1.0

  def __init__(self, path: str, config: BatchingConfig):
    self.path, self.config = path, config
    self.model: ModelDescription | None = None
    self.failed: str | None = None
    self._writer: asyncio.Transport | None = None
    self._pending: dict[int, asyncio.Future] = {}
    self._ids = itertools.count()
    self._queue = (0.0, 0, 0, None)
    self._greeted = asyncio.Event()
    self._task: asyncio.Task | None = None

  async def __aenter__(self) -> RemoteBatcher:
    self._task = asyncio.create_task(self._run())
    return self

  async def __aexit__(self, *exc) -> None:
    self._task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
      await self._task

  async def ready(self) -> ModelDescription:
    """The model's description once the model process has built it; raises if it failed."""
    await self._greeted.wait()
    if self.failed:
      raise RuntimeError(f"the model process could not start the model: {self.failed}")
    return self.model

  @property
  def expected_wait_ms(self) -> float:
    return self._queue[0]

  @property
  def queued_requests(self) -> int:
    return self._queue[1]

  @property
  def queued_candidates(self) -> int:
    return self._queue[2]

  @property
  def cache_report(self) -> dict | None:
    """The user-state cache's report as last pushed (None without a cache)."""
    return self._queue[3]

  async def score(self, request: Request, timeout_ms: float | None = None,
                  clock: StageClock | None = None) -> np.ndarray:
    """As `Batcher.score`; raises `ModelUnavailable` while the model process is gone.

    `clock` gets the model process's stages, the hop there (`send`) and back (`reply`).
    """
    timeout_ms = timeout_ms or self.config.default_timeout_ms
    if self.model is not None:  # else `_ask` refuses: no model process yet
      request = self.model.check(request)  # here, not in the one model process
      if clock is not None:
        clock.mark("validate")
    deadline = time.perf_counter() + timeout_ms / 1e3  # the model process's clock too
    scores, marks = await self._ask("score", request, deadline, clock is not None,
                                    wait_s=timeout_ms / 1e3)
    if clock is not None:
      clock.extend(marks)
      clock.mark("reply")
    return scores

  async def cache(self, action: str) -> dict:
    """The cache's report, after emptying it where `action` is "flush"."""
    return await self._ask("cache", action, wait_s=self.config.default_timeout_ms / 1e3)

  async def _ask(self, kind: str, *args, wait_s: float):
    writer = self._writer
    if writer is None or writer.is_closing():
      raise ModelUnavailable("the model process is not reachable now (starting or being "
                             "replaced); retry")
    request_id = next(self._ids)
    future = asyncio.get_running_loop().create_future()
    self._pending[request_id] = future
    try:
      writer.write(frames.encode((kind, request_id, *args)))
      return await asyncio.wait_for(future, wait_s + self.answer_grace_s)
    except TimeoutError:
      raise DeadlineExceeded("the model process did not answer within the request's "
                             "deadline") from None
    finally:
      self._pending.pop(request_id, None)

  async def _run(self) -> None:
    """Connects, reads answers, and connects again whenever the model process goes away."""
    loop = asyncio.get_running_loop()
    while True:
      closed = loop.create_future()

      def connection() -> frames.FrameProtocol:
        protocol = frames.FrameProtocol(
            lambda message: self._dispatch(message, protocol.transport),
            lambda error: closed.done() or closed.set_result(error))
        return protocol

      try:
        transport, _ = await loop.create_unix_connection(connection, self.path)
      except (FileNotFoundError, ConnectionRefusedError):
        await asyncio.sleep(self.reconnect_s)
        continue
      try:
        await closed
        if self.failed:
          return
      finally:
        self._writer = None
        self._queue = (0.0, 0, 0, self._queue[3])
        transport.close()
        lost = ModelUnavailable("the model process went away before it answered; retry")
        for future in self._pending.values():
          if not future.done():
            future.set_exception(lost)
      await asyncio.sleep(self.reconnect_s)

  def _dispatch(self, message: tuple, transport: asyncio.Transport) -> None:
    kind = message[0]
    if kind in ("ready", "failed"):  # the greeting, once a connection's model is built
      if kind == "ready":
        self.model, self._writer = message[1], transport
      else:
        self.failed = message[1]
        transport.close()
      self._greeted.set()
      return
    if kind == "queue":
      self._queue = message[1:]
      return
    future = self._pending.get(message[1])
    if future is None or future.done():  # its caller stopped waiting
      return
    if kind == "scores":
      future.set_result((message[2], message[3]))
    elif kind == "cache":
      future.set_result(message[2])
    elif kind == "refused":
      future.set_exception(REFUSALS[message[2]](message[3]))
    else:
      future.set_exception(RuntimeError(f"the model process failed: {message[2]}"))
