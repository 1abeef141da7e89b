"""A scalar ``Event`` in protobuf wire format, encoded without building protobuf objects.

Why: one ``Event``/``Summary``/``Value`` object tree per point is most of the cost of writing
scalars, and inside a training process that imported MindSpore, protobuf runs its pure-Python
implementation (about 150 us of CPU per point, holding the GIL the training thread waits for).
An event of scalars has a few fixed fields, so it is written here directly:

    Event { double wall_time = 1; int64 step = 2; Summary summary = 5; }
    Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }

The bytes decode to the same ``Event`` protobuf builds (``tests/test_scalar_event.py``);
a value beyond the float32 range becomes +-inf, as protobuf's float conversion makes it.
"""

from __future__ import annotations

import math
import struct

_F32 = struct.Struct("<f")
_F64 = struct.Struct("<d")


def encode(step: int, wall_time: float, scalars: dict[str, float]) -> bytes:
    """``Event(wall_time, step, summary=Summary(value=[Value(tag, simple_value), ...]))``."""
    values = b"".join(_field(1, _field(1, tag.encode()) + b"\x15" + _float32(value)) for tag, value in scalars.items())
    return b"\x09" + _F64.pack(wall_time) + b"\x10" + _varint(step) + _field(5, values)


def _float32(value: float) -> bytes:
    try:
        return _F32.pack(value)
    except OverflowError:  # finite but beyond float32: C's conversion, and protobuf's, give inf
        return _F32.pack(math.copysign(math.inf, value))


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (a string or an embedded message)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int64 two's complement, as protobuf encodes a negative int64
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
