"""The parts of the checkpoint (:mod:`sidecar.output.state`) that analysis fills.

The cross-rank aggregate, each rank's alerts and its parallel layout keep what a restart needs in
these models; they live here, beside the checkpoint that stores them, so that ``output/`` needs
nothing from ``analysis/`` (which imports ``output/``, not the other way round). Only the data is
here: what it means, and how it is made and taken back, is in the module that fills it
(:mod:`sidecar.analysis.aggregate`, :mod:`sidecar.analysis.alerts`,
:mod:`sidecar.analysis.parallel_layout`). A field added later has a default, so a checkpoint
written before it loads as before.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from parsers.lifecycle import Lifecycle
from parsers.records import ParallelConfigLine, PipelineLine


class PendingStep(BaseModel):
    step: int
    wall: float
    values: dict[str, dict[int, float]]  # tag -> rank -> value


class AggregateState(BaseModel):
    """What the aggregate waits for and knows, checkpointed with the log offsets it matches."""

    model_config = ConfigDict(ser_json_inf_nan="constants")  # a NaN loss still waiting stays NaN

    pending: list[PendingStep] = []
    last_step: dict[int, int] = {}
    reporters: dict[str, list[int]] = {}
    pipeline: PipelineLine | None = None
    parallel: ParallelConfigLine | None = None
    emitted: int = -1
    resumed_at: int | None = None
    emitted_since_resume: bool = False
    behind: list[int] = []
    incomplete_steps: int = 0


class WatchState(BaseModel):
    """What a rank's alerts need after a restart (see :mod:`sidecar.analysis.alerts`)."""

    lifecycle: Lifecycle | None = None
    last_step: int | None = None
    firing: list[str] = []  # alert names whose episode is on


class ParallelLayout(BaseModel):
    """The parallel layout a rank's log states (:mod:`sidecar.analysis.parallel_layout`)."""

    parallel: list[ParallelConfigLine] = []  # at most one derived, then at most one stated
    pipeline: PipelineLine | None = None

    def with_line(self, line: ParallelConfigLine | PipelineLine) -> ParallelLayout:
        if isinstance(line, PipelineLine):
            return ParallelLayout(parallel=self.parallel, pipeline=line)
        kept = [p for p in self.parallel if p.derived != line.derived] + [line]
        return ParallelLayout(parallel=sorted(kept, key=lambda p: not p.derived), pipeline=self.pipeline)


class NoteState(BaseModel):
    """A :class:`~sidecar.analysis.parallel_layout.LayoutNote` in the checkpoint."""

    layout: ParallelLayout = ParallelLayout()
    due: bool = False
