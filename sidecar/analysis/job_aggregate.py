"""One cross-rank aggregate for the whole job (``aggregate/job``), from the rank runs of every node.

Node sidecars sharing one ``--out`` each write their ranks' runs and an aggregate over those
ranks only. ``mstb-sidecar aggregate`` reads every ``rank_<N>`` run under ``--out`` as it grows
(:class:`~sidecar.output.run_follow.RunFollower`: the event files are the interface) and feeds
a :class:`~sidecar.analysis.aggregate.CrossRankAggregator`, which does the math, the completion
rule, the timeout for a late or dead node and the pipeline-parallel loss rule, as it does for
a node. What the rank runs hold, read back:

- a scalar event with any of :data:`~parsers.tags.AGGREGATED` is one training step;
- a ``SessionLog.START`` at or below the newest step read from that run (in its current
  segment) is a training resume (:meth:`RunWriter.resume` writes it; TensorBoard purges by it):
  the rank's next step goes to the aggregator as a resume. A START above it is a plain restart
  of the node sidecar;
- a :data:`~sidecar.analysis.parallel_layout.LAYOUT_TAG` value is the parallel layout the rank's
  log states (world size, pipeline stages), written before the step it applies to.

Ranks. The aggregate expects every rank with a run under ``--out`` and, once the logs state the
job's world size, every rank below it, so a node whose sidecar has not written anything yet
(late, or dead from the start) is waited for and then marked missing rather than left out
unnoticed. New runs (a late node) are found by the next scan.

Resumes in history. What a run holds up to the newest step the aggregate held when the run was
first seen (or seen again after it was deleted and written anew, or after a lost checkpoint) is
older than the aggregate: a resume there was applied through the other ranks, or before the
run was rewritten. Applying it again would cut the aggregate a second time and leave every other
rank waiting to go back; so such a START counts only if the aggregator still waits for this rank
to go back (a late node's rank that was expected when the others resumed).

Experiments. With ``--run-name`` (and ``--label``, ``--job``) as the node sidecars were given, it
follows that experiment's rank runs and writes its aggregate and layout beside them
(:class:`~sidecar.output.run_names.RankRuns`, :func:`~sidecar.output.run_names.beside`:
``{label}/rank_{rank}`` gives ``<label>/aggregate/job``), with a checkpoint of its own; the default
keeps ``aggregate/job``, ``layout/job`` and ``state-job.json``. ``{config_hash}`` outside ``{rank}``'s
component cannot be followed: the hash is in the logs, not in the runs.

Missing ranks in the output. The aggregator counts the steps it writes without every rank
(:attr:`~CrossRankAggregator.incomplete_steps`). When that count grows, a text event
:data:`MISSING_TAG` at the newest step written names the ranks that have not reported it, once
per change of that set, and once more when a step is again written with every rank.

Its charts in TensorBoard's Custom Scalars tab (the ranks overlaid, the mean in its min-max
band) are in a run of its own, ``layout/job`` (:mod:`sidecar.output.layout`), so they are there
also when the node sidecars write no aggregate and no layout of their own.

Reading is in lockstep: runs are read in rounds of at most :data:`BATCH` events, and a run that
is :data:`LEAD` training steps ahead of the least-read run with input left waits a round. Steps
are counted as read, not by number (a resume goes back in numbers but on in the job's timeline;
a late node's run starts at 0), so the steps waiting in the aggregator stay near what the nodes'
progress on disk differs by, however many other events (texts, alerts) a run holds per step.

Exactly once, restart-safe: the read offsets of every event file are checkpointed together with
the aggregator's snapshot (``--out/.mstb-sidecar/state-job.json``, atomic, after the aggregate run
was fsynced); a restart reads on from there, and steps the aggregate run already holds (written
after the last checkpoint) are not written again (the aggregator reads its run's watermarks). A
state that claims more of the aggregate run than is on disk (deleted, rolled back) is dropped:
everything is read again from the start.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field
from tensorboard.compat.proto import event_pb2

from parsers.records import Record
from parsers.tags import AGGREGATED
from sidecar.analysis.aggregate import CrossRankAggregator, rank_ranges
from sidecar.analysis.parallel_layout import LAYOUT_TAG, read_layout
from sidecar.output.event_file import OutputLost, vanished
from sidecar.output import run_names
from sidecar.output.layout import LayoutRun
from sidecar.output.run_follow import RunFollower
from sidecar.output.run_writer import RunWriter
from sidecar.output.state import StateStore
from sidecar.output.state_parts import AggregateState, ParallelLayout

log = logging.getLogger(__name__)

JOB = "job"  # the instance name: run aggregate/job, lock and state file of instance "job"
BATCH = 256  # events read per run per round
LEAD = 256  # training steps a run is read ahead of the least-read run that still has input
MAX_WORLD = 1 << 16  # a logged world size beyond this is not turned into expected ranks
MISSING_TAG = "events/missing-ranks"
VERSION = 1
_AGGREGATED = frozenset(AGGREGATED)


class RunProgress(BaseModel):
    files: dict[str, int] = {}  # event file name -> offset read to
    last_step: int = -1  # newest training step read, in the run's current segment
    resumed: bool = False  # a resume START was read; the next step goes back
    history: int = -1  # up to this step, what the run holds is older than the aggregate (see "Resumes")
    steps_read: int = Field(0, ge=0)  # training-step events read: the run's place in the job's timeline


class JobState(BaseModel):
    version: int = VERSION
    runs: dict[int, RunProgress] = {}  # rank -> progress
    aggregate: AggregateState | None = None
    aggregate_file: str = ""  # the aggregate run's event file and size this state covers
    aggregate_size: int = Field(0, ge=0)
    missing: list[int] = []  # the ranks named by the last MISSING_TAG text


@dataclass
class _Run:
    follower: RunFollower
    progress: RunProgress
    drained: bool = False  # the last read took everything there was


class JobAggregate:
    def __init__(self, out: Path, timeout: float, loss_ranks: set[int] | None, run_name: str = run_names.DEFAULT,
                 label: str | None = None, job: str | None = None) -> None:
        self.out = out
        self.rank_runs = run_names.RankRuns(run_name, label, job)
        rank_run = run_names.render(run_name, 0, label, None, job)
        self.run_dir = out / run_names.beside(run_name, rank_run, "aggregate", JOB)
        self.store = StateStore(out, JOB, run_names.experiment(run_name, label, job))
        state = self._load()
        self.aggregator = CrossRankAggregator(self.run_dir, timeout, loss_ranks)
        if state.aggregate is not None:
            self.aggregator.restore(state.aggregate)
        self.layout = LayoutRun(RunWriter(out / run_names.beside(run_name, rank_run, "layout", JOB)))
        self._restored = state.runs
        self._claimed = (state.aggregate_file, state.aggregate_size)  # of aggregate/job, by the last checkpoint
        self.missing = state.missing
        self._incomplete_seen = self.aggregator.incomplete_steps
        self.runs: dict[int, _Run] = {}
        self.events_read = 0
        self._expect_world()

    # -- state -----------------------------------------------------------------------------
    def _load(self) -> JobState:
        """The checkpoint, or a fresh start (with a warning) when it is unreadable or does not
        match the aggregate run on disk."""
        state = self.store.load_as(JobState, VERSION)
        lost = vanished(self.run_dir, state.aggregate_file, state.aggregate_size)
        if lost:
            log.warning("state file %s does not match %s (%s); reading every rank run again from the start",
                        self.store.path, self.run_dir, lost)
            return JobState()
        return state

    def checkpoint(self) -> None:
        """fsync the aggregate run, then save the offsets and the aggregator's snapshot with it."""
        self.layout.update(self.aggregator.reporters, self.aggregator.writer.view.watermarks)
        self.layout.writer.sync()
        view = self.aggregator.writer.sync()
        self.check()
        state = JobState(runs={rank: run.progress for rank, run in self.runs.items()},
                         aggregate=self.aggregator.snapshot(), aggregate_file=view.file,
                         aggregate_size=view.size, missing=self.missing)
        for rank, progress in self._restored.items():
            state.runs.setdefault(rank, progress)  # not found (yet) by a scan: keep where it was read to
        self.store.save(state)
        self._claimed = (view.file, view.size)

    def check(self) -> None:
        """Raise :class:`OutputLost` when what the last checkpoint claims of ``aggregate/job`` is gone.
        Asked before each round too: a step written into a re-created directory first would hide
        the loss of the steps before it (they are below its watermark), and a start-over would
        not write them again."""
        gone = vanished(self.run_dir, *self._claimed)
        if gone is not None:
            raise OutputLost(self.run_dir, gone)

    # -- reading ---------------------------------------------------------------------------
    def scan(self) -> None:
        """Follow every rank run of the experiment (``rank_<N>`` under ``--out``) not followed yet."""
        for rank, run_dir in self.rank_runs.find(self.out).items():
            if rank in self.runs:
                continue
            progress = self._restored.pop(rank, None) or RunProgress(history=self.aggregator.writer.max_step)
            follower = RunFollower(run_dir, progress.files)
            follower.rewritten = progress.last_step >= 0 and not progress.files  # deleted while it was read
            self.runs[rank] = _Run(follower, progress)
            self.aggregator.expected.add(rank)
        self.aggregator.ready = True  # the ranks are known from the listing (and the logged world size)

    def pump(self, now: float) -> int:
        """One round: at most :data:`BATCH` events of every run that is not :data:`LEAD` steps
        ahead of another one with input left. Returns the events read (0: there is nothing new)."""
        while True:
            read, held = self._round(now)
            if read or not held:
                self.events_read += read
                return read

    def _round(self, now: float) -> tuple[int, bool]:
        """(events read, whether a run was held back); a round that read nothing marked the runs
        it read drained, so the next one reads those held back."""
        floor = min((run.progress.steps_read for run in self.runs.values() if not run.drained), default=0)
        read, held = 0, False
        for rank, run in sorted(self.runs.items()):
            if not run.drained and run.progress.steps_read > floor + LEAD:
                held = True
                continue
            count = 0
            for event in run.follower.read(BATCH):
                if run.follower.rewritten:
                    self._rewritten(rank, run)
                count += 1
                self._event(rank, run.progress, event, now)
            run.progress.files = run.follower.offsets
            run.drained = count < BATCH
            read += count
        return read, held

    def _rewritten(self, rank: int, run: _Run) -> None:
        """The run was deleted and its node sidecar writes it again from the logs: up to the newest
        step the aggregate holds, it is history (see "Resumes" in the module docstring)."""
        run.follower.rewritten = False
        run.progress = RunProgress(history=self.aggregator.writer.max_step)
        log.warning("rank_%d was deleted and is written anew; its steps up to %d are not aggregated again",
                    rank, run.progress.history)

    def _event(self, rank: int, progress: RunProgress, event: event_pb2.Event, now: float) -> None:
        if event.HasField("session_log"):
            start = event.session_log.status == event_pb2.SessionLog.START
            if start and event.step <= progress.last_step and (
                    progress.last_step > progress.history or rank in self.aggregator.snapshot().behind):
                progress.resumed = True
            return
        scalars = {v.tag: v.simple_value for v in event.summary.value
                   if v.tag in _AGGREGATED and v.WhichOneof("value") == "simple_value"}
        if scalars:
            resumed, progress.resumed = progress.resumed, False
            progress.last_step = event.step
            progress.steps_read += 1
            self.aggregator.observe(rank, Record(event.step, event.wall_time, scalars, training_step=True), now, resumed)
            self._mark()
            return
        for value in event.summary.value:
            if value.tag == LAYOUT_TAG:
                self._layout(rank, read_layout(value))

    def _layout(self, rank: int, layout: ParallelLayout | None) -> None:
        if layout is None:
            log.warning("rank_%d: a %s value that is not a layout; ignored", rank, LAYOUT_TAG)
            return
        for line in layout.parallel:
            self.aggregator.note_parallel(line)
        if layout.pipeline is not None:
            self.aggregator.note_pipeline(layout.pipeline)
        self._expect_world()

    def _expect_world(self) -> None:
        """Every rank below the world size the logs state is expected, also before it has a run."""
        parallel = self.aggregator.parallel
        if parallel is not None and parallel.world_size <= MAX_WORLD:
            self.aggregator.expected.update(range(parallel.world_size))

    # -- output ----------------------------------------------------------------------------
    def flush_due(self, now: float) -> None:
        self.aggregator.flush_due(now)
        self._mark()

    def finish(self) -> None:
        """End of input (``--once``): write every step still waiting, with what arrived."""
        self.aggregator.flush()
        self._mark()

    def flush(self) -> None:
        self.aggregator.writer.flush()

    def close(self) -> None:
        self.aggregator.close()
        self.layout.writer.close()

    def abandon(self) -> None:
        """After a write error: close without writing what is still buffered."""
        self.aggregator.writer.abandon()
        self.layout.writer.abandon()

    def _mark(self) -> None:
        """Name the missing ranks in the output when steps were written without them (see the
        module docstring); say when every rank is in again."""
        aggregator = self.aggregator
        step = aggregator.writer.max_step
        if aggregator.incomplete_steps != self._incomplete_seen:
            self._incomplete_seen = aggregator.incomplete_steps
            ranks = aggregator.expected | aggregator.last_step.keys()
            missing = sorted(r for r in ranks if aggregator.last_step.get(r, -1) < step)
            if missing and missing != self.missing:
                self.missing = missing
                self._text(step, f"step {step} and earlier written without rank(s) {rank_ranges(missing)} "
                           f"({aggregator.incomplete_steps} step(s) so far written without every rank)")
        elif self.missing and step > aggregator.writer.view.watermarks.get(MISSING_TAG, -1):
            self.missing = []
            self._text(step, f"step {step} written with every rank again")

    def _text(self, step: int, text: str) -> None:
        self.aggregator.writer.write(Record(max(step, 0), None, texts={MISSING_TAG: text}))

    def status(self) -> str:
        """``following 8 rank run(s), aggregate/job at step 120, 2 step(s) waiting, ...``"""
        aggregator = self.aggregator
        parts = [f"following {len(self.runs)} rank run(s)"]
        if aggregator.writer.max_step >= 0:
            parts.append(f"{self.run_dir.relative_to(self.out)} at step {aggregator.writer.max_step}")
        parts.append(f"{aggregator.pending_steps()} step(s) waiting")
        if aggregator.incomplete_steps:
            parts.append(f"{aggregator.incomplete_steps} step(s) written without every rank")
        if self.missing:
            parts.append(f"missing rank(s) {rank_ranges(self.missing)}")
        return ", ".join(parts)
