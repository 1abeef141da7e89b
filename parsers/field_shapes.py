"""The fast path for step-record fields: a tail of the same shape as a recent one, read by one regex.

A training log prints the same ``key: value, key: value, ...`` list on every step, with other
numbers. :func:`parsers.values.split_fields` and :func:`parsers.values.parse_number` take each
field apart in Python; here the keys of a tail the full parser has read become one compiled
regex (its *shape*), and a later tail that the regex matches in full is read in one call.

What a shape accepts, per field, in the order and with the key text of the tail it was learned
from: a number (``4.2``, ``-1.5e-07``), a number with a unit suffix (``2831ms``, ``193.6T``,
``12.5s``) or a one-element array (``[0.91]``) for a metric key; ``True``/``False`` (``[ True]``)
for ``overflow cond`` / ``finite_grads``; any text without commas or brackets for a key that is
no metric. For exactly those forms :func:`split_fields` splits where the shape does and
:func:`parse_number` returns ``float()`` of the digits, so the result is the full parser's.
Anything else (``N/A``, ``[cur/avg]``, ``NaN``, ``None``, a field more or less, another key) does
not match, and the caller uses the full parser, which then teaches a shape for the new tail.

Shapes are a cache (the last :data:`KEEP` that matched are tried), so results depend on the
text alone, never on what came before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from parsers.tags import KEY_TAGS, tag_for_key

KEEP = 4
FLAGS = ("overflow cond", "finite_grads")  # booleans, not metrics (see parsers.step_lines)
_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_METRIC = rf"\s*(?:\[ *({_NUM}) *\]|({_NUM})(?:ms|T|s)?)\s*"
_BOOL = r"\s*(?:\[ *(True|False) *\]|(True|False))\s*"
_OTHER = r"[^,\[\]()]*"
_KEY = re.compile(r"[^,:\[\]()]+")


@dataclass(slots=True)
class Fields:
    """What :mod:`parsers.step_lines` takes from a tail: the metric values by tag, in order, whether
    the step overflowed (the last of the boolean keys decides), and whether it has ``overflow cond``."""

    scalars: dict[str, float]
    overflow: bool
    overflow_cond: bool


class _Shape:
    def __init__(self, raw_keys: list[str]) -> None:
        parts: list[str] = []
        self.plan: list[tuple[str, str | None]] = []  # (lower-cased key, tag) per two groups
        for raw in raw_keys:
            key = raw.strip().lower()
            if key in FLAGS:
                parts.append(re.escape(raw) + ":" + _BOOL)
                self.plan.append((key, None))
                continue
            tag = KEY_TAGS.get(key) or tag_for_key(key)
            if tag is None:
                parts.append(re.escape(raw) + ":" + _OTHER)
            else:
                parts.append(re.escape(raw) + ":" + _METRIC)
                self.plan.append((key, tag))
        self.regex = re.compile(", ".join(parts))
        self.overflow_cond = any(key == FLAGS[0] for key, _ in self.plan)

    def read(self, tail: str) -> Fields | None:
        m = self.regex.fullmatch(tail)
        if m is None:
            return None
        groups = m.groups()
        scalars: dict[str, float] = {}
        overflow = False
        for i, (key, tag) in enumerate(self.plan):
            raw = groups[2 * i] or groups[2 * i + 1]
            if tag is not None:
                scalars[tag] = float(raw)
            elif key == FLAGS[0]:
                overflow = raw == "True"
            else:
                overflow = raw == "False"  # finite_grads: False means the step overflowed
        return Fields(scalars, overflow, self.overflow_cond)


_shapes: list[_Shape] = []  # the last KEEP shapes that matched, newest first
_known: dict[tuple[str, ...], _Shape] = {}  # every shape built (bounded), matching or not
_MAX_KNOWN = 64


def read_fields(tail: str) -> Fields | None:
    """The fields of ``tail`` if a recent shape matches it in full, else ``None``."""
    for shape in _shapes:
        fields = shape.read(tail)
        if fields is not None:
            return fields
    return None


def learn(tail: str) -> None:
    """Remember the shape of a tail the full parser has read (if its fields have simple keys)."""
    raw_keys = []
    for part in tail.split(", "):
        key, sep, _ = part.partition(":")
        if not sep or not _KEY.fullmatch(key):
            return
        raw_keys.append(key)
    shape = _known.get(tuple(raw_keys))
    if shape is None:
        if len(_known) >= _MAX_KNOWN:
            _known.clear()
        shape = _known[tuple(raw_keys)] = _Shape(raw_keys)
    if shape.read(tail) is None:
        return  # a value of another form (``N/A``, ``[cur/avg]``): the full parser reads these
    _shapes.insert(0, shape)
    del _shapes[KEEP:]
