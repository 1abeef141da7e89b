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

import struct

from parsers.values import float32

_WALL_TIME = struct.Struct("<cdc")  # the wall_time field, and the step field's key
_SMALL = [bytes((n,)) for n in range(0x80)]


def encode(step: int, wall_time: float, scalars: dict[str, float]) -> bytes:
    """``Event(wall_time, step, summary=Summary(value=[Value(tag, simple_value), ...]))``."""
    names = tuple(scalars)
    layout = _LAYOUTS.get(names)
    if layout is None:
        layout = _layout(names)
        if len(_LAYOUTS) < _MAX_LAYOUTS:
            _LAYOUTS[names] = layout
    heads_and_floats, packer = layout
    args = heads_and_floats.copy()
    args[1::2] = scalars.values()
    try:
        summary = packer.pack(*args)
    except OverflowError:  # finite but beyond float32: C's conversion, and protobuf's, give inf
        summary = b"".join(head + float32(value) for head, value in zip(args[0::2], scalars.values()))
    return b"".join((_WALL_TIME.pack(b"\x09", wall_time, b"\x10"), _varint(step), b"\x2a", _varint(len(summary)), summary))


# The tags of one record repeat on every step: their bytes up to each float are made once, with
# one ``Struct`` that lays out all of them and the floats in between (packed in one call).
_LAYOUTS: dict[tuple[str, ...], tuple[list[bytes | float], struct.Struct]] = {}
_MAX_LAYOUTS = 1024  # tags come from log content: the cache must not grow without bound


def _layout(names: tuple[str, ...]) -> tuple[list[bytes | float], struct.Struct]:
    """The arguments of the layout's ``Struct`` (each tag's head, then a place for its float)."""
    heads = [_head(tag) for tag in names]
    return [x for head in heads for x in (head, 0.0)], struct.Struct("<" + "".join(f"{len(head)}sf" for head in heads))


def _head(tag: str) -> bytes:
    """A ``Value``'s field header, its ``tag`` field and the ``simple_value`` key: all but the float."""
    name = _field(1, tag.encode())
    return _varint(1 << 3 | 2) + _varint(len(name) + 5) + name + b"\x15"


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (a string or an embedded message)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(n: int) -> bytes:
    if 0 <= n < 0x80:
        return _SMALL[n]
    if 0 < n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    if n < 0:
        n += 1 << 64  # int64 two's complement, as protobuf encodes a negative int64
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
