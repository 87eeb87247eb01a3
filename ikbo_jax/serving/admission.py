"""Which `POST /score` requests the server takes on: how a body must arrive, and the slots of
bodies being received and of requests being worked on, counted apart, so that no one client
may hold most of the receiving.

A request holds a *working* slot (of `max_active`) only once its whole body has arrived:
while it is decoded, queued and scored. Before, the slot was taken when the head arrived,
so 300 clients trickling bodies (each cut after its grace second, then reconnecting) kept
every slot and 588 of 590 real requests got 429. Receiving a body takes a *receiving* slot
instead, bounded twice: `max_receiving` in all (with `max_body_bytes`, the memory that
bodies in flight may hold) and `max_receiving_per_peer` per client address, so one client
trickling on many connections is refused (429) before it crowds out the others. Behind a
proxy every client has the proxy's address: raise the per-peer bound to `max_receiving`
there, and let the proxy, which sees the real clients, bound each of them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import warnings
from collections.abc import Iterator



class Refusal(Exception):
  """A response other than 200: its status, message, whether to send `Retry-After`, and
  the reason the refusal metric counts it under (else one derived from the status)."""

  def __init__(self, status: int, message: str, retry: bool = False, reason: str | None = None):
    super().__init__(message)
    self.status, self.retry, self.reason = status, retry, reason


class Admission:
  """The counts of one server's receiving and working slots (one event loop: no locks)."""

  def __init__(self, max_active: int, max_receiving: int, max_receiving_per_peer: int):
    self.max_active, self.max_receiving = max_active, max_receiving
    self.max_receiving_per_peer = max_receiving_per_peer
    self.active = 0  # requests whose body arrived, being decoded, queued or scored
    self.receiving: collections.Counter[str | None] = collections.Counter()

  def check_working(self) -> None:
    """Refuses a request (before its body is read) when every working slot is taken."""
    if self.active >= self.max_active:
      raise Refusal(429, f"{self.max_active} requests are being served; retry later",
                    retry=True, reason="overloaded")

  @contextlib.contextmanager
  def receiving_body(self, peer: str | None) -> Iterator[None]:
    """A receiving slot for `peer`'s body, held while the body arrives."""
    if self.receiving[peer] >= self.max_receiving_per_peer:
      raise Refusal(429, f"this client is already sending {self.max_receiving_per_peer} "
                         "bodies; retry later", retry=True, reason="peer_receiving")
    if self.receiving.total() >= self.max_receiving:
      raise Refusal(503, f"{self.max_receiving} request bodies are being received; retry "
                         "later", retry=True, reason="receiving")
    self.receiving[peer] += 1
    try:
      yield
    finally:
      self.receiving[peer] -= 1
      if not self.receiving[peer]:
        del self.receiving[peer]

  @contextlib.contextmanager
  def working(self) -> Iterator[None]:
    """A working slot, held while a received request is decoded, queued and scored."""
    self.check_working()
    self.active += 1
    try:
      yield
    finally:
      self.active -= 1


async def read_body(receive, declared: str | None, max_bytes: int, timeout_s: float,
                       min_rate: float, grace_s: float) -> bytes:
  """The body of the request whose ASGI `receive` this is (`declared`: its Content-Length
  header, if any), refused (413, 408, 499) if it is over `max_bytes`, takes over `timeout_s`
  in all, or keeps arriving slower than `min_rate` bytes/s after `grace_s`.

  One timer serves both limits, moved at each chunk: a body that came with its head costs
  one `receive` and no more.
  """
  if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
    raise Refusal(413, f"the body may have at most {max_bytes} bytes, Content-Length says "
                       f"{declared}")
  loop = asyncio.get_running_loop()
  start, size, chunks, whole_due = loop.time(), 0, [], False
  try:
    async with asyncio.timeout(None) as window:
      while True:
        # The next bytes are due when the body would fall below the minimum rate.
        due = max(grace_s, (size + 1) / min_rate)
        whole_due = timeout_s <= due
        window.reschedule(start + min(timeout_s, due))
        message = await receive()
        if message["type"] == "http.disconnect":  # the client's doing: no 500, no ERROR line
          raise Refusal(499, f"the client closed its connection after {size} bytes of its "
                             "body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
          raise Refusal(413, f"the body may have at most {max_bytes} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
          return chunks[0] if len(chunks) == 1 else b"".join(chunks)
  except TimeoutError:
    if whole_due:
      raise Refusal(408, f"the body did not arrive within {timeout_s} s") from None
    took = loop.time() - start
    raise Refusal(408, f"the body arrived at {size / took:.0f} bytes/s ({size} bytes in "
                       f"{took:.1f} s); the minimum is {min_rate:.0f}") from None


async def receive_body(http_request, max_bytes: int, timeout_s: float, min_rate: float,
                       grace_s: float) -> bytes:
  """Deprecated: `read_body(http_request.receive, http_request.headers.get("content-length"),
  ...)`, which takes the ASGI `receive` (POST /score no longer builds a Starlette request)."""
  warnings.warn("admission.receive_body is deprecated; use admission.read_body with the ASGI "
                "receive and the Content-Length header", DeprecationWarning, stacklevel=2)
  return await read_body(http_request.receive, http_request.headers.get("content-length"),
                         max_bytes, timeout_s, min_rate, grace_s)
