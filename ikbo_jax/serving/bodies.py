"""`POST /score`'s wire formats: a request's body as JSON or as msgpack with raw arrays.

- `application/json`: `{"user_dense": [...], "history": [...], "cand_items":
  [...], "cand_dense": [[...], ...]}`, numbers as text.
- `application/msgpack`: a map of the same four fields, each a typed array
  `{"dtype": ..., "shape": [...], "data": bin}`: `dtype` in NumPy's
  array-interface form, byte order included (`"<f4"` for `user_dense` and
  `cand_dense`, `"<i4"` for `history` and `cand_items`), `shape` its
  dimensions (`cand_dense` is `[n, config.cand_dense]`, row-major) and `data`
  the bytes. An array of any other dtype or byte order, or whose bytes do not
  fill its shape, is refused: bare bytes would let a float64 or int64 array
  whose length happens to fit be read as float32/int32 and scored (Triton's
  binary tensors carry their datatype and shape the same way). Read straight
  into NumPy arrays with no number parsed, it is the fast path.

Both are decoded and type-checked in one pass by msgspec (C): a wrong body is a
`BodyError` that names the field. Values (ids in range, finite features, shapes
against the model) are `Request.validated`'s to check.
"""

from __future__ import annotations

import collections
import math
import re
from typing import Annotated

import msgspec
import numpy as np

from ikbo_jax.data import Request
from ikbo_jax.models import RankerConfig
from ikbo_jax.serving import msgpack_keys

JSON, MSGPACK = "application/json", "application/msgpack"
CONTENT_TYPES = (JSON, MSGPACK)
FIELDS = ("user_dense", "history", "cand_items", "cand_dense")
_DTYPES = dict(user_dense=np.dtype("<f4"), history=np.dtype("<i4"),
               cand_items=np.dtype("<i4"), cand_dense=np.dtype("<f4"))


class BodyError(ValueError):
  """The body is not a request; `status` is the HTTP status that says so (400 or 413)."""

  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status = status


# An item id as JSON text: a number past int32 is refused by its range, naming the field,
# rather than becoming a float or object array whose dtype the model then refuses.
_ItemId = Annotated[int, msgspec.Meta(ge=0, le=np.iinfo(np.int32).max)]


class _JsonBody(msgspec.Struct, forbid_unknown_fields=True):
  user_dense: list[float]
  history: list[_ItemId]
  cand_items: list[_ItemId]
  cand_dense: list[list[float]]


class _Array(msgspec.Struct, forbid_unknown_fields=True):
  dtype: str
  shape: list[int]
  data: memoryview  # a view into the body, not a copy; NumPy reads it in place


class _MsgpackBody(msgspec.Struct, forbid_unknown_fields=True):
  user_dense: _Array
  history: _Array
  cand_items: _Array
  cand_dense: _Array


# A typed decoder bounds what a body can make the server do: only the schema's depth,
# integers within 64 bits, no NaN or Infinity literals. On a 1024-item history it is ~7x
# faster than `json.loads`.
_DECODERS = {JSON: msgspec.json.Decoder(_JsonBody), MSGPACK: msgspec.msgpack.Decoder(_MsgpackBody)}
_MSGPACK_ENCODER = msgspec.msgpack.Encoder()


def decode(content_type: str, body: bytes, config: RankerConfig, max_candidates: int) -> Request:
  """The request in `body`, or a `BodyError` (400 malformed, 413 too many candidates)."""
  try:
    decoded = _DECODERS[content_type].decode(body)
  except msgspec.ValidationError as e:  # names the field: "... - at `$.history[3]`"
    raise BodyError(400, f"the body is not a request: {e}; the fields are {list(FIELDS)}"
                    ) from None
  except msgspec.DecodeError as e:
    raise BodyError(400, f"the body is not {content_type}: {e}") from None
  if content_type == MSGPACK:
    _refuse_repeated_msgpack_keys(decoded, body)
    fields = _arrays(decoded, config)
  else:
    _refuse_repeated_keys(body)
    fields = {f: getattr(decoded, f) for f in FIELDS}
  if len(fields["cand_items"]) > max_candidates:
    raise BodyError(413, f"cand_items has {len(fields['cand_items'])} candidates; a request "
                         f"may have at most {max_candidates}")
  return Request(**fields)


def _refuse_repeated_keys(body: bytes) -> None:
  """A JSON object may repeat a key, and a decoder keeps the last: refused instead.

  The decoded body's only strings are its keys (the values are numbers), each of the four
  fields once, so more than four pairs of quotes means a field appears twice.
  """
  if body.count(b'"') != 2 * len(FIELDS):
    counts = collections.Counter(re.findall(rb'"([^"]*)"', body))
    repeated = sorted(k.decode(errors="replace") for k, n in counts.items() if n > 1)
    raise BodyError(400, f"the body repeats a field ({', '.join(repeated) or 'escaped'}); "
                         f"each of {list(FIELDS)} must appear once")


def _refuse_repeated_msgpack_keys(decoded: _MsgpackBody, body: bytes) -> None:
  """A msgpack map may repeat a key, and the decoder keeps the last: refused instead.

  A body no longer than the decoded request's shortest encoding (what msgspec
  writes, ~2 us) repeats nothing: a repeated key and its first value take at
  least two bytes more. Only a longer one (another encoder's wider forms, or a
  repeat) is walked (`msgpack_keys`, ~35 us).
  """
  if len(body) <= len(_MSGPACK_ENCODER.encode(decoded)):
    return
  try:
    repeated = msgpack_keys.repeated_keys(body)
  except ValueError as e:
    raise BodyError(400, f"the body is not {MSGPACK}: {e}") from None
  if repeated:
    raise BodyError(400, f"the body repeats a field ({', '.join(map(str, repeated))}); each "
                         f"field of {list(FIELDS)} and of their typed arrays must appear once")


def _arrays(decoded: _MsgpackBody, config: RankerConfig) -> dict[str, np.ndarray]:
  fields = {}
  for name, dtype in _DTYPES.items():
    array = getattr(decoded, name)
    if array.dtype != dtype.str:
      raise BodyError(400, f"{name} has dtype {array.dtype!r}; it must be {dtype.str!r} "
                           f"({'little-endian ' + dtype.name})")
    rank = 2 if name == "cand_dense" else 1
    if len(array.shape) != rank or min(array.shape) < 0:
      raise BodyError(400, f"{name} has shape {array.shape}; it must have {rank} "
                           f"non-negative dimension{'s' if rank > 1 else ''}")
    if name == "cand_dense" and array.shape[1] != config.cand_dense:  # before any reshape
      raise BodyError(400, f"cand_dense has shape {array.shape}; its rows must have "
                           f"{config.cand_dense} features")
    if array.data.nbytes != math.prod(array.shape) * dtype.itemsize:
      raise BodyError(400, f"{name} has {array.data.nbytes} bytes; shape {array.shape} of "
                           f"{dtype.name} needs {math.prod(array.shape) * dtype.itemsize}")
    fields[name] = np.frombuffer(array.data, dtype).reshape(array.shape)
  n = fields["cand_items"].size
  if fields["cand_dense"].shape != (n, config.cand_dense):
    raise BodyError(400, f"cand_dense has shape {list(fields['cand_dense'].shape)}; {n} "
                         f"candidates of {config.cand_dense} features need "
                         f"{[n, config.cand_dense]}")
  return fields


def encode(request: Request, content_type: str = JSON) -> bytes:
  """`request` as a body of `content_type` (what a client sends)."""
  if content_type == MSGPACK:
    arrays = {f: np.ascontiguousarray(getattr(request, f), dtype) for f, dtype in _DTYPES.items()}
    return msgspec.msgpack.encode({
        f: dict(dtype=a.dtype.str, shape=list(a.shape), data=a.tobytes())
        for f, a in arrays.items()})
  if content_type == JSON:
    return msgspec.json.encode({f: np.asarray(getattr(request, f)).tolist() for f in FIELDS})
  raise ValueError(f"content_type must be one of {CONTENT_TYPES}, got {content_type!r}")
