"""`POST /score`'s wire formats: a request's body as JSON or as msgpack with raw arrays.

- `application/json`: `{"user_dense": [...], "history": [...], "cand_items":
  [...], "cand_dense": [[...], ...]}`, numbers as text.
- `application/msgpack`: a map of the same four fields, each a msgpack `bin`
  holding the array's bytes, little-endian: `user_dense` and `cand_dense`
  float32 (`cand_dense` row-major, `config.cand_dense` per candidate),
  `history` and `cand_items` int32. Read straight into NumPy arrays with no
  number parsed, it is the fast path (Triton's binary tensor data and
  TF-Serving's `tensor_content` are the same idea).

Both are decoded and type-checked in one pass by msgspec (C): a wrong body is a
`BodyError` that names the field. Values (ids in range, finite features, shapes
against the model) are `Request.validated`'s to check.
"""

from __future__ import annotations

import msgspec
import numpy as np

from ikbo_jax.data import Request
from ikbo_jax.models import RankerConfig

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


class _JsonBody(msgspec.Struct, forbid_unknown_fields=True):
  user_dense: list[float]
  history: list[int]
  cand_items: list[int]
  cand_dense: list[list[float]]


class _MsgpackBody(msgspec.Struct, forbid_unknown_fields=True):
  # Views into the body, not copies; NumPy reads them in place.
  user_dense: memoryview
  history: memoryview
  cand_items: memoryview
  cand_dense: memoryview


# A typed decoder bounds what a body can make the server do: only the schema's depth,
# integers within 64 bits, no NaN or Infinity literals. On a 1024-item history it is ~7x
# faster than `json.loads`.
_DECODERS = {JSON: msgspec.json.Decoder(_JsonBody), MSGPACK: msgspec.msgpack.Decoder(_MsgpackBody)}


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
    fields = _arrays(decoded, config)
  else:
    fields = {f: getattr(decoded, f) for f in FIELDS}
  if len(fields["cand_items"]) > max_candidates:
    raise BodyError(413, f"cand_items has {len(fields['cand_items'])} candidates; a request "
                         f"may have at most {max_candidates}")
  return Request(**fields)


def _arrays(decoded: _MsgpackBody, config: RankerConfig) -> dict[str, np.ndarray]:
  fields = {}
  for name, dtype in _DTYPES.items():
    raw = getattr(decoded, name)
    if raw.nbytes % dtype.itemsize:
      raise BodyError(400, f"{name} has {raw.nbytes} bytes, not a whole number of "
                           f"{dtype.itemsize}-byte {dtype.name} values")
    fields[name] = np.frombuffer(raw, dtype)
  dense, n = fields["cand_dense"], fields["cand_items"].size
  if dense.size != n * config.cand_dense:
    raise BodyError(400, f"cand_dense has {dense.size} float32 values; {n} candidates of "
                         f"{config.cand_dense} features need {n * config.cand_dense}")
  fields["cand_dense"] = dense.reshape(n, config.cand_dense)
  return fields


def encode(request: Request, content_type: str = JSON) -> bytes:
  """`request` as a body of `content_type` (what a client sends)."""
  if content_type == MSGPACK:
    return msgspec.msgpack.encode({f: np.ascontiguousarray(getattr(request, f), dtype).tobytes()
                                   for f, dtype in _DTYPES.items()})
  if content_type == JSON:
    return msgspec.json.encode({f: np.asarray(getattr(request, f)).tolist() for f in FIELDS})
  raise ValueError(f"content_type must be one of {CONTENT_TYPES}, got {content_type!r}")
