"""Splitting a combined stream by rank, from the labels launchers put in front of lines.

mindformers lines never name their rank. When several ranks share one stream, the launcher's
label is the only reliable tag:

- Slurm ``srun --label``: ``3: <line>`` (task ids may be space-padded);
- OpenMPI ``--tag-output``: ``[1,3]<stdout>:<line>`` (job id, rank);
- ``tail -f`` over many files: a ``==> .../worker_3.log <==`` header names the file of the
  lines that follow;
- a user pattern with a named group ``rank`` (everything after the match is the line).

The label style is detected per file from its first labelled line and then kept, so ordinary
lines that happen to start with ``12: `` are never mistaken for labels in unlabelled files.
Unlabelled lines in a labelled stream (tracebacks, pretty-printed config) continue the record of
the last labelled rank, and so do lines whose label is not a rank (beyond int64, not a number).
"""

from __future__ import annotations

import re
from pathlib import PurePath

from parsers.values import parse_int64

SRUN_LABEL = r" *(\d+): "
MPI_LABEL = r"\[\d+,(\d+)\]<std(?:out|err)>: ?"
_SRUN = re.compile(SRUN_LABEL + "(.*)", re.S)
_MPI = re.compile(MPI_LABEL + "(.*)", re.S)
_TAIL_HEADER = re.compile(r"==> (.+) <==\s*$")
# An srun label is only believed in front of something that looks like a log line.
_LOGGISH = re.compile(r"\d{4}-\d\d-\d\d |\[[A-Z]+\] |\{ |Epoch|- [A-Z]+ - |[A-Z]{2}\d{4}\[")
_RANK_IN_PATH = re.compile(r"rank_(\d+)|worker_(\d+)|mf_parallel(\d+)")
# How log lines start (``[INFO] ``, a date): no label style above matches there.
_LOG_LINE = re.compile(r"\[[A-Z]|\d{4}-\d\d-\d\d ")


class RankRouter:
    """Maps each line of one file to ``(rank, line without its label)``."""

    def __init__(self, default_rank: int, pattern: str | None = None) -> None:
        self.default_rank = default_rank
        self.current = default_rank
        self.style: str | None = None
        self._user = re.compile(pattern) if pattern else None
        if self._user is not None and "rank" not in self._user.groupindex:
            raise ValueError("the rank pattern needs a named group (?P<rank>...)")
        # Lines that start like a log line are never labels, unless the user's pattern says what a
        # label is (:mod:`parsers.fast_path` relies on this).
        self.plain_lines = self._user is None

    def route(self, line: str) -> tuple[int, str]:
        if self._user is not None:
            m = self._user.match(line)
            rank = _rank(m.group("rank")) if m else None
            if m and rank is not None:
                self.current = rank
                return self.current, line[m.end():]
            return self.current, line
        if _LOG_LINE.match(line):
            return self.current, line
        style = self.style
        if style is None or style == "mpi":
            m = _MPI.match(line)
            rank = _rank(m.group(1)) if m else None
            if m and rank is not None:
                self.style = "mpi"
                self.current = rank
                return self.current, m.group(2)
        if style is None or style == "tail":
            m = _TAIL_HEADER.match(line)
            if m:
                self.style = "tail"
                rank = _rank_in_path(m.group(1))
                self.current = self.default_rank if rank is None else rank
                return self.current, ""
        if style is None or style == "srun":
            m = _SRUN.match(line)
            rank = _rank(m.group(1)) if m else None
            if m and rank is not None and (style == "srun" or _LOGGISH.match(m.group(2))):
                self.style = "srun"
                self.current = rank
                return self.current, m.group(2)
        return self.current, line


def _rank_in_path(path: str) -> int | None:
    for part in reversed(PurePath(path.strip()).parts):
        m = _RANK_IN_PATH.search(part)
        if m:
            return _rank(next(g for g in m.groups() if g is not None))
    return None


def _rank(text: str | None) -> int | None:
    """A label's rank; ``None`` (not a label) for text that is no rank, e.g. 5000 digits."""
    rank = None if text is None else parse_int64(text)
    return rank if rank is not None and rank >= 0 else None
