"""Custom metrics without code: the ``metrics:`` section of the config file.

Why: training scripts print their own numbers (a callback's ``tokens/s``, an eval print); with
in-process monitoring each needs code. Here each is a named regex with named groups ``step`` and
``value`` (and optionally ``rank``), a tag and a kind::

    metrics:
      - name: tokens
        regex: 'step (?P<step>\\d+) .*tokens/s: (?P<value>[\\d.]+)'
        tag: tokens-per-s
      - name: eval-print
        regex: '^\\[eval\\] step=(?P<step>\\d+) ppl=(?P<value>\\S+)'
        tag: eval-ppl

Applied only to messages no built-in parser claimed, after the logger prefix is removed.

Safe against catastrophic backtracking, since Python's ``re`` has no timeout: a pattern with a
repeat inside a repeat (``(a+)+``, ``(\\w*\\s?)*``) or a back-reference is refused when the
config is read, and a pattern only ever sees the first :data:`MAX_TEXT` characters of a line. A
refused pattern, a missing group, a tag that clashes with a built-in tag, or two metrics with one
name or tag are one-line errors (exit 2), from pydantic.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

try:  # Python 3.11+
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_parse  # type: ignore[no-redef]

from parsers import tags
from parsers.prefix import Message
from parsers.records import Record
from parsers.values import parse_int64, parse_number

MAX_TEXT = 4096  # characters of a line a custom pattern sees
BUILT_IN = frozenset({*tags.KEY_TAGS.values(), tags.CHECKPOINT_SAVE_TIME, tags.EVAL_TIME, "B-samples-per-day",
                      tags.CONFIG, tags.PARALLEL_LAYOUT})
RESERVED_PREFIXES = ("events/", "eval/", "_hparams_/", "aggregate/", tags.ALERTS_PREFIX)
_REPEATS = (sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT, getattr(sre_parse, "POSSESSIVE_REPEAT", object()))


class CustomMetric(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    regex: str
    tag: str
    kind: Literal["scalar", "text"] = "scalar"

    @field_validator("regex")
    @classmethod
    def _regex(cls, value: str) -> str:
        try:
            compiled = re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression ({exc})") from None
        missing = [g for g in ("step", "value") if g not in compiled.groupindex]
        if missing:
            raise ValueError("needs the named groups " + " and ".join(f"(?P<{g}>...)" for g in missing))
        risky = _backtracking_risk(sre_parse.parse(value))
        if risky:
            raise ValueError(f"{risky} can take exponential time on some lines; simplify the pattern")
        return value

    @field_validator("tag")
    @classmethod
    def _tag(cls, value: str) -> str:
        if tags.sanitize_tag(value) != value:
            raise ValueError("use only letters, digits and '_', '.', '-', '/' (no leading or trailing '/')")
        if value in BUILT_IN or value.startswith(RESERVED_PREFIXES) or value.endswith("_vs_samples"):
            raise ValueError(f"'{value}' is a built-in tag (or under a built-in prefix); choose another name")
        return value


class MetricList(BaseModel):
    """Names and tags must be unique across the list."""

    metrics: list[CustomMetric]

    @model_validator(mode="after")
    def _unique(self) -> MetricList:
        for key in ("name", "tag"):
            seen = [getattr(m, key) for m in self.metrics]
            twice = sorted({v for v in seen if seen.count(v) > 1})
            if twice:
                raise ValueError(f"two metrics with the {key} {twice[0]!r}")
        return self


def _backtracking_risk(parsed: sre_parse.SubPattern, in_repeat: bool = False) -> str | None:
    """Why the pattern may backtrack exponentially (a repeat in a repeat, a back-reference), or None."""
    for op, arg in parsed:
        if op in _REPEATS:
            low, high, sub = arg
            repeats = high > 1
            if repeats and in_repeat:
                return "a repeat inside a repeat"
            found = _backtracking_risk(sub, in_repeat or repeats)
        elif op in (sre_parse.GROUPREF, sre_parse.GROUPREF_EXISTS):
            return "a back-reference"
        elif op == sre_parse.SUBPATTERN:
            found = _backtracking_risk(arg[-1], in_repeat)
        elif op == sre_parse.BRANCH:
            found = next((r for r in (_backtracking_risk(b, in_repeat) for b in arg[1]) if r), None)
        elif op in (sre_parse.ASSERT, sre_parse.ASSERT_NOT):
            found = _backtracking_risk(arg[1], in_repeat)
        else:
            found = None
        if found:
            return found
    return None


def _count(text: str | None) -> int | None:
    value = parse_int64(text) if text is not None else None
    return value if value is not None and value >= 0 else None


class CustomMatcher:
    """The configured metrics, compiled; :meth:`match` turns an unclaimed message into a record."""

    def __init__(self, metrics: list[CustomMetric]) -> None:
        self._metrics = [(re.compile(m.regex), m) for m in metrics]
        self.malformed = 0  # matched, but the step or value is not one

    def match(self, message: Message) -> tuple[int | None, Record] | None:
        """(rank from the ``rank`` group or None, record) of the first metric that matches a
        mindformers message (foreign lines are MindSpore's or CANN's, never a custom metric)."""
        if message.foreign:
            return None
        text = message.text[:MAX_TEXT]
        for pattern, metric in self._metrics:
            m = pattern.search(text)
            if m is None:
                continue
            step = _count(m.group("step"))
            raw = m.group("value")
            rank = _count(m.group("rank")) if "rank" in pattern.groupindex else None
            if step is None or raw is None or ("rank" in pattern.groupindex and rank is None):
                self.malformed += 1
                return None
            record = Record(step, message.timestamp)
            if metric.kind == "text":
                record.texts[metric.tag] = raw
            else:
                value = parse_number(raw)
                if value is None:
                    self.malformed += 1
                    return None
                record.scalars[metric.tag] = value
            return rank, record
        return None
