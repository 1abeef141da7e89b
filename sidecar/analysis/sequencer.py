"""Per-rank ordering: is a training-step record new, a copy, superseded, or a training resume?

Position is the order; time is not. Log timestamps are the training host's local clock, which
steps back at the end of summer time, on an NTP correction, or on another host, so they never
decide which of two records came later. What decides:

- Within one *chain* (a log file and its rotated backups, read oldest first), the position in
  the file is the order: a later record is never dropped as stale, and a step that goes back
  there is a training resume (from a checkpoint, or a new job in the same place).
- Several chains can report one rank: ``info.log`` and msrun's ``worker_N.log`` carry the same
  records, a restart re-reads the tail after its checkpoint, two attempt directories overlap.
  A copy is recognised by what it is: its *identity* (step, the line's own timestamp and the
  loss, as written) equals a record the run already holds.

For a record at step ``s`` with identity ``k``, read from chain ``C`` of this rank:

======================================================  =========================================
condition (first that holds)                            verdict
======================================================  =========================================
``k`` was written and is still shown                    DUPLICATE: drop, counted
``k`` was written and a resume superseded it            SUPERSEDED: a lagging copy of a dead
                                                        segment; drop, counted
``s`` > the last step written                           NEW: write
``C`` went back to ``s`` (or repeats it), and the run  RESUME: supersede the run from ``s`` on
does not hold ``k``
``C`` gave no step before and the run does not hold     RESUME: a source read later continues
``k``                                                   the run from an earlier step (a resumed
                                                        attempt in another directory)
otherwise                                               DUPLICATE: ``C`` re-delivers what the
                                                        run holds (a re-read beyond the window,
                                                        a ``copytruncate`` copy after a restart)
======================================================  =========================================

Memory is bounded: identities (:mod:`parsers.identity`) are remembered for the last
:data:`~parsers.identity.WINDOW` records written or
superseded. Older ones are looked up in the run's event files, only for a record that would
otherwise start a new segment (a chain's first record, or one that went back): that one
question tells a copy from a continuation, and the records after it follow in order. The
engine orders a rank's chains so that copies are read after what they copy (see
:mod:`sidecar.following.chains`). A record without a timestamp has no identity beyond its step and values.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from parsers.identity import WINDOW, Identity, record_identity
from parsers.records import Record
from sidecar.following.chains import ChainCursor


class Verdict(Enum):
    NEW = "new"
    DUPLICATE = "duplicate"
    SUPERSEDED = "superseded"
    RESUME = "resume"


@dataclass
class RankSequencer:
    """Judges one rank's training-step records; ``holds`` asks the run's event files whether
    they hold an identity (the slow path, once per chain)."""

    last_step: int = -1
    holds: Callable[[Identity], bool] = lambda key: False
    _seen: OrderedDict[Identity, bool] = field(default_factory=OrderedDict)  # identity -> still shown

    def remember(self, key: Identity, shown: bool) -> None:
        """Note an identity the run holds (``shown``) or held before a resume superseded it."""
        self._seen[key] = shown
        self._seen.move_to_end(key)
        while len(self._seen) > WINDOW:
            self._seen.popitem(last=False)

    def _held(self, record: Record, key: Identity) -> bool:
        """Does the run hold this record already (the slow path: it reads the run)?"""
        return record.wall_time is not None and self.holds(key)

    def judge(self, record: Record, cursor: ChainCursor) -> Verdict:
        """Classify a training-step record of ``cursor``'s chain and advance the state."""
        step = record.step
        key = record_identity(record)
        went_back = cursor.prev_step is not None and step <= cursor.prev_step  # a step again is a resume too
        fresh = cursor.prev_step is None
        if not fresh and not went_back:
            cursor.stride = step - cursor.prev_step
        cursor.prev_step = step
        shown = self._seen.get(key)
        if shown is not None:
            verdict = Verdict.DUPLICATE if shown else Verdict.SUPERSEDED
        elif step > self.last_step:
            verdict = Verdict.NEW
        elif (went_back or fresh and record.wall_time is not None) and not self._held(record, key):
            verdict = Verdict.RESUME
        else:
            verdict = Verdict.DUPLICATE
        cursor.live = verdict is not Verdict.SUPERSEDED
        if verdict is Verdict.RESUME:
            for old in self._seen:
                if old[0] >= step:
                    self._seen[old] = False
        if verdict in (Verdict.NEW, Verdict.RESUME):
            self.last_step = step
            self.remember(key, True)
        return verdict
