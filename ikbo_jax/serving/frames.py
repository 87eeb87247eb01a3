"""Messages between the HTTP processes and the model process, over a Unix socket.

A frame is a 4-byte big-endian length, a byte naming its codec, and one tuple.
The two messages of every request, ("score", id, request, timeout_ms) and
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
    _, request_id, request, timeout_ms, timed = message
    body = _SCORE + msgspec.msgpack.encode(
        (request_id, timeout_ms, [_array(getattr(request, f)) for f in _REQUEST_FIELDS], timed))
  elif kind == "scores":
    _, request_id, scores, marks = message
    body = _SCORES + msgspec.msgpack.encode((request_id, _array(np.asarray(scores)), marks))
  else:
    body = _PICKLE + pickle.dumps(message, protocol=5)
  if len(body) > MAX_FRAME_BYTES:
    raise ValueError(f"a frame holds at most {MAX_FRAME_BYTES} bytes, got {len(body)}")
  return _LENGTH.pack(len(body)) + body


def decode(body: bytes) -> tuple:
  codec, rest = body[:1], memoryview(body)[1:]
  if codec == _SCORE:
    request_id, timeout_ms, fields, timed = msgspec.msgpack.decode(rest)
    request = Request(**{f: _from(x) for f, x in zip(_REQUEST_FIELDS, fields)})
    return ("score", request_id, request, timeout_ms, timed)
  if codec == _SCORES:
    request_id, scores, marks = msgspec.msgpack.decode(rest)
    return ("scores", request_id, _from(scores),
            None if marks is None else [tuple(m) for m in marks])
  if codec == _PICKLE:
    return pickle.loads(rest)
  raise FrameError(f"a frame of unknown codec {bytes(codec)!r}")


async def read(reader: asyncio.StreamReader) -> tuple | None:
  """The next message, or None where the other end closed the connection between frames."""
  try:
    header = await reader.readexactly(_LENGTH.size)
  except asyncio.IncompleteReadError as e:
    if e.partial:
      raise FrameError("the connection closed inside a frame's length") from None
    return None
  (length,) = _LENGTH.unpack(header)
  if length > MAX_FRAME_BYTES:
    raise FrameError(f"a frame of {length} bytes is past the bound of {MAX_FRAME_BYTES}")
  try:
    return decode(await reader.readexactly(length))
  except asyncio.IncompleteReadError:
    raise FrameError(f"the connection closed inside a frame of {length} bytes") from None
