"""Whether a Parquet file's pages carry CRC checksums, read from its first page header.

A page's checksum is an optional field of its header; pyarrow verifies it where
present (`page_checksum_verification=True`) but neither says whether it was
there nor exposes the page headers. Most writers leave it out by default
(pyarrow needs `write_page_checksum=True`; parquet-mr, Spark's writer, has
`parquet.page.write-checksum.enabled`), and then a flipped byte in a page can
change values with no error. So the header of the first page is read here: a
Thrift compact struct whose fields 1-3 are 32-bit integers (the page type and
its two sizes) and whose field 4, when present, is the CRC. A writer puts
checksums on every page or on none, so the first one speaks for the file.
"""

from __future__ import annotations

import os

import pyarrow.parquet as pq

_I32 = 5  # Thrift compact protocol type id of a 32-bit integer
_CRC_FIELD = 4


def has_page_checksums(path: str | os.PathLike) -> bool:
  """True if the first page of the file's first column chunk carries a CRC."""
  metadata = pq.ParquetFile(path).metadata
  if metadata.num_row_groups == 0 or metadata.num_columns == 0:
    return False
  chunk = metadata.row_group(0).column(0)
  offset = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
  with open(path, "rb") as f:
    f.seek(offset)
    header = f.read(64)
  return _has_crc_field(header)


def _has_crc_field(header: bytes) -> bool:
  field, at = 0, 0
  while at < len(header):
    byte = header[at]
    at += 1
    delta, kind = byte >> 4, byte & 0x0F
    if byte == 0 or delta == 0:  # the struct's end, or a field id in long form: not a CRC
      return False
    field += delta
    if field == _CRC_FIELD:
      return kind == _I32
    if field > _CRC_FIELD or kind != _I32:
      return False
    while at < len(header) and header[at] & 0x80:  # skip the integer's varint
      at += 1
    at += 1
  return False
