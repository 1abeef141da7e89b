"""The value grammar of mindformers step records, and the field splitter.

Values arrive as ``str()`` of Python/numpy objects: ``2.5``, ``  nan``, ``[1.5624999e-05]``,
``[0.51 0.49]``, ``None``, ``unavailable``, ``1893ms``, ``488.201 ms``, ``238.114T``,
``(2.5e-06,2.5e-06,)``. Anything that is not exactly one number is "no value", never a guess.

Values that do not fit, decided per kind (a poison line must never raise):

- counts (step, epoch, steps per epoch) must fit a signed 64-bit integer, TensorBoard's step
  type; :func:`parse_int64` says ``None`` otherwise and the line parsers then call the line
  malformed (counted and skipped), since a step cannot be rounded to another step;
- a metric value beyond the float range (``1e400``, a 400-digit number) is ``+inf``/``-inf``,
  which is what the printed number means; it is written, and the alerts report a non-finite
  loss or grad norm like any other. One finite as a double but beyond float32 (``1e39``) is
  kept as read; every event stores it as float32, i.e. as ``+inf``/``-inf``, and so does the
  record's identity (:mod:`parsers.identity`); :func:`float32` is that conversion.
"""

from __future__ import annotations

import math
import re
import struct

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_INT64_DIGITS = len(str(INT64_MAX))
_INT64_TEXT = re.compile(rf"\s*([+-]?)0*(\d{{1,{_INT64_DIGITS}}})\s*")

_NON_NUMBERS = frozenset({"", "none", "unavailable", "n/a"})
_UNIT_SUFFIXES = ("ms", "T", "s")


def parse_number(text: str) -> float | None:
    """One number from a printed value, or ``None`` when it is not exactly one number."""
    if text[-1:].isdigit():  # most values are plain numbers: what float() takes needs no rule below
        try:
            return float(text)
        except ValueError:
            pass
    s = text.strip()
    if s[:1] in "[(":
        s = s[1:-1].strip() if s[-1:] in "])" else s[1:].strip()
        if s.endswith(","):  # a one-element tuple, or the experimental trainer's lr tuple
            s = s[:-1]
        if "," in s:
            s = s.split(",", 1)[0]
        elif " " in s:
            return None  # a multi-element numpy array
    for suffix in _UNIT_SUFFIXES:
        if s.endswith(suffix) and len(s) > len(suffix):
            s = s[: -len(suffix)].rstrip()
            break
    if s.lower() in _NON_NUMBERS:
        return None
    try:
        value = float(s)
    except ValueError:
        return None
    return value


def parse_int64(text: str) -> int | None:
    """A decimal integer that fits int64, else ``None``.

    Matched by length before ``int()``, which raises on more than 4300 digits (leading zeros
    included).
    """
    if len(text) < _INT64_DIGITS and text.isascii() and text.isdigit():  # the common case, in range
        return int(text)
    m = _INT64_TEXT.fullmatch(text)
    if m is None:
        return None
    value = int(m.group(1) + m.group(2))
    return value if fits_int64(value) else None


def fits_int64(value: int) -> bool:
    return INT64_MIN <= value <= INT64_MAX


def parse_bool(text: str) -> bool | None:
    """``True``/``False`` or numpy's ``[ True]``; ``None`` for anything else."""
    s = text.strip(" []")
    if s == "True":
        return True
    if s == "False":
        return False
    return None


def split_fields(text: str) -> list[tuple[str, str]]:
    """Split ``key: value, key:value, ...`` into pairs, ignoring commas inside ``[]``/``()``.

    Keys are returned lower-cased (``Loss_scale`` -> ``loss_scale``); a part without a colon
    gets the empty key. Unknown keys are kept: new ones appear release by release.
    """
    pairs: list[tuple[str, str]] = []
    pending = ""
    for part in text.split(", "):
        if pending:
            part = f"{pending}, {part}"
        if ("[" in part or "(" in part) and (part.count("[") > part.count("]") or part.count("(") > part.count(")")):
            pending = part  # a ", " inside brackets or parentheses: keep joining
            continue
        pending = ""
        key, sep, value = part.partition(":")
        pairs.append((key.strip().lower(), value.strip()) if sep else ("", part.strip()))
    if pending:
        key, sep, value = pending.partition(":")
        pairs.append((key.strip().lower(), value.strip()) if sep else ("", pending.strip()))
    return pairs


_F32 = struct.Struct("<f")


def float32(value: float) -> bytes:
    """``value`` as the 4 bytes of a float32, as protobuf stores it: a finite value beyond the
    float32 range is +-inf (never an ``OverflowError``), one below its smallest subnormal is +-0."""
    try:
        return _F32.pack(value)
    except OverflowError:
        return _F32.pack(math.copysign(math.inf, value))
