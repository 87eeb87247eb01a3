"""The keys a msgpack body repeats within one map.

msgpack lets a map repeat a key, and decoders keep one of the values (msgspec
and msgpack-python the last) without saying so: a proxy that reads the first
would see another request than the model scores. No decoder we could use reports
a repeat, so this walks the body's structure itself: map and array headers are
read, strings, binaries and numbers skipped by their lengths, and each map's keys
compared decoded (a key spelled as `fixstr` and as `str8` is the same key).
"""

from __future__ import annotations

import msgspec

# Type bytes whose payload has a fixed size: nil, booleans, floats, integers, fixext.
_FIXED = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8,
          0xd0: 1, 0xd1: 2, 0xd2: 4, 0xd3: 8, 0xd4: 2, 0xd5: 3, 0xd6: 5, 0xd7: 9, 0xd8: 17}
# bin, str and ext: the width of their length field, and ext's type byte.
_SIZED = {0xc4: (1, 0), 0xc5: (2, 0), 0xc6: (4, 0), 0xd9: (1, 0), 0xda: (2, 0), 0xdb: (4, 0),
          0xc7: (1, 1), 0xc8: (2, 1), 0xc9: (4, 1)}
# array16/32 and map16/32: the width of their count, and the objects in one entry.
_COUNTED = {0xdc: (2, 1), 0xdd: (4, 1), 0xde: (2, 2), 0xdf: (4, 2)}


def repeated_keys(body: bytes) -> list:
  """The keys that some map of `body` (one msgpack object, already decoded once) repeats.

  Raises `ValueError` where `body` is not well-formed msgpack.
  """
  found: list = []
  try:
    end = _skip(memoryview(body), 0, found)
  except (IndexError, KeyError) as e:
    raise ValueError(f"not one msgpack object ({type(e).__name__})") from None
  if end != len(body):
    raise ValueError(f"{len(body) - end} bytes follow the msgpack object")
  return found


def _skip(body: memoryview, i: int, found: list) -> int:
  """The offset just past the object at `i`; a map's repeated keys go to `found`."""
  b = body[i]
  if b < 0x80 or b >= 0xe0:  # positive and negative fixint
    return i + 1
  if b < 0xa0:  # fixmap, fixarray
    count, per_entry, i = b & 0x0f, 2 if b < 0x90 else 1, i + 1
  elif b < 0xc0:  # fixstr
    return i + 1 + (b & 0x1f)
  elif b in _FIXED:
    return i + 1 + _FIXED[b]
  elif b in _SIZED:
    width, type_byte = _SIZED[b]
    return i + 1 + width + type_byte + int.from_bytes(body[i + 1:i + 1 + width], "big")
  else:
    width, per_entry = _COUNTED[b]
    count, i = int.from_bytes(body[i + 1:i + 1 + width], "big"), i + 1 + width
  keys = set()
  for _ in range(count):
    start = i
    i = _skip(body, i, found)
    if per_entry == 2:
      key = msgspec.msgpack.decode(body[start:i])
      if key in keys:
        found.append(key)
      keys.add(key)
      i = _skip(body, i, found)
  return i
