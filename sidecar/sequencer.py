"""Per-rank ordering: is a training-step record new, a duplicate, stale, or a training resume?

One rank can be reported by several files at once (``rank_N/info.log`` and msrun's
``worker_N.log`` carry the same records, formatted from the same ``logging`` record and so with
the same timestamp), and a training job can go back to an earlier step (resume from a
checkpoint, or a new job reusing the directory). The line's own timestamp tells these apart:

============================  ============================  =====================================
step vs. last written step    wall time vs. last written    meaning
============================  ============================  =====================================
greater                       not earlier                   new: write
not greater                   not later                     duplicate from another file: drop
not greater                   later                         training resumed at this step
greater                       earlier                       a lagging file's superseded segment:
                                                            drop
============================  ============================  =====================================

Lines without a timestamp (prefix-trimmed logs) fall back to the stream's own order: a step
that goes backwards within one file is a resume. The state is two numbers per rank, persisted
with the log offsets so that a restart decides exactly as an uninterrupted run would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from parsers.records import Record


class Verdict(Enum):
    NEW = "new"
    DUPLICATE = "duplicate"
    STALE = "stale"
    RESUME = "resume"


@dataclass
class RankSequencer:
    last_step: int = -1
    last_wall: float = float("-inf")
    segment_wall: float = float("-inf")  # when the current segment (the latest resume) began

    def admits_attached(self, record: Record) -> bool:
        """Eval/checkpoint/marker records from before the latest resume belong to a dead segment."""
        return record.wall_time is None or record.wall_time >= self.segment_wall

    def catch_up(self, step: int, wall: float, segment_wall: float | None) -> None:
        """The run already holds a point newer than this (checkpointed) state: it was written
        after the checkpoint, before a crash. Judge the lines re-read from the checkpoint
        against it, so they are duplicates (or stale), never new points or a second resume."""
        if wall > self.last_wall:
            self.last_step, self.last_wall = step, wall
        if segment_wall is not None and segment_wall > self.segment_wall:
            self.segment_wall = segment_wall

    def judge(self, record: Record, stream_went_back: bool) -> Verdict:
        """Classify a training-step record and advance the state when it is kept."""
        step, wall = record.step, record.wall_time
        if wall is None:
            if step > self.last_step:
                verdict = Verdict.NEW
            else:
                verdict = Verdict.RESUME if stream_went_back else Verdict.DUPLICATE
        elif step > self.last_step:
            verdict = Verdict.NEW if wall >= self.last_wall else Verdict.STALE
        else:
            verdict = Verdict.RESUME if wall > self.last_wall else Verdict.DUPLICATE
        if verdict in (Verdict.NEW, Verdict.RESUME):
            self.last_step = step
            if wall is not None:
                self.last_wall = wall
                if verdict is Verdict.RESUME:
                    self.segment_wall = wall
        return verdict
