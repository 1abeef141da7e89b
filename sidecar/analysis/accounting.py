"""The accounting invariant: every record read is written, or counted under a named reason.

This is the promise users make decisions on: a curve with a gap either has a counted reason
for it or has no gap. The engine is the only caller; the replay summary, the live status line
and the metrics endpoint all read these counters, so the three never disagree.

Reasons (nothing is dropped for any reason not on this list):

- ``duplicate``: a copy of a record the run already shows (``info.log`` and ``worker_N.log``
  carry the same records; a restart re-reads the tail after its checkpoint);
- ``superseded``: a record of a training segment that a resume replaced (a lagging copy);
- ``malformed``: a line that starts like a step record but does not parse, or whose step does
  not fit (beyond int64); or a line a writer killed mid-line left cut off: the last line of a
  file, or a piece of a line that holds the start of the next (:mod:`parsers.torn`);
- ``too-long``: a line over ``--max-line-bytes``;
- ``thinned``: a training record none of whose points ``--every N`` keeps (an opted-in loss of
  resolution, :mod:`sidecar.output.thinning`);
- ``deleted-unread``: step records the writer deleted before the sidecar read them (a rotation
  chain rolled over more often than it keeps backups while the sidecar was stopped or behind);
  counted from the steps missing between the files around them, and warned about;
- ``unreadable``: a file that could not be opened or read, or a directory that could not be
  listed (permissions, I/O error); counted once per path and warned about (rate-limited), since
  every later record in it is lost until it becomes readable. Also a file that holds binary data
  rather than a log (:func:`sidecar.following.tailer.looks_binary`), counted and warned about once
  by the engine.

Counters are per rank (the rank a line was routed to, or the path's rank for file-level reasons)
and live for the whole process, so they never drop when a finished file is forgotten.
"""

from __future__ import annotations

import logging
from collections import Counter
from enum import Enum
from pathlib import Path

from sidecar.following.discovery import rank_of

log = logging.getLogger(__name__)


class Reason(str, Enum):
    DUPLICATE = "duplicate"
    SUPERSEDED = "superseded"
    MALFORMED = "malformed"
    TOO_LONG = "too-long"
    THINNED = "thinned"
    DELETED_UNREAD = "deleted-unread"
    UNREADABLE = "unreadable"


class Accounting:
    def __init__(self) -> None:
        self.written: Counter[int] = Counter()  # rank -> step records written
        self.dropped: Counter[tuple[int, Reason]] = Counter()
        self._unreadable: dict[Path, str] = {}  # path -> why, while it stays unreadable
        self._unlisted: set[Path] = set()  # the directories among them

    def wrote(self, rank: int) -> None:
        self.written[rank] += 1

    def thinned(self, rank: int) -> None:
        """A record counted as written turned out to be thinned away entirely."""
        self.written[rank] -= 1
        self.dropped[(rank, Reason.THINNED)] += 1

    def drop(self, rank: int, reason: Reason, count: int = 1) -> None:
        if count:
            self.dropped[(rank, reason)] += count

    def merge(self, other: Accounting) -> None:
        """Add the counts of another engine's accounting (a replay worker's)."""
        self.written.update(other.written)
        self.dropped.update(other.dropped)
        self._unreadable.update(other._unreadable)

    def copy(self) -> Accounting:
        """A snapshot; safe from another thread (each dict is copied in one step, under the GIL)."""
        out = Accounting()
        out.written, out.dropped = Counter(dict(self.written)), Counter(dict(self.dropped))
        out._unreadable = dict(self._unreadable)
        return out

    def unreadable(self, path: Path, rank: int, exc: OSError) -> None:
        """A file cannot be read: warn and count once, until it is readable again."""
        why = exc.strerror or str(exc)
        if self._unreadable.get(path) == why:
            return
        self._unreadable[path] = why
        self.drop(rank, Reason.UNREADABLE)
        what = "the logs below it are" if path in self._unlisted else "its records are"
        log.warning("cannot read %s: %s; %s missing until it is readable "
                    "(run the sidecar as a user that can read the training logs)", path, why, what,
                    extra={"rate_key": "unreadable"})

    def directories(self, unlisted: dict[Path, OSError], default_rank: int) -> None:
        """The directories one discovery pass could not list (see :mod:`sidecar.following.discovery`)."""
        for path in self._unlisted - unlisted.keys():
            self.readable(path)
        self._unlisted = set(unlisted)
        for path, exc in unlisted.items():
            rank = rank_of(path)
            self.unreadable(path, default_rank if rank is None else rank, exc)

    def unreadable_paths(self) -> dict[Path, str]:
        """What cannot be read right now, and why."""
        return dict(self._unreadable)

    def readable(self, path: Path) -> None:
        if self._unreadable.pop(path, None) is not None:
            log.info("%s is readable again", path)

    def totals(self) -> Counter[Reason]:
        out: Counter[Reason] = Counter()
        for (_, reason), count in self.dropped.items():
            out[reason] += count
        return out

    def of_rank(self, rank: int) -> dict[Reason, int]:
        return {reason: self.dropped[(rank, reason)] for reason in Reason if self.dropped[(rank, reason)]}

    def describe(self) -> str:
        """``12 duplicate, 3 malformed`` (empty when nothing was dropped)."""
        totals = self.totals()
        return ", ".join(f"{totals[r]} {r.value}" for r in Reason if totals[r])
