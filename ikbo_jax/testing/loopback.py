"""An ASGI app served by uvicorn on a free loopback port, in a thread, for tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

import uvicorn


class Loopback(NamedTuple):
  url: str  # the base URL
  server: uvicorn.Server  # `server.should_exit = True` starts its graceful shutdown, as SIGTERM
  thread: threading.Thread


def free_port() -> int:
  """A loopback port nothing listens on now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def serving(app, server_class: type[uvicorn.Server] = uvicorn.Server,
            **config) -> Iterator[Loopback]:
  """Runs `app` on a `server_class` until the block ends. `config` goes to `uvicorn.Config`."""
  port = free_port()
  config = dict(log_level="warning", **config)
  server = server_class(uvicorn.Config(app, host="127.0.0.1", port=port, **config))
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  try:
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
      time.sleep(0.02)
    if not server.started:
      raise RuntimeError(f"uvicorn did not start on port {port} within 30 s")
    yield Loopback(f"http://127.0.0.1:{port}", server, thread)
  finally:
    server.should_exit = True
    thread.join(timeout=30)
