"""TFRecord framing, both directions.

TensorBoard event files and MindSpore ``_MS`` summary files share this framing::

    u64 LE length | u32 LE masked_crc32c(length) | payload | u32 LE masked_crc32c(payload)

The CRC is the ``crc32c`` package's (hardware CRC32C), masked as TFRecord does; the length is
packed little-endian explicitly, unlike tensorboardX's native-order ``struct.pack('Q')``.
Reading is incremental: a record that is not complete yet is *not an error*, because the
file we read may still be growing; the caller simply retries later from the same offset.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import BinaryIO, Iterator

from crc32c import crc32c

_LEN = struct.Struct("<Q")
_CRC = struct.Struct("<I")
HEADER_BYTES = 12
FOOTER_BYTES = 4
# A record larger than this is treated as corruption, not as a record to wait for.
MAX_RECORD_BYTES = 256 * 1024 * 1024


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC32C: rotated right by 15 bits plus a constant."""
    crc = crc32c(data)
    return ((crc >> 15 | crc << 17) + 0xA282EAD8) & 0xFFFFFFFF


def frame(payload: bytes) -> bytes:
    """Return one framed record for ``payload``."""
    size = len(payload)
    header = _HEADERS.get(size)
    if header is None:
        length = _LEN.pack(size)
        header = length + _CRC.pack(masked_crc32c(length))
        if len(_HEADERS) < _MAX_HEADERS:
            _HEADERS[size] = header
    return b"".join((header, payload, _CRC.pack(masked_crc32c(payload))))


# The events of one run repeat a few sizes: the length and its CRC are made once per size.
_HEADERS: dict[int, bytes] = {}
_MAX_HEADERS = 4096


class CorruptRecord(Exception):
    """A record whose length or CRC does not check out (permanent for that file offset)."""


@dataclass(frozen=True)
class Record:
    """A complete payload and the file offsets it spans."""

    start: int
    end: int
    payload: bytes


def iter_records(fh: BinaryIO, offset: int = 0) -> Iterator[Record]:
    """Yield every complete record from ``offset`` on; stop silently at a partial tail.

    Raises :class:`CorruptRecord` (with ``.args[1]`` the bad record's offset) when the
    length CRC or the payload CRC fails: the caller decides whether to resync or give up.
    """
    fh.seek(offset)
    while True:
        header = fh.read(HEADER_BYTES)
        if len(header) < HEADER_BYTES:
            return
        (length,) = _LEN.unpack_from(header)
        (len_crc,) = _CRC.unpack_from(header, 8)
        if len_crc != masked_crc32c(header[:8]) or length > MAX_RECORD_BYTES:
            raise CorruptRecord("bad length CRC", offset)
        body = fh.read(length + FOOTER_BYTES)
        if len(body) < length + FOOTER_BYTES:
            return
        payload = body[:length]
        (data_crc,) = _CRC.unpack_from(body, length)
        if data_crc != masked_crc32c(payload):
            raise CorruptRecord("bad data CRC", offset)
        end = offset + HEADER_BYTES + length + FOOTER_BYTES
        yield Record(offset, end, payload)
        offset = end


def whole_records(buf: bytes | memoryview) -> tuple[int, int]:
    """(end of the whole records at the start of ``buf``, size of the record cut at that end, or 0).

    Checks each length's CRC (not the payloads': they were checked when written) so that a cut
    never falls inside a record. Raises :class:`CorruptRecord` with the offset of a bad length."""
    pos, size = 0, len(buf)
    while pos + HEADER_BYTES <= size:
        (length,) = _LEN.unpack_from(buf, pos)
        (len_crc,) = _CRC.unpack_from(buf, pos + 8)
        if len_crc != masked_crc32c(bytes(buf[pos:pos + 8])) or length > MAX_RECORD_BYTES:
            raise CorruptRecord("bad length CRC", pos)
        end = pos + HEADER_BYTES + length + FOOTER_BYTES
        if end > size:
            return pos, end - pos
        pos = end
    return pos, (HEADER_BYTES if pos < size else 0)
