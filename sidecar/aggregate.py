"""The cross-rank view: one run with per-step mean, min, max and spread of every metric over ranks.

A step's aggregate is written once every rank has reported it or moved past it (ranks come from
paths and stream labels, known once every file was read once), or, live, once ``timeout`` seconds passed since its first
report (a dead or slow rank must not stall the view forever). At most ``max_pending`` steps wait;
at the end of a replay everything pending is written. Under pipeline
parallelism only the last stage's loss is valid (mindformers warns ``pipeline stages: P > 1``
every step; non-last PyNative stages print ``loss: N/A``), so the aggregate loss uses only those
ranks, unless ``loss_ranks`` says otherwise. For ``iteration-time`` the slowest rank is recorded too.

The run is ``aggregate/<instance>``: sidecars on several nodes sharing one ``--out`` each write
their own, over the ranks they follow. A TensorBoard custom-scalars layout (one chart per metric
with every rank overlaid, and a mean/min/max margin chart) is written once into this run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from tensorboardX.summary import custom_scalars

from parsers import tags
from parsers.records import PipelineLine, Record
from sidecar.run_writer import RunWriter

AGGREGATED = (
    tags.LOSS, tags.LEARNING_RATE, tags.GRAD_NORM, tags.LOSS_SCALE, tags.ITERATION_TIME, tags.THROUGHPUT,
    tags.MODEL_FLOPS, "lm-loss", "mtp-loss", "load-balancing-loss", "indexer-loss",
)
SLOWEST = f"{tags.ITERATION_TIME}/slowest-rank"


@dataclass
class _Step:
    first_seen: float
    wall: float
    values: dict[str, dict[int, float]] = field(default_factory=dict)  # tag -> rank -> value


class CrossRankAggregator:
    def __init__(
        self, run_dir: Path, timeout: float, loss_ranks: set[int] | None = None, max_pending: int = 10_000
    ) -> None:
        self.writer = RunWriter(run_dir)
        self.timeout = timeout
        self.loss_ranks = loss_ranks
        self.max_pending = max_pending
        self.expected: set[int] = set()  # ranks known from paths and stream labels
        self.ready = False  # set once every file was read once: only then is ``expected`` complete
        self.last_step: dict[int, int] = {}  # rank -> newest training step seen
        self.reporters: dict[str, set[int]] = {}  # tag -> ranks that ever reported it
        self.pipeline: PipelineLine | None = None
        self._pending: dict[int, _Step] = {}
        self._layout_written = self.writer.max_step >= 0
        self._resumed_at: int | None = None
        self._emitted_since_resume = False

    def observe(self, rank: int, record: Record, now: float, resumed: bool = False) -> None:
        """A training-step record of ``rank`` (new, or a duplicate of one already written, which
        completes a step that a restart interrupted; ``resumed``: the rank went back in steps)."""
        if not record.training_step:
            return
        if resumed:
            self._resume(record.step, record.wall_time)
            self.last_step[rank] = record.step
        else:  # duplicates from a second file or a re-read after restart may lag behind
            self.last_step[rank] = max(self.last_step.get(rank, -1), record.step)
        entry = self._pending.get(record.step)
        if entry is None:
            entry = self._pending[record.step] = _Step(now, record.wall_time or 0.0)
        for tag in AGGREGATED:
            value = record.scalars.get(tag)
            if value is None:
                continue
            self.reporters.setdefault(tag, set()).add(rank)
            entry.values.setdefault(tag, {})[rank] = value
        self._write_complete(now)

    def note_pipeline(self, line: PipelineLine) -> None:
        self.pipeline = line

    def flush_due(self, now: float) -> None:
        self._write_complete(now)

    def flush(self) -> None:
        for step in sorted(self._pending):
            self._emit(step, self._pending.pop(step))

    def close(self) -> None:
        self.writer.close()

    def _resume(self, step: int, wall: float | None) -> None:
        """The first rank to go back supersedes the aggregate from ``step`` on; later ones find it done."""
        for stale in [s for s in self._pending if s >= step]:
            del self._pending[stale]
        # The other ranks will go back too; until they do, they have not "moved past" step.
        self.last_step = {r: min(s, step - 1) for r, s in self.last_step.items()}
        if self._resumed_at != step or self._emitted_since_resume:
            self.writer.resume(step, wall, f"training resumed at step {step}")
            self._resumed_at, self._emitted_since_resume = step, False

    def valid_loss_ranks(self) -> set[int] | None:
        """Ranks whose loss counts, or ``None`` for all of them (see the module docstring)."""
        if self.loss_ranks is not None:
            return self.loss_ranks
        pipeline = self.pipeline
        if pipeline is None:
            return None
        ranks = sorted(self.reporters.get(tags.ITERATION_TIME, set()) | self.reporters.get(tags.LOSS, set()))
        if pipeline.rank0_only:
            return {0}
        if not pipeline.stages or not ranks:
            return None
        world = max(ranks) + 1
        per_stage = max(world // pipeline.stages, 1)
        return {r for r in ranks if r >= world - per_stage}

    def _write_complete(self, now: float) -> None:
        ranks = self.expected | set(self.last_step)
        for step in sorted(self._pending):
            entry = self._pending[step]
            complete = self.ready and all(self.last_step.get(r, -1) >= step for r in ranks)
            overdue = now - entry.first_seen >= self.timeout or len(self._pending) > self.max_pending
            if complete or overdue:
                self._emit(step, self._pending.pop(step))
            else:
                break  # keep steps in order: a later step waits for an earlier one

    def _emit(self, step: int, entry: _Step) -> None:
        scalars: dict[str, float] = {}
        valid_loss = self.valid_loss_ranks()
        for tag, by_rank in entry.values.items():
            if tag == tags.LOSS and valid_loss is not None:
                by_rank = {r: v for r, v in by_rank.items() if r in valid_loss}
            finite = [v for v in by_rank.values() if math.isfinite(v)]
            if not by_rank:
                continue
            values = list(by_rank.values())
            if len(finite) < len(values):
                scalars[f"{tag}/mean"] = math.nan  # a non-finite rank must show, not be averaged away
            else:
                scalars[f"{tag}/mean"] = sum(values) / len(values)
            if finite:
                scalars[f"{tag}/min"] = min(finite)
                scalars[f"{tag}/max"] = max(finite)
                scalars[f"{tag}/spread"] = max(finite) - min(finite)
            if tag == tags.ITERATION_TIME:
                scalars[SLOWEST] = float(max(by_rank, key=lambda r: by_rank[r]))
        if scalars:
            self._write_layout(entry.wall)
            self.writer.write(Record(step, entry.wall or None, scalars))
            self._emitted_since_resume = True

    def _write_layout(self, wall: float) -> None:
        if self._layout_written:
            return
        self._layout_written = True
        charts: dict[str, list] = {}
        for tag in AGGREGATED:
            charts[f"{tag} (all ranks)"] = ["Multiline", [f"^{tag}$"]]
            charts[f"{tag} (mean, min-max band)"] = ["Margin", [f"{tag}/mean", f"{tag}/min", f"{tag}/max"]]
        summary = custom_scalars({"mstb-sidecar: ranks": charts})
        self.writer.write_values(0, wall, list(summary.value))
