"""Torn lines: one line that holds the start of a second log line, split where that one starts.

stdout is block-buffered, so a job killed mid-write leaves half a line, and a relaunched job
(resumed from a checkpoint) appends right after it: the torn head of step 51 and the head of
step 41 share one line. Read as one line, step 41 is lost, or worse, read with the torn step's
values. :func:`tears` finds where each later log line starts; the caller counts every piece
before the last as malformed (a cut number would be a wrong value) and reads the last as a line.

What counts as a second prefix (the evidence), found anywhere after the line's own start:

- a whole mindformers prefix with its timestamp and level: the file handler's
  ``[INFO] 2024-06-18 02:41:09,377 [path:318] func:`` or the stdout handler's
  ``2024-06-18 02:41:09,377 - name - INFO - `` (``mindformers-log-formats.md`` §8). A timestamp
  alone, as a message may quote one (``resumed from the checkpoint of 2024-06-18 02:41:09,377``),
  is no evidence, nor are the trimmed prefixes without a timestamp the docs show;
- not right after a quote (``'`` or ``"``): a message that quotes a whole log line is not torn;
- the line's own prefix is not a second one: the first prefix is the line's own when it starts
  the line or follows only a launcher label (``[1,0]<stdout>:``, ``3: ``,
  :mod:`parsers.rank_labels`). A line that does not start that way (a torn progress bar or
  traceback line) is torn at its first prefix too. With a user ``--rank-pattern`` (``labels``
  false) the label's shape is unknown, so the first prefix is always taken as the line's own.

Not guarded: a message that repeats a whole log line unquoted (a traceback that prints one) is
split there too; its head is then counted as malformed, which the summary shows, never silent.

A later line of a labelled stream carries its own label: the split is made before the label
when one of the line's own kind ends where the prefix starts, so that the rest is routed to
its rank. An OpenMPI label is bracketed, so where it starts is plain; an srun label is digits,
and a torn head often ends in digits (``loss: 3.1`` + ``0: 2026-...``), so an srun label is
taken as wide as the line's own: srun pads every task id to the width of the largest. Digits
are matched as ``\\d`` only, so lines of one shape (:mod:`parsers.fast_path`) tear alike. Pure:
bytes in, byte positions out.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from itertools import chain

from parsers.prefix import LEVELS
from parsers.rank_labels import MPI_LABEL, SRUN_LABEL

# A prefix is found by its date, whose ``-`` is a literal the regex engine scans for quickly (most
# characters of a line are no ``-``), then confirmed around it: the level before it (file
# handler), or the name and level after it (stdout handler).
_DATE = re.compile(rb"-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
_YEAR = 4  # digits before the date's first "-"
_FILE_LEVEL = re.compile(rf"\[(?:{LEVELS})\] \Z".encode())  # ends where the timestamp starts
_FILE_REST = re.compile(rb"\[[^\]]*\] [\w<>.]*:")
_STDOUT_REST = re.compile(rf"- [^\n]{{0,512}}? - (?:{LEVELS}) - ".encode())
_LEVEL_REACH = len("[CRITICAL] ")
_MPI, _SRUN = re.compile(MPI_LABEL.encode()), re.compile(SRUN_LABEL.encode())
_MPI_AT_END = re.compile(f"(?:{MPI_LABEL})\\Z".encode())
_QUOTES = b"'\""
_LABEL_REACH = 64  # how far back from a prefix an OpenMPI label may start


def tears(raw: bytes, labels: bool = True) -> list[int]:
    """Where each log line after the first starts in ``raw`` (empty: the line is whole)."""
    first = _DATE.search(raw, _YEAR)
    if first is None:
        return []
    if _DATE.search(raw, first.end()) is None and (
            first.start() == _YEAR or _FILE_LEVEL.fullmatch(raw, 0, first.start() - _YEAR) is not None):
        return []  # the one date is at the line's start: its own prefix, if any (most lines)
    prefixes = _prefixes(raw)
    own = next(prefixes, None)
    if own is None:
        return []
    mpi = labels and own > 0 and _MPI.fullmatch(raw, 0, own) is not None
    srun = labels and own > 0 and not mpi and _SRUN.fullmatch(raw, 0, own) is not None
    at: list[int] = []
    for start in prefixes if not labels or own == 0 or mpi or srun else chain([own], prefixes):
        if mpi and (label := _MPI_AT_END.search(raw, max(0, start - _LABEL_REACH), start)) is not None:
            start = label.start()
        elif srun and start > own and _SRUN.fullmatch(raw, start - own, start) is not None:
            start -= own
        if start > 0 and raw[start - 1] not in _QUOTES and (not at or start > at[-1]):
            at.append(start)
    return at


def _prefixes(raw: bytes) -> Iterator[int]:
    """Where each whole mindformers prefix in ``raw`` starts (see the module docstring)."""
    found = _DATE.search(raw, _YEAR)
    while found is not None:
        date, after = found.start() - _YEAR, found.end()
        if raw[date:found.start()].isdigit():
            level = _FILE_LEVEL.search(raw, max(0, date - _LEVEL_REACH), date)
            if level is not None and _FILE_REST.match(raw, after):
                yield level.start()
            elif _STDOUT_REST.match(raw, after):
                yield date
        found = _DATE.search(raw, after)
