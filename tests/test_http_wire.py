"""The load generator's HTTP/1.1 client (`serving.http_wire`) against small raw servers."""

import asyncio

import pytest

from ikbo_jax.serving import http_wire


async def _serve(answer, connections: list):
  """A server answering each request head + body with `answer(request bytes)`: the reply's
  bytes (None for none) and whether the connection stays open after it; `connections`
  counts the connections it accepted."""

  async def handle(reader, writer):
    connections.append(writer)
    try:
      while True:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        reply, keep_open = answer(head + await reader.readexactly(length))
        if reply is not None:
          writer.write(reply)
          await writer.drain()
        if not keep_open:
          break
    except (asyncio.IncompleteReadError, ConnectionError):
      pass
    writer.close()

  server = await asyncio.start_server(handle, "127.0.0.1", 0)
  return server, server.sockets[0].getsockname()[1]


def _ok(request: bytes, extra_header: bytes = b"") -> tuple[bytes, bool]:
  body = request.split(b"\r\n\r\n", 1)[1][::-1]
  return (b"HTTP/1.1 200 OK\r\nServer-Timing: a;dur=1\r\n%scontent-length: %d\r\n\r\n%s"
          % (extra_header, len(body), body)), True


def test_answers_come_back_whole_on_reused_keep_alive_connections():
  async def run():
    connections = []
    server, port = await _serve(_ok, connections)
    pool = http_wire.WirePool("127.0.0.1", port, connections=2)
    bodies = [bytes([i]) * (1 + 50_000 * (i % 2)) for i in range(8)]  # some span many reads
    answers = await asyncio.gather(*(pool.request("/score", b, {"x-user-id": "7"})
                                     for b in bodies))
    for body, (status, headers, answer) in zip(bodies, answers):
      assert status == 200 and answer == body[::-1] and headers["server-timing"] == "a;dur=1"
    assert len(connections) == 2  # no more than the pool's bound, reused
    await pool.close()
    server.close()

  asyncio.run(run())


@pytest.mark.parametrize("reply, says", [
    (None, "closed before its answer"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", "closed before its answer"),
    (b"not http at all\r\n\r\n", "not HTTP"),
])
def test_a_broken_answer_is_a_wire_error_and_the_next_request_gets_a_fresh_connection(reply,
                                                                                      says):
  async def run():
    connections = []

    def answer(request):  # the first connection's one answer is broken, and it closes
      return (reply, False) if len(connections) == 1 else _ok(request)

    server, port = await _serve(answer, connections)
    pool = http_wire.WirePool("127.0.0.1", port, connections=1)
    with pytest.raises(http_wire.WireError, match=says):
      await asyncio.wait_for(pool.request("/score", b"abc", {}), 5)
    assert await pool.request("/score", b"abc", {}) == (
        200, {"server-timing": "a;dur=1", "content-length": "3"}, b"cba")
    assert len(connections) == 2
    await pool.close()
    server.close()

  asyncio.run(run())


def test_a_connection_the_server_closes_or_one_idle_too_long_is_not_used_again():
  async def run():
    connections = []

    def answer(request):  # the first connection's answer says it closes
      return _ok(request, b"connection: close\r\n" if len(connections) == 1 else b"")

    server, port = await _serve(answer, connections)
    pool = http_wire.WirePool("127.0.0.1", port, connections=4, idle_s=0.05)
    for _ in range(2):
      assert (await pool.request("/", b"x", {}))[0] == 200
    assert len(connections) == 2
    await asyncio.sleep(0.1)
    assert (await pool.request("/", b"x", {}))[0] == 200
    assert len(connections) == 3
    await pool.close()
    server.close()

  asyncio.run(run())


def test_a_pool_of_no_connections_is_refused():
  with pytest.raises(ValueError, match="connections must be >= 1, got 0"):
    http_wire.WirePool("127.0.0.1", 1, connections=0)


@pytest.mark.parametrize("url", ["https://127.0.0.1:8000", "http://127.0.0.1", "127.0.0.1:80"])
def test_a_pool_to_anything_but_http_host_port_is_refused(url):
  with pytest.raises(ValueError, match="url must be http://host:port"):
    http_wire.WirePool.to(url)
