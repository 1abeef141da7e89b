"""The fast path for step-record fields: a tail of the same shape as a recent one, read by one regex.

A training log prints the same ``key: value, key: value, ...`` list on every step, with other
numbers. :func:`parsers.values.split_fields` and :func:`parsers.values.parse_number` take each
field apart in Python; here the keys of a tail the full parser has read become one compiled
regex (its *shape*), and a later tail that the regex matches in full is read in one call.

What a shape accepts, per field, in the order and with the key text of the tail it was learned
from: a number (``4.2``, ``-1.5e-07``), a number with a unit suffix (``2831ms``, ``193.6T``,
``12.5s``) or a one-element array (``[0.91]``) for a metric key; ``True``/``False`` (``[ True]``)
for ``overflow cond`` / ``finite_grads``; any text without commas or brackets for a key that is
no metric. A number is any run of ``-+.0-9eE`` that ``float()`` takes: one cheap character class
for the regex, and ``float()`` as the judge (``1.2.3`` makes the whole tail not match). For
exactly those forms :func:`split_fields` splits where the shape does and :func:`parse_number`
returns ``float()`` of the same text, so the result is the full parser's. Anything else (``N/A``,
``[cur/avg]``, ``NaN``, ``None``, a field more or less, another key) does not match, and the
caller uses the full parser, which then teaches a shape for the new tail.

Shapes are a cache (the last :data:`KEEP` that matched are tried), so results depend on the
text alone, never on what came before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from parsers.tags import KEY_TAGS, tag_for_key

KEEP = 4
FLAGS = ("overflow cond", "finite_grads")  # booleans, not metrics (see parsers.step_lines)
# Two groups per value: an opening bracket, which ``(?(n)...)`` then closes (else a unit may
# follow), and the value; {n} is the number of the bracket's group.
_METRIC = r" *(\[ *)?([-+.0-9eE]+)(?({n}) *\]|(?:ms|T|s)?) *"
_BOOL = r" *(\[ *)?(True|False)(?({n}) *\]) *"
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
        self.tags: list[str] = []
        self.values: list[int] = []  # the index in ``groups()`` of each metric's value
        self.flags: list[tuple[int, bool]] = []  # (index, whether "True" means overflowed: not for finite_grads)
        for raw in raw_keys:
            key = raw.strip().lower()
            bracket = 2 * (len(self.values) + len(self.flags)) + 1  # group number; the value's index is the same
            if key in FLAGS:
                parts.append(re.escape(raw) + ":" + _BOOL.format(n=bracket))
                self.flags.append((bracket, key == FLAGS[0]))
                continue
            tag = KEY_TAGS.get(key) or tag_for_key(key)
            if tag is None:
                parts.append(re.escape(raw) + ":" + _OTHER)
            else:
                parts.append(re.escape(raw) + ":" + _METRIC.format(n=bracket))
                self.tags.append(tag)
                self.values.append(bracket)
        self.regex = re.compile(", ".join(parts))
        self.overflow_cond = any(cond for _, cond in self.flags)

    def read(self, tail: str) -> Fields | None:
        m = self.regex.fullmatch(tail)
        if m is None:
            return None
        groups = m.groups()
        try:
            scalars = dict(zip(self.tags, map(float, map(groups.__getitem__, self.values))))
        except ValueError:  # characters of a number that make none (``1.2.3``): the full parser's case
            return None
        overflow = False
        for group, cond in self.flags:
            overflow = groups[group] == ("True" if cond else "False")
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
