"""Where records go: each rank's run (its sequencer, thinning, ``vs samples`` twins, layout) and the
experiment's aggregate and layout runs, through the TensorBoard sink's writers.

Contract: every training step record is judged by the rank's sequencer (new, duplicate,
superseded, resume) before anything is written; a new one is counted written, the others under
a named reason (:mod:`sidecar.analysis.accounting`). A rank's run is named when it is first
needed (:mod:`sidecar.output.run_names`), from the start-up lines read so far; the aggregate and
layout runs are placed beside the first rank run named when their path holds the configuration
hash (:meth:`DeliveryPart._place`), else at start. Alerts and lifecycle changes become text events
at their step.

Invariant: a record reaches its run's writer at most once per (tag, step) of the current segment
(the writer drops what the run shows); a record of a rank outside a worker's share is refused
before anything of it is written (:class:`~sidecar.engine.settings.ForeignRank`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from parsers import tags
from parsers.records import Family, Record
from sidecar.analysis.accounting import Reason
from sidecar.analysis.aggregate import CrossRankAggregator
from sidecar.analysis.alerts import Alert, LifecycleChange
from sidecar.analysis.parallel_layout import LAYOUT_TAG
from sidecar.analysis.sequencer import RankSequencer, Verdict, record_identity
from sidecar.following.chains import Stream
from sidecar.output import run_names
from sidecar.output.event_scan import RunView
from sidecar.output.layout import LayoutRun
from sidecar.output.run_writer import RunWriter
from sidecar.output.samples import SAMPLES_RUN
from sidecar.output.state import instance_name
from sidecar.output.thinning import Thinner
from sidecar.engine.settings import CROSS_RANK, RANK_RUN, ForeignRank, Settings

log = logging.getLogger(__name__)


@dataclass
class RankStats:
    records: int = 0
    first_step: int | None = None
    last_step: int | None = None
    resumes: int = 0
    tags: set[str] = field(default_factory=set)
    families: set[Family] = field(default_factory=set)


class Rank:
    def __init__(self, writer: RunWriter, name: str, settings: Settings) -> None:
        self.name = name  # its path under --out
        self.writer = writer
        self.thinner = Thinner(settings.every, self.writer.view) if settings.every > 1 else None
        self.sequencer = RankSequencer(self.writer.max_step, self.writer.holds)
        for key, shown in self.writer.view.recent.items():
            self.sequencer.remember(key, shown)
        self.unjudged = set(self.writer.view.recent)  # written after the checkpoint: its alert baselines have not seen them
        self.stats = RankStats()



class DeliveryPart:
    """The engine's part that names runs and writes records to them (a mixin of :class:`Engine`)."""

    def _place(self, rank_run: str) -> None:
        """Make the experiment's aggregate and layout runs, beside ``rank_run`` (one of its rank runs:
        :func:`~sidecar.output.run_names.beside`). The checkpoint's aggregate snapshot is taken only if
        it is of that run; what was learnt before (:class:`EarlyNotes`) is newer, so it goes after."""
        self._placing = False
        template, instance = self.settings.run_name, instance_name(self.settings.instance)
        self.layout = LayoutRun(self.run_writer(run_names.beside(template, rank_run, "layout", instance)))
        if self._notes is None:
            return
        self.aggregate_run = run_names.beside(template, rank_run, "aggregate", instance)
        aggregator = CrossRankAggregator(self.settings.out / self.aggregate_run, self.settings.aggregate_timeout,
                                         self.settings.loss_ranks, self.tensorboard.writer(self.aggregate_run))
        restored = self._restored
        if restored.aggregate is not None and (restored.aggregate_run or f"aggregate/{instance}") == self.aggregate_run:
            aggregator.restore(restored.aggregate)  # what it waited for before the restart
        self._notes.hand_to(aggregator)
        self.aggregator = self.cross = aggregator
        self._notes = None

    def _twins_writer(self, rank: int) -> RunWriter:
        """The writer of ``rank``'s ``vs samples`` twins, flushed before its run's (RunWriter.derive)."""
        owner = self.rank(rank)
        writer = self.tensorboard.writer(f"{owner.name}/{SAMPLES_RUN}")
        owner.writer.derive(writer)
        return writer

    def run_writer(self, name: str) -> RunWriter:
        """The writer of run ``name``: a rank's own for ``rank_N``, else one of its own."""
        rank = RANK_RUN.fullmatch(name)
        if rank:
            return self.rank(int(rank.group(1))).writer
        return self.tensorboard.writer(name)

    def rank(self, rank: int) -> Rank:
        entry = self.ranks.get(rank)
        if entry is None:
            if self.settings.ranks is not None and rank not in self.settings.ranks:
                raise ForeignRank(rank)
            name = self._run_name(rank)
            run = self._restored.runs.get(str(rank))
            if run is not None and (run.name or f"rank_{rank}") != name:
                run = None  # the checkpoint describes another run of this rank
            if self._placing:
                self._place(name)
            elif self.aggregate_run and run_names.beside(self.settings.run_name, name, "aggregate", instance_name(
                    self.settings.instance)) != self.aggregate_run:
                log.warning("rank %d's run %s is not beside the aggregate %s (its configuration hash differs); "
                            "the aggregate is over every rank this sidecar follows", rank, name, self.aggregate_run)
            self.meta.restore(rank, self.settings.out / name)
            since = RunView(dict(run.watermarks), run.file, run.size) if run else None
            entry = self.ranks[rank] = Rank(self.tensorboard.writer(name, rank, since), name, self.settings)
            self.meta.shown(rank, entry.writer.view.watermarks)
            self.stats[rank] = entry.stats
        return entry

    def _run_name(self, rank: int) -> str:
        """The path of ``rank``'s run under --out, from what was read so far (:mod:`sidecar.output.run_names`)."""
        template = self.settings.run_name
        run = self._restored.runs.get(str(rank))
        digest = self.meta.config_hash(rank) if run_names.uses(template, "config_hash") else None
        if run is not None and run.name and digest is None and run_names.uses(template, "config_hash"):
            return run.name  # a restart past the start-up lines: the run it wrote before
        return run_names.render(template, rank, self.settings.label, digest, self.settings.job)

    def _deliver(self, rank_id: int, stream: Stream, record: Record) -> None:
        rank = self.rank(rank_id)
        stats = rank.stats
        now = self.settings.clock.monotonic()
        if record.training_step:
            verdict = rank.sequencer.judge(record, stream.cursor)
            if verdict is not Verdict.SUPERSEDED and self.cross is not None:
                self.cross.observe(rank_id, record, now, verdict is Verdict.RESUME)
            if rank.unjudged and verdict in (Verdict.DUPLICATE, Verdict.SUPERSEDED):
                self._judge_again(rank_id, rank, record, now, verdict is Verdict.DUPLICATE)
            if verdict is Verdict.DUPLICATE:
                self.accounting.drop(rank_id, Reason.DUPLICATE)
                # read again after a restart: what the step began, the run may not show yet
                self.meta.stepped(rank_id, record, False)
                self._write_layout(rank, rank_id, record)
                self.samples.open(rank_id)  # its twins' run hands the other outputs what it holds past the checkpoint
                throughput = record.scalars.get(tags.THROUGHPUT)
                if throughput is not None and rank.writer.view.watermarks.get(tags.THROUGHPUT, -1) < record.step:
                    # its head was written without the bar before a stop: the bar's part, late
                    self._deliver(rank_id, stream, Record(record.step, record.wall_time,
                                                          {tags.THROUGHPUT: throughput}, late=True))
                return
            if verdict is Verdict.SUPERSEDED:
                self.accounting.drop(rank_id, Reason.SUPERSEDED)
                return
            if verdict is Verdict.RESUME:
                stats.resumes += 1
                log.info("rank %d: training went back to step %d; later points replace the old ones",
                         rank_id, record.step)
                purged = rank.writer.view.watermarks.get(LAYOUT_TAG, -1) >= record.step
                rank.writer.resume(record.step, record.wall_time,
                                   f"training resumed at step {record.step}; earlier points from this step on were superseded")
                if purged and (note := self._layouts.get(rank_id)) is not None:
                    note.purged()  # written again at this step, below
                self.samples.resume(rank_id, record.step, record.wall_time)
                if rank.thinner is not None:
                    rank.thinner.resumed(record.step)
            if record.family is not None:
                stats.families.add(record.family)
            stats.records += 1
            if stats.first_step is None or record.step < stats.first_step:
                stats.first_step = record.step
            stats.last_step = record.step
            self.meta.stepped(rank_id, record, verdict is Verdict.RESUME)
            self.samples.derive(rank_id, record)
            self.accounting.wrote(rank_id)
        elif not stream.cursor.live:
            self.accounting.drop(rank_id, Reason.SUPERSEDED)
            return
        elif record.late:  # a bar after its head was let go: the step's throughput and what it gives
            self.samples.derive(rank_id, record)
        if record.training_step:
            self._write_layout(rank, rank_id, record)  # before the step
        compared = self.cross.compared_ranks() if self.cross is not None else set()
        if record.training_step or record.late:
            raised = self.alerts.raised
            self.alerts.observe(rank_id, record, now, compared)
            thinner = rank.thinner
            if thinner is not None and not thinner.thin(record, self.alerts.raised != raised) and not record.texts:
                if record.training_step:
                    self.accounting.thinned(rank_id)
                return
            self.samples.twins(rank_id, record)
            written = rank.writer.write(record)
        else:  # written first: one the run already shows was read before a restart, and alerted on then
            written = 0 if rank.writer.shows(record) else rank.writer.write(record)  # shows: a copy read again
            self.alerts.observe(rank_id, record, now, compared, seen=not written)
        if written:
            stats.tags.update(record.scalars)
            stats.tags.update(record.texts)
        elif not record.training_step:
            self.accounting.drop(rank_id, Reason.DUPLICATE)

    def _write_layout(self, rank: Rank, rank_id: int, record: Record) -> None:
        """The rank's parallel layout at this training step, if it changed since its run showed it."""
        note = self._layouts.get(rank_id)
        if note is not None and (layout := note.take()) is not None:
            rank.writer.write_values(record.step, record.wall_time or self.settings.clock.time(), [layout])

    def _alert_event(self, alert: Alert) -> None:
        """An alert as a text event at its step: in the rank's run, and for alerts about the ranks
        together in the aggregate run too."""
        record = Record(alert.step, alert.wall_time, texts={f"{tags.ALERTS_PREFIX}{alert.name}": alert.line()})
        if alert.rank is not None:
            self.rank(alert.rank).writer.write(record)
        if self.aggregator is not None and alert.group in CROSS_RANK:
            self.aggregator.writer.write(record)

    def _lifecycle_event(self, change: LifecycleChange) -> None:
        """A rank's training finished, died or runs again: a text event at its step."""
        tag = f"{tags.LIFECYCLE_PREFIX}{change.state.value}"  # one per state: a relaunch may run again at the finish's step
        self.rank(change.rank).writer.write(Record(change.step, change.wall_time, texts={tag: change.line()}))

    def _write_last_points(self) -> None:
        """``--every``: each tag's last point, if it was not kept (see :mod:`sidecar.output.thinning`)."""
        for rank_id, rank in self.ranks.items():
            if rank.thinner is not None:
                for record in rank.thinner.last_points():
                    self.samples.twins(rank_id, record)
                    rank.writer.write(record)

    def _judge_again(self, rank_id: int, rank: Rank, record: Record, now: float, shown: bool) -> None:
        """A record its run holds (``shown``, or superseded since), written after the checkpoint the
        alert baselines come from (read again after a kill): judged again, once, so they are where
        an uninterrupted run's are; what it raises was paged before (``again``). A superseded one
        is no longer the ranks' step: not compared across ranks."""
        key = record_identity(record)
        if key in rank.unjudged:
            rank.unjudged.discard(key)
            compared = self.cross.compared_ranks() if self.cross is not None and shown else set()
            self.alerts.observe(rank_id, record, now, compared, again=True, superseded=not shown)
