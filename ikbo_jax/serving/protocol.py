"""uvicorn's HTTP/1.1 protocol (httptools' parser) with a deadline and a size for every head.

uvicorn times a connection out only between requests (its keep-alive timer
starts after a response and stops at the next byte), so a connection that never
completes a request head, idle from the start or a client sending a byte at a
time, holds its socket forever: enough of them exhaust the file descriptors and
the server stops answering. Here each connection must complete a request head
within `head_timeout_s` of opening, and of its last response; else it is closed (a
connection answering requests pipelined on it is not waiting for a head).

uvicorn's connection limit counts idle connections and answers health checks 503 past
it; here it counts requests in progress, and health checks always pass.

Nor does uvicorn bound a head's size: a 200 MB header was read whole, and one of
48 MB stalled every client for 1.7 s while it was parsed. Here a head of more
than `max_head_bytes` bytes (counted as they arrive, so a header that never
ends is caught too) or more than `max_headers` fields is answered 431 and its
connection closed, before the application sees it.

Each request's scope records when its first bytes were read (`stages.ARRIVED`): an event loop
at its limit holds parsed requests for tens of milliseconds before their handlers start,
and a deadline counted from the handler's start never saw that wait.

The parser is httptools' (C) rather than h11's (pure Python): with the benchmark
preset's JSON bodies it saved the server ~0.13 ms of its ~1.27 ms per request (a
2-core CPU).
"""

from __future__ import annotations

import asyncio
import time

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ikbo_jax.serving.stages import ARRIVED

_TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large\r\n"


class _HeadTooLarge(Exception):
  """Raised in a parser callback to stop parsing a head that is over its limits."""


class _GuardedProtocol(HttpToolsProtocol):
  head_timeout_s: float = 10.0
  max_head_bytes: int = 32 * 1024
  max_headers: int = 100

  def connection_made(self, transport: asyncio.Transport) -> None:
    super().connection_made(transport)
    self._reading_head, self._head_bytes, self._refusal = True, 0, None
    self._arm_head_deadline()

  def data_received(self, data: bytes) -> None:
    # `data` is all head only if it began in a head and did not end it: a read that ends a
    # body may hold a next head's start (counted from the next read on, so a head is
    # caught within one read past the limit), but never counts as head itself.
    began_in_head, self._head_ended = self._reading_head, False
    super().data_received(data)
    if began_in_head and not self._head_ended and not self.transport.is_closing():
      self._head_bytes += len(data)
      if self._head_bytes > self.max_head_bytes:
        self._send_431(f"the request head is over {self.max_head_bytes} bytes")

  def on_message_begin(self) -> None:
    super().on_message_begin()
    self.scope[ARRIVED] = time.perf_counter()
    self._reading_head, self._head_fields, self._field_bytes = True, 0, 0

  def on_header(self, name: bytes, value: bytes) -> None:
    self._head_fields += 1
    self._field_bytes += len(name) + len(value)
    if self._head_fields > self.max_headers:
      self._refusal = f"the request head has over {self.max_headers} fields"
    elif self._field_bytes > self.max_head_bytes:
      self._refusal = f"the request head is over {self.max_head_bytes} bytes"
    if self._refusal:
      raise _HeadTooLarge  # uvicorn answers the parser's error through `send_400_response`
    super().on_header(name, value)

  def on_headers_complete(self) -> None:
    # uvicorn answers 503 once `limit_concurrency` connections are open, idle ones included,
    # health checks included: 2,100 idle connections turned away 99% of real requests and
    # `/health/live`. Here the limit counts requests in progress (idle connections are bounded
    # by the head deadline), and health checks, which cost nothing, always pass. While the
    # server drains its accept queue to shut down (`draining.py`), every other request gets
    # the 503.
    self._reading_head, self._head_ended = False, True
    limit = self.limit_concurrency
    shutting_down = getattr(self.server_state, "refusing", False)
    admit = self.url.startswith(b"/health") or not shutting_down and (
        limit is None or len(self.tasks) < limit)
    self.limit_concurrency = None if admit else 0  # 0: uvicorn's own 503 for this request
    try:
      super().on_headers_complete()
    finally:
      self.limit_concurrency = limit

  def shutdown(self) -> None:
    # uvicorn closes a connection whose request it has not parsed yet at once; if the request's
    # bytes were already in the socket, the kernel answers them with a reset. Such a
    # connection (one accepted while the server drains its queue) gets a moment to be read
    # and answered (503) first.
    if self.cycle is None and not self.transport.is_closing():
      self.loop.call_later(0.05, super().shutdown)
      return
    super().shutdown()

  def on_message_complete(self) -> None:
    super().on_message_complete()
    self._reading_head, self._head_bytes = True, 0

  def send_400_response(self, msg: str) -> None:
    if self._refusal:
      self._send_431(self._refusal)
    else:
      super().send_400_response(msg)

  def _send_431(self, message: str) -> None:
    body = message.encode()
    self.transport.write(b"".join([
        _TOO_LARGE, b"content-type: text/plain; charset=utf-8\r\n",
        b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body]))
    self.transport.close()

  def on_response_complete(self) -> None:
    super().on_response_complete()
    self._arm_head_deadline()

  def _arm_head_deadline(self) -> None:
    # A request head replaces `self.cycle`; still the same one at the deadline means none came.
    waiting_after = self.cycle
    self.loop.call_later(self.head_timeout_s, self._close_if_no_head, waiting_after)

  def _close_if_no_head(self, waiting_after) -> None:
    # A connection still answering is not waiting for a head: requests pipelined behind the
    # one answered were parsed long ago (the last of them is `self.cycle`), and the response
    # that ends the last of them arms the deadline again.
    busy = self.pipeline or (self.cycle is not None and not self.cycle.response_complete)
    if self.cycle is waiting_after and not busy and not self.transport.is_closing():
      self.transport.close()


def guarded_http(head_timeout_s: float, max_head_bytes: int = 32 * 1024,
                 max_headers: int = 100) -> type[HttpToolsProtocol]:
  """The protocol class to pass as `uvicorn.Config(http=...)`."""
  for name, value in dict(head_timeout_s=head_timeout_s, max_head_bytes=max_head_bytes,
                          max_headers=max_headers).items():
    if not value > 0:
      raise ValueError(f"{name} must be > 0, got {value!r}")
  return type("GuardedHttpProtocol", (_GuardedProtocol,), dict(
      head_timeout_s=head_timeout_s, max_head_bytes=int(max_head_bytes),
      max_headers=int(max_headers)))
