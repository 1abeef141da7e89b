"""What an engine did so far, as one snapshot (:class:`Progress`) that the service layer reads (the
status line, the replay summary, the metrics endpoint) instead of reaching into the engine.

Contract: :meth:`ProgressPart.progress` copies what it reports (counters, sets), so a snapshot
does not change when the engine goes on, and a reader in another thread (a Prometheus scrape)
never sees a figure half-updated by the next line; it costs O(ranks + files + sinks), taken when
asked, never on the hot path. Ranks are those this engine or its replay workers wrote, and those
whose lifecycle the checkpoint brought back.

Invariant: the snapshot's counts are the engine's own (:mod:`sidecar.analysis.accounting`, the
run writers, the sinks' ``health()``), so the status line, the summary and the metrics agree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from parsers.lifecycle import Lifecycle
from parsers.records import Family
from sidecar.analysis.accounting import Accounting
from sidecar.analysis.detectors import Group


@dataclass(frozen=True)
class RankProgress:
    """One rank: its step records (of this start), its run, its lifecycle and how far its files lag."""

    records: int = 0  # step records written
    first_step: int | None = None
    last_step: int | None = None  # the last step record written
    resumes: int = 0
    tags: frozenset[str] = frozenset()
    families: frozenset[Family] = frozenset()
    run: str | None = None  # its path under --out, when this engine writes it
    points: int = 0  # values this engine wrote to its run
    lag_bytes: int = 0  # bytes its files hold that were not read yet
    lifecycle: Lifecycle | None = None
    watched_step: int | None = None  # the latest step the alerts saw (also restored from the checkpoint)
    arrived: float | None = None  # monotonic time of that step


@dataclass(frozen=True)
class AggregateProgress:
    run: str  # its path under --out
    pending: int  # steps it waits for a rank to report
    incomplete: int  # steps written without every rank
    points: int  # values written to its run


@dataclass(frozen=True)
class Progress:
    instance: str
    out: Path
    files: Mapping[str, int]  # every file followed here or by replay workers: path -> offset read to
    following: int  # files followed by this engine now
    bytes_read: int
    lines_read: int
    lag_bytes: int  # over every file followed now
    ranks: Mapping[int, RankProgress]
    written_here: frozenset[int]  # the ranks whose runs this engine writes (this start)
    reported: frozenset[int]  # the ranks whose runs this engine or its replay workers write
    accounting: Accounting  # a copy: counts by rank and reason
    aggregate: AggregateProgress | None
    summary_events: int  # MindSpore summary events converted
    summary_files: int
    alerts: Mapping[tuple[int, str], int]  # (rank or -1, name) -> episodes begun
    alert_groups: Mapping[Group, int]
    alerts_active: Mapping[tuple[int, str], bool]
    alerts_started: Mapping[tuple[int, str], float]  # monotonic time of the last start
    sinks: Mapping[str, Mapping[str, int]] = field(default_factory=dict)  # name -> health() counts


class ProgressPart:
    """The engine's part that describes it (a mixin of :class:`~sidecar.engine.hub.Engine`)."""

    def progress(self) -> Progress:
        lag: Counter[int] = Counter()
        for source in list(self.sources.values()):  # list(): one step, should a scrape run meanwhile
            lag[source.candidate.rank] += max(source.tail.size - source.tail.offset, 0)
        watches = self.alerts.ranks
        ranks: dict[int, RankProgress] = {}
        for rank_id in sorted(self.stats.keys() | watches.keys() | lag.keys()):
            stats, watch, here = self.stats.get(rank_id), watches.get(rank_id), self.ranks.get(rank_id)
            ranks[rank_id] = RankProgress(
                records=stats.records if stats else 0,
                first_step=stats.first_step if stats else None,
                last_step=stats.last_step if stats else None,
                resumes=stats.resumes if stats else 0,
                tags=frozenset(stats.tags) if stats else frozenset(),
                families=frozenset(stats.families) if stats else frozenset(),
                run=here.name if here else None,
                points=here.writer.points_written if here else 0,
                lag_bytes=lag[rank_id],
                lifecycle=watch.lifecycle if watch else None,
                watched_step=watch.last_step if watch else None,
                arrived=watch.arrived if watch else None,
            )
        aggregator = self.aggregator
        aggregate = None if aggregator is None else AggregateProgress(
            self.aggregate_run, aggregator.pending_steps(), aggregator.incomplete_steps,
            aggregator.writer.points_written)
        return Progress(
            instance=self.settings.instance, out=self.settings.out, files=self.files(),
            following=len(self.sources), bytes_read=self.bytes_read, lines_read=self.lines_read,
            lag_bytes=sum(lag.values()), ranks=ranks, written_here=frozenset(self.ranks), reported=frozenset(self.stats),
            accounting=self.accounting.copy(),
            aggregate=aggregate, summary_events=self.summaries.events, summary_files=len(self.summaries.files),
            alerts=dict(self.alerts.counts), alert_groups=dict(self.alerts.groups),
            alerts_active=dict(self.alerts.active), alerts_started=dict(self.alerts.started),
            sinks={sink.name: dict(sink.health()) for sink in self.sinks},
        )
