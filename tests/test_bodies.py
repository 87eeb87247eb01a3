"""`POST /score`'s wire formats (`serving.bodies`): every request survives both, and no body,
however broken, gets anything but a `BodyError` or a `RequestError` naming what is wrong."""

import hypothesis
import msgspec
import numpy as np
import pytest
from hypothesis import strategies as st

from ikbo_jax.data import RequestError
from ikbo_jax.data.synthetic import ClickGenerator
from ikbo_jax.models import RankerConfig
from ikbo_jax.serving import bodies

CONFIG = RankerConfig(num_items=300, max_history=16)
REQUESTS = ClickGenerator(CONFIG, seed=5, mean_candidates=4, max_candidates=12).requests(40)


@pytest.mark.parametrize("content_type", bodies.CONTENT_TYPES)
def test_every_request_comes_back_as_it_was_sent(content_type):
  for sent in REQUESTS:
    got = bodies.decode(content_type, bodies.encode(sent, content_type), CONFIG, 100)
    got, sent = got.validated(CONFIG), sent.validated(CONFIG)
    for field in bodies.FIELDS:
      np.testing.assert_array_equal(getattr(got, field), getattr(sent, field), err_msg=field)


def _packed(**fields) -> bytes:
  request = bodies.encode(REQUESTS[0], bodies.MSGPACK)
  return msgspec.msgpack.encode({**msgspec.msgpack.decode(request), **fields})


def _array(dtype, shape, nbytes=None):
  size = int(np.prod(shape)) * np.dtype(dtype).itemsize
  return dict(dtype=np.dtype(dtype).str, shape=list(shape), data=b"\0" * (nbytes or size))


_HISTORY = len(REQUESTS[0].history)


@pytest.mark.parametrize("body, status, named", [
    (_packed(history=_array("<i4", [2], nbytes=6)), 400, "history has 6 bytes; shape [2]"),
    (_packed(cand_dense=_array("<f4", [1, 1])), 400, "cand_dense has shape [1, 1]"),
    (_packed(history=_array("<i8", [_HISTORY])), 400, "history has dtype '<i8'; it must be '<i4'"),
    (_packed(user_dense=_array(">f4", [CONFIG.user_dense])), 400,
     "user_dense has dtype '>f4'"),
    (_packed(user_dense=_array("<f8", [CONFIG.user_dense // 2])), 400,
     "user_dense has dtype '<f8'"),
    (_packed(history=_array("<i4", [2, 1])), 400, "history has shape [2, 1]; it must have 1"),
    (_packed(history=b"\0" * 8), 400, "`$.history`"),  # bare bytes: the dtype is not said
    (_packed(history="text"), 400, "`$.history`"),
    (_packed(extra=b""), 400, "unknown field `extra`"),
    (_packed(cand_items=_array("<i4", [101]), cand_dense=_array("<f4", [101, CONFIG.cand_dense])),
     413, "101 candidates"),
    (b"\xc1", 400, "not application/msgpack"),
])
def test_a_broken_msgpack_body_names_its_fault(body, status, named):
  with pytest.raises(bodies.BodyError) as raised:
    bodies.decode(bodies.MSGPACK, body, CONFIG, 100)
  assert raised.value.status == status and named in str(raised.value), str(raised.value)


def test_non_finite_features_in_raw_bytes_are_the_requests_error():
  nan = np.full(CONFIG.user_dense, np.nan, np.float32)
  user_dense = dict(dtype="<f4", shape=[CONFIG.user_dense], data=nan.tobytes())
  request = bodies.decode(bodies.MSGPACK, _packed(user_dense=user_dense), CONFIG, 100)
  with pytest.raises(RequestError, match="user_dense must be finite"):
    request.validated(CONFIG)


def test_an_unknown_content_type_is_refused_when_encoding():
  with pytest.raises(ValueError, match="content_type must be one of"):
    bodies.encode(REQUESTS[0], "text/plain")


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner,
                                                                max_size=3),
    max_leaves=12)


def _field_values(content_type: str):
  """What a client might put in a field: anything JSON holds, or raw bytes of any length."""
  if content_type == bodies.JSON:
    return _JSON_VALUES | st.lists(st.integers(-5, 400), max_size=20)
  return (st.binary(max_size=64) | st.builds(lambda n: b"\0" * n, st.integers(0, 400))
          | _JSON_VALUES)


def _corrupted(data, content_type: str) -> bytes:
  """A request's body with fields replaced, dropped or added, then bytes flipped, cut or added."""
  request = data.draw(st.sampled_from(REQUESTS))
  encoded = bodies.encode(request, content_type)
  codec = msgspec.json if content_type == bodies.JSON else msgspec.msgpack
  fields = codec.decode(encoded)
  for _ in range(data.draw(st.integers(0, 3))):
    name = data.draw(st.sampled_from((*bodies.FIELDS, "extra")))
    if data.draw(st.booleans()):
      fields.pop(name, None)
    else:
      fields[name] = data.draw(_field_values(content_type))
  body = bytearray(codec.encode(fields))
  for _ in range(data.draw(st.integers(0, 2))):
    at = data.draw(st.integers(0, max(len(body) - 1, 0)))
    kind = data.draw(st.sampled_from(("flip", "cut", "extend")))
    if kind == "flip" and body:
      body[at] = data.draw(st.integers(0, 255))
    elif kind == "cut":
      del body[at:]
    else:
      body[at:at] = data.draw(st.binary(max_size=8))
  return bytes(body)


@hypothesis.settings(max_examples=400, deadline=None, derandomize=True)
@hypothesis.given(content_type=st.sampled_from(bodies.CONTENT_TYPES), data=st.data())
def test_any_corruption_of_a_body_is_a_clear_error_or_a_valid_request(content_type, data):
  body = _corrupted(data, content_type)
  try:
    request = bodies.decode(content_type, body, CONFIG, 100).validated(CONFIG)
  except (bodies.BodyError, RequestError) as e:
    assert str(e)
  else:  # what passes is a request the model takes
    assert request.user_dense.shape == (CONFIG.user_dense,) and request.num_candidates >= 1
    assert request.cand_dense.shape == (request.num_candidates, CONFIG.cand_dense)


def _raw_map(pairs, header=None) -> bytes:
  """A msgpack map of already-encoded `(key, value)` byte pairs, repeats allowed."""
  head = header if header is not None else bytes([0x80 | len(pairs)])
  return head + b"".join(k + v for k, v in pairs)


def _pairs(body: bytes) -> list[tuple[bytes, bytes]]:
  return [(msgspec.msgpack.encode(k), msgspec.msgpack.encode(v))
          for k, v in msgspec.msgpack.decode(body).items()]


def _str8(text: str) -> bytes:
  return bytes([0xd9, len(text)]) + text.encode()


def test_a_repeated_msgpack_field_is_refused_naming_it():
  """A repeated key (the decoder would keep the last) at the top, inside a typed array, and
  spelled two ways (`fixstr` then `str8`)."""
  pairs = _pairs(bodies.encode(REQUESTS[0], bodies.MSGPACK))
  history = dict(pairs)[msgspec.msgpack.encode("history")]
  user = msgspec.msgpack.decode(dict(pairs)[msgspec.msgpack.encode("user_dense")])
  # `"dtype": "<f8"` first, then the typed array's own three entries: its "<f4" wins.
  twice_dtype = bytes([0x84]) + msgspec.msgpack.encode("dtype") + msgspec.msgpack.encode(
      "<f8") + msgspec.msgpack.encode(user)[1:]
  cases = {
      "history": _raw_map([*pairs, (msgspec.msgpack.encode("history"), history)]),
      "history spelled twice": _raw_map([*pairs, (_str8("history"), history)]),
      "dtype": _raw_map([(k, twice_dtype if k == msgspec.msgpack.encode("user_dense") else v)
                         for k, v in pairs]),
  }
  for case, body in cases.items():
    with pytest.raises(bodies.BodyError) as raised:
      bodies.decode(bodies.MSGPACK, body, CONFIG, 100)
    named = "dtype" if case == "dtype" else "history"
    assert raised.value.status == 400 and f"repeats a field ({named})" in str(raised.value), case


def test_wider_msgpack_forms_without_repeats_are_accepted():
  """Another encoder's map16 header and str8 keys: longer than msgspec's, no repeat."""
  sent = REQUESTS[1]
  pairs = [(_str8(msgspec.msgpack.decode(k)), v)
           for k, v in _pairs(bodies.encode(sent, bodies.MSGPACK))]
  body = _raw_map(pairs, header=bytes([0xde, 0, len(pairs)]))
  got = bodies.decode(bodies.MSGPACK, body, CONFIG, 100)
  np.testing.assert_array_equal(got.history, sent.history)


def test_a_huge_empty_shape_is_refused_before_any_reshape():
  body = _packed(cand_items=_array("<i4", [0]),
                 cand_dense=dict(dtype="<f4", shape=[0, 2**62], data=b""))
  with pytest.raises(bodies.BodyError) as raised:
    bodies.decode(bodies.MSGPACK, body, CONFIG, 100)
  assert raised.value.status == 400 and "its rows must have" in str(raised.value)
