"""The parts of the checkpoint (:mod:`sidecar.output.state`) that analysis fills.

The cross-rank aggregate, each rank's alerts and its parallel layout keep what a restart needs in
these models; they live here, beside the checkpoint that stores them, so that ``output/`` needs
nothing from ``analysis/`` (which imports ``output/``, not the other way round). Only the data is
here: what it means, and how it is made and taken back, is in the module that fills it
(:mod:`sidecar.analysis.aggregate`, :mod:`sidecar.analysis.alerts` and
:mod:`sidecar.analysis.watch`, :mod:`sidecar.analysis.parallel_layout`). A field added later has a default, so a checkpoint
written before it loads as before.
"""

from __future__ import annotations

import math

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


class LevelState(BaseModel):
    """A spike or drop detector without its settings (:mod:`sidecar.analysis.watch`)."""

    model_config = ConfigDict(ser_json_inf_nan="constants")

    values: str = ""  # the window, oldest first: float32, little-endian, base64
    skip: int = 0
    new: int = 0
    median: float = math.nan
    threshold: float = math.nan


class PendingLosses(BaseModel):
    """A step whose loss the divergence check waits for from some rank."""

    model_config = ConfigDict(ser_json_inf_nan="constants")

    step: int
    wall: float | None
    wall_rank: int
    losses: dict[int, float]


class Baselines(BaseModel):
    """One rank's detectors, or the divergence check's for the ranks together (:mod:`sidecar.analysis.watch`)."""

    episodes: dict[str, tuple[int, int, bool]] = {}  # alert name -> (bad, normal, on), those not idle
    levels: dict[str, LevelState] = {}  # alert name -> its level detector
    step_seconds: str = ""  # the stall detector's, float64, base64
    checkpoint_step: int | None = None
    losses: list[PendingLosses] = []
    loss_ranks: list[int] = []


class WatchState(BaseModel):
    """What a rank's alerts need after a restart (see :mod:`sidecar.analysis.alerts`); of rank
    ``-1``: the ranks together."""

    lifecycle: Lifecycle | None = None
    last_step: int | None = None
    firing: list[str] = []  # alert names whose episode is on
    baselines: Baselines | None = None  # the detectors (None: a checkpoint from before they were kept)


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
