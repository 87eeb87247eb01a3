"""A lean HTTP/1.1 client for load generation: requests written whole on keep-alive connections.

A load generator on the server's host is part of what it measures: its CPU is the
server's CPU, and when its event loop falls behind, the answers it reads late count
as the server's latency. `WirePool` does the least a client can per request: the
request's head (a few formatted lines) is written with the body in one call to an
idle keep-alive connection, and the answer read by httptools' parser (in C,
the parser the server itself runs): status, headers, body. No cookies, redirects,
compression or TLS: it speaks to this library's servers and to a serving engine's
HTTP front on the same host, nothing else. Measured against aiohttp in
`benchmarks/load_client_cost.py`.
"""

from __future__ import annotations

import asyncio
import collections
import time
import urllib.parse
from collections.abc import Callable, Mapping

import httptools


class WireError(ConnectionError):
  """The connection closed before its answer was complete, or the answer was not HTTP."""


class _Connection(asyncio.Protocol):
  """One keep-alive connection: at most one request on it at a time. `on_lost(self)` is
  called once it is closed, by either end."""

  def __init__(self, on_lost: Callable[[_Connection], None]):
    self._on_lost = on_lost
    self.transport: asyncio.Transport | None = None
    self.idle_since = 0.0
    self._parser = httptools.HttpResponseParser(self)
    self._answer: asyncio.Future | None = None
    self._headers: dict[str, str] = {}
    self._body: list[bytes] = []

  @property
  def usable(self) -> bool:
    return self.transport is not None and not self.transport.is_closing()

  def send(self, head: bytes, body: bytes) -> asyncio.Future:
    self._answer = asyncio.get_running_loop().create_future()
    self._headers, self._body = {}, []
    self.transport.writelines((head, body))
    return self._answer

  def connection_made(self, transport: asyncio.Transport) -> None:
    self.transport = transport

  def data_received(self, data: bytes) -> None:
    try:
      self._parser.feed_data(data)
    except httptools.HttpParserError as e:
      self._fail(WireError(f"the answer is not HTTP/1.1: {e}"))
      self.transport.close()

  def on_header(self, name: bytes, value: bytes) -> None:
    self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

  def on_body(self, body: bytes) -> None:
    self._body.append(body)

  def on_message_complete(self) -> None:
    if not self._parser.should_keep_alive():
      self.transport.close()
    if self._answer is not None and not self._answer.done():
      self._answer.set_result((self._parser.get_status_code(), self._headers,
                               b"".join(self._body)))

  def connection_lost(self, exc: Exception | None) -> None:
    self._on_lost(self)
    self._fail(WireError(f"the connection closed before its answer was complete"
                         f"{f': {exc}' if exc else ''}"))

  def _fail(self, error: Exception) -> None:
    if self._answer is not None and not self._answer.done():
      self._answer.set_exception(error)


class WirePool:
  """Up to `connections` keep-alive connections to `host:port`; `request` waits for one free.

  A connection idle longer than `idle_s` is closed rather than used: a server closes
  idle connections after its keep-alive timeout, and a request written to one as it
  closes would come back a reset that the server never caused.
  """

  def __init__(self, host: str, port: int, connections: int = 256, idle_s: float = 1.0):
    if connections < 1:
      raise ValueError(f"connections must be >= 1, got {connections}")
    self.host, self.port, self.idle_s = host, port, idle_s
    self._free = asyncio.Semaphore(connections)
    self._idle: collections.deque[_Connection] = collections.deque()
    self._open: set[_Connection] = set()  # until closed: `close` closes what is left

  @classmethod
  def to(cls, url: str, connections: int = 256, idle_s: float = 1.0) -> WirePool:
    """A pool to `url`, which must be http://host:port."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None or parts.port is None:
      raise ValueError(f"url must be http://host:port, got {url!r}")
    return cls(parts.hostname, parts.port, connections, idle_s)

  async def request(self, path: str, body: bytes,
                    headers: Mapping[str, str]) -> tuple[int, dict[str, str], bytes]:
    """POSTs `body` to `path`: the answer's status, headers (names in lower case), body."""
    head = "".join([f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
                    f"content-length: {len(body)}\r\n",
                    *(f"{k}: {v}\r\n" for k, v in headers.items()), "\r\n"]).encode("latin-1")
    async with self._free:
      connection = await self._connection()
      try:
        answer = await connection.send(head, body)
      except BaseException:
        connection.transport.close()  # its answer may still come: it can carry no other
        raise
      connection.idle_since = time.monotonic()
      if connection.usable:
        self._idle.append(connection)
      return answer

  async def close(self) -> None:
    for connection in list(self._open):
      connection.transport.close()
    self._idle.clear()
    await asyncio.sleep(0)  # lets the transports finish closing

  async def _connection(self) -> _Connection:
    now = time.monotonic()
    while self._idle:
      connection = self._idle.pop()  # the most recently used: least likely to be timed out
      if connection.usable and now - connection.idle_since < self.idle_s:
        return connection
      connection.transport.close()
    _, connection = await asyncio.get_running_loop().create_connection(
        lambda: _Connection(self._open.discard), self.host, self.port)
    self._open.add(connection)
    return connection
