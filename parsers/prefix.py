"""Logger prefixes: split a raw line into timestamp, level and message.

mindformers has two prefix shapes (``mindformers-log-formats.md`` §8), and docs often show
trimmed variants; msrun worker logs also carry foreign lines (MindSpore native, CANN, MindIO)
that must be recognised quickly and never parsed as metrics.

    stdout: 2024-06-18 02:41:09,377 - mindformers[mindformers/core/callback/callback.py:318] - INFO - msg
    file:   [INFO] 2024-06-18 02:41:09,377 [mindformers/core/callback/callback.py:318] print_output_info: msg
    native: [WARNING] ME(41872:1402155,MainProcess):2025-09-03-11:20:45.118.602 [path:1530] msg

Timestamps are local time without a zone, as the training host wrote them.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

LEVELS = "DEBUG|INFO|WARNING|ERROR|CRITICAL"
TS = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
FILE_PREFIX = re.compile(rf"\[({LEVELS})\] ({TS}) \[[^\]]*\] [\w<>.]*: ?(.*)", re.S)
_STDOUT = re.compile(rf"(?:({TS}) )?(?:- )?(?:\S.*? - )?({LEVELS}) - (.*)", re.S)
STDOUT_PREFIX = re.compile(rf"({TS}) - .*? - ({LEVELS}) - (.*)", re.S)
# MindSpore native `[LEVEL] MOD(`, CANN `EZ9999[PID:`, MindIO `<date> <time>.uuuuuu level pid [TTP`.
FOREIGN_PREFIX = re.compile(
    rf"\[(?:{LEVELS})\] [A-Z_]+\(|[A-Z]{{2}}\d{{4}}\[PID|\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{{6}} "
)


Cut = tuple[int, int, int, int, int]  # where a prefix match put the level, the timestamp and the message


def cut_of(m: re.Match[str]) -> Cut:
    """A :data:`FILE_PREFIX` or :data:`STDOUT_PREFIX` match as (level start, level end, timestamp
    start, timestamp end, message start): what :meth:`PrefixSplitter.split` takes from it, in
    indices, so that a line of the same shape can be cut without matching it
    (:class:`parsers.fast_path.Shapes`)."""
    level, ts = (1, 2) if m.re is FILE_PREFIX else (2, 1)
    return (*m.span(level), *m.span(ts), m.start(3))


@dataclass(slots=True)  # not frozen: one per line read, and a frozen __init__ costs twice as much
class Message:
    """One line with its prefix removed. ``foreign`` lines are not mindformers' own."""

    text: str
    timestamp: float | None = None
    level: str | None = None
    foreign: bool = False


class PrefixSplitter:
    """Strips prefixes; caches the epoch of the last timestamp's minute, since consecutive lines
    share it (exact: zone offsets change on whole minutes), and the last timestamp whole, since
    the lines of one step record usually share that too."""

    __slots__ = ("_last_minute", "_last_epoch", "_last_ts", "_last_time")

    def __init__(self) -> None:
        self._last_minute = ""
        self._last_epoch = 0.0
        self._last_ts = ""
        self._last_time = 0.0

    def split(self, line: str, cut: Cut | None = None) -> Message:
        """``cut``: where :data:`FILE_PREFIX` or :data:`STDOUT_PREFIX` matches ``line``, where the
        caller knows it already (:class:`parsers.fast_path.Shapes`)."""
        if cut is not None:
            return self._cut(line, cut)
        first = line[:1]
        if first == "[":
            m = FILE_PREFIX.match(line)
            if m:
                return self._cut(line, cut_of(m))
            if FOREIGN_PREFIX.match(line):
                return Message(line, None, native_level(line), foreign=True)
        elif first.isdigit():
            m = STDOUT_PREFIX.match(line)
            if m:
                return self._cut(line, cut_of(m))
            if FOREIGN_PREFIX.match(line):
                return Message(line, None, None, foreign=True)
        elif first == "E" and FOREIGN_PREFIX.match(line):
            return Message(line, None, "ERROR", foreign=True)
        if " - " in line[:200]:
            m = _STDOUT.match(line)
            if m:
                ts = m.group(1)
                return Message(m.group(3), self._timestamp(ts) if ts else None, m.group(2))
        return Message(line)

    def _cut(self, line: str, cut: Cut) -> Message:
        level_start, level_end, ts_start, ts_end, message = cut
        return Message(line[message:], self._timestamp(line[ts_start:ts_end]), line[level_start:level_end])

    def _timestamp(self, ts: str) -> float:
        if ts == self._last_ts:
            return self._last_time
        minute = ts[:16]
        if minute != self._last_minute:
            self._last_epoch = time.mktime(
                (int(minute[0:4]), int(minute[5:7]), int(minute[8:10]), int(minute[11:13]), int(minute[14:16]),
                 0, 0, 0, -1)
            )
            self._last_minute = minute
        self._last_ts, self._last_time = ts, self._last_epoch + int(ts[17:19]) + int(ts[20:23]) / 1000.0
        return self._last_time


def native_level(line: str) -> str | None:
    """The level of a MindSpore native line (``[WARNING] ME(...``)."""
    end = line.find("]")
    return line[1:end] if end > 0 else None
