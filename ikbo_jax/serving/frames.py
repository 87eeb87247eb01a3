"""Messages between the HTTP processes and the model process, over a Unix socket.

A frame is a 4-byte big-endian length, a byte naming its codec, and one tuple.
The two messages of every request, ("score", id, request, deadline, timed) and
("scores", id, scores), are msgpack (msgspec, in C) with each array as its
dtype, shape and raw bytes, read back in place by `np.frombuffer`: 14 us to
encode and decode a request of 64 candidates, where pickle takes 29 us
(`benchmarks/model_process_cost.py`), and the model process, which reads every
request of every HTTP process, has least time to spare. The rare control
messages are pickles. Pickle is safe here only because both ends are this
server's own processes: the socket lives in a directory only its user can open
(`private_socket_path`), and no frame ever comes from a client (the HTTP
processes decode and validate every body before a `Request` is framed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pickle
import struct
import tempfile
from collections.abc import Callable

import msgspec
import numpy as np

from ikbo_jax.data import Request

_LENGTH = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 30
_PICKLE, _SCORE, _SCORES = b"P", b"R", b"S"
_REQUEST_FIELDS = tuple(f.name for f in dataclasses.fields(Request))


class FrameError(ConnectionError):
  """The other end sent something that is not a frame, or went away mid-frame."""


def private_socket_path(name: str = "model.sock") -> str:
  """A path for a Unix socket in a fresh directory that only this user can enter."""
  directory = tempfile.mkdtemp(prefix="ikbo-serving-")  # mode 0o700
  return os.path.join(directory, name)


def _array(x) -> tuple | None:
  """An array (or a JSON body's list) as (dtype, shape, its bytes)."""
  if x is None:
    return None
  x = np.ascontiguousarray(x)
  return x.dtype.str, x.shape, memoryview(x).cast("B")


def _from(field) -> np.ndarray | None:
  if field is None:
    return None
  dtype, shape, data = field
  return np.frombuffer(data, dtype).reshape(shape)


def encode(message: tuple) -> bytes:
  kind = message[0]
  if kind == "score":
    _, request_id, request, deadline, timed = message
    body = _SCORE + msgspec.msgpack.encode(
        (request_id, deadline, [_array(getattr(request, f)) for f in _REQUEST_FIELDS], timed))
  elif kind == "scores":
    _, request_id, scores, marks = message
    body = _SCORES + msgspec.msgpack.encode((request_id, _array(np.asarray(scores)), marks))
  else:
    body = _PICKLE + pickle.dumps(message, protocol=5)
  if len(body) > MAX_FRAME_BYTES:
    raise ValueError(f"a frame holds at most {MAX_FRAME_BYTES} bytes, got {len(body)}")
  return _LENGTH.pack(len(body)) + body


def decode(body: bytes) -> tuple:
  codec, rest = bytes(body[:1]), memoryview(body)[1:]
  if codec == _SCORE:
    request_id, deadline, fields, timed = msgspec.msgpack.decode(rest)
    request = Request(*map(_from, fields))  # `_REQUEST_FIELDS`' order, as encoded
    return ("score", request_id, request, deadline, timed)
  if codec == _SCORES:
    request_id, scores, marks = msgspec.msgpack.decode(rest)
    return ("scores", request_id, _from(scores),
            None if marks is None else [tuple(m) for m in marks])
  if codec == _PICKLE:
    return pickle.loads(rest)
  raise FrameError(f"a frame of unknown codec {bytes(codec)!r}")


class FrameParser:
  """Splits a byte stream into messages: `feed` it what arrives, it returns what that completes.

  A frame that arrives in pieces waits whole in one buffer, appended to, never copied
  again until it is complete (a frame of a gigabyte arrives in thousands of reads).
  """

  def __init__(self):
    self._partial = bytearray()
    self._needed = _LENGTH.size  # bytes `_partial` must hold before a frame can end in it

  @property
  def inside_a_frame(self) -> bool:
    return bool(self._partial)

  def feed(self, data: bytes) -> list[tuple]:
    if self._partial:
      self._partial += data
      if len(self._partial) < self._needed:
        return []
      data, self._partial = bytes(self._partial), bytearray()
    messages, offset, end = [], 0, len(data)
    view = memoryview(data)
    while end - offset >= _LENGTH.size:
      (length,) = _LENGTH.unpack_from(data, offset)
      if length > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {length} bytes is past the bound of {MAX_FRAME_BYTES}")
      if end - offset - _LENGTH.size < length:
        break
      start = offset + _LENGTH.size
      messages.append(decode(view[start:start + length]))
      offset = start + length
    if offset < end:
      self._partial = bytearray(view[offset:])
      self._needed = (_LENGTH.size + length if end - offset >= _LENGTH.size else _LENGTH.size)
    return messages


class FrameProtocol(asyncio.Protocol):
  """A connection's messages, each to `on_message` as its frame completes; `on_closed` once.

  `on_closed(error)` gets None where the other end closed between frames, else the
  `FrameError` or `OSError` that ended the connection. A protocol rather than
  `asyncio.StreamReader`: the model process reads every request of every HTTP process,
  and two `readexactly` awaits a frame were ~15% of its event loop's work at 8,000
  requests a second, where `data_received` decodes every frame a read completes at once.
  """

  def __init__(self, on_message: Callable[[tuple], None],
               on_closed: Callable[[Exception | None], None]):
    self._on_message, self._on_closed = on_message, on_closed
    self._parser = FrameParser()
    self._error: Exception | None = None
    self.transport: asyncio.Transport | None = None

  def connection_made(self, transport: asyncio.Transport) -> None:
    self.transport = transport

  def data_received(self, data: bytes) -> None:
    if self._error is not None:
      return
    try:
      messages = self._parser.feed(data)
    except FrameError as e:
      self._error = e
      self.transport.close()
      return
    for message in messages:
      self._on_message(message)

  def eof_received(self) -> None:
    if self._error is None and self._parser.inside_a_frame:
      self._error = FrameError("the connection closed inside a frame")

  def connection_lost(self, exc: Exception | None) -> None:
    self._on_closed(self._error or exc)
