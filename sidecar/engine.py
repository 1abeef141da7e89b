"""The pipeline, shared by ``replay`` and the live daemon.

    discover files -> tail bytes -> split lines by rank -> parse -> assemble per-rank records
    -> sequence (new / duplicate / resume) -> write events, raise alerts -> checkpoint

Invariant: every (rank, tag, step) reaches its run's event files exactly once, however often
the engine is stopped, killed or restarted, and in whatever order overlapping files
(``info.log`` and ``worker_N.log``) are read. Three mechanisms give it:

1. a checkpointed offset never passes a line whose record is not yet durably written (offsets
   are the start of the oldest held line; writers are synced before the state is saved);
2. re-read records are dropped by the rank sequencer (by step and the line's own timestamp);
3. a run writer never writes a (tag, step) its directory already shows, even if that was written
   after the last checkpoint.

The engine is single-threaded and never sleeps: callers decide when to scan, pump and checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from parsers.assembler import StreamAssembler
from parsers.line import parse_message
from parsers.prefix import PrefixSplitter
from parsers.rank_labels import RankRouter
from parsers.records import Family, MalformedLine, PipelineLine, Record
from sidecar.aggregate import CrossRankAggregator
from sidecar.alerts import Alerts
from sidecar.discovery import Candidate, discover
from sidecar.event_scan import RunView
from sidecar.ms_follow import SummaryFollower
from sidecar.run_writer import RunWriter
from sidecar.sequencer import RankSequencer, Verdict
from sidecar.state import FileState, RankState, RunState, State, StateStore, instance_name
from sidecar.tailer import FileTail, Identity

log = logging.getLogger(__name__)

SCAN_PASSES = 4
_RANK_RUN = re.compile(r"rank_(\d+)")


@dataclass
class Settings:
    out: Path
    roots: list[Path]
    default_rank: int = 0
    instance: str = "default"
    from_end: bool = False
    max_line: int = 1 << 20
    companion_wait: float = 0.5
    rank_pattern: str | None = None
    aggregate: bool = True
    aggregate_timeout: float = float("inf")  # replay waits for every rank; live gives up after this
    loss_ranks: set[int] | None = None


@dataclass
class Stream:
    """One rank's lines within one file."""

    assembler: StreamAssembler
    prefix: PrefixSplitter = field(default_factory=PrefixSplitter)
    prev_step: int | None = None


class Source:
    """A followed file and its per-rank streams."""

    def __init__(self, candidate: Candidate, tail: FileTail, router: RankRouter, companion_wait: float) -> None:
        self.candidate = candidate
        self.tail = tail
        self.router = router
        self.companion_wait = companion_wait
        self.streams: dict[int, Stream] = {}
        self.lines = 0
        self.malformed = 0
        self.unseen_since: float | None = None  # monotonic time it left discovery

    def stream(self, rank: int) -> Stream:
        stream = self.streams.get(rank)
        if stream is None:
            stream = self.streams[rank] = Stream(StreamAssembler(self.companion_wait))
        return stream

    def safe_offset(self) -> int:
        pending = [s.assembler.pending_offset for s in self.streams.values()]
        return min((p for p in pending if p is not None), default=self.tail.offset)


@dataclass
class RankStats:
    records: int = 0
    first_step: int | None = None
    last_step: int | None = None
    duplicates: int = 0
    resumes: int = 0
    tags: set[str] = field(default_factory=set)
    families: set[Family] = field(default_factory=set)


class Rank:
    def __init__(self, run_dir: Path, sequencer: RankSequencer, since: RunView | None) -> None:
        self.sequencer = sequencer
        self.writer = RunWriter(run_dir, since)
        self.stats = RankStats()


class Engine:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = StateStore(settings.out, settings.instance)
        self._restored = self.store.load()
        self._restored_files = {f"{f.dev}:{f.ino}": f for f in self._restored.files}
        self.sources: dict[Identity, Source] = {}
        self._order: list[Source] | None = None
        self.ranks: dict[int, Rank] = {}
        self.alerts = Alerts()
        self.summaries = SummaryFollower(self.run_writer, dict(self._restored.summaries))
        self._other_runs: dict[str, RunWriter] = {}
        self.aggregator = (
            CrossRankAggregator(
                settings.out / "aggregate" / instance_name(settings.instance),
                settings.aggregate_timeout,
                settings.loss_ranks,
            )
            if settings.aggregate
            else None
        )
        self.bytes_read = 0

    # -- discovery -------------------------------------------------------------------------
    def scan(self) -> list[Source]:
        """Find files; follow new ones, re-point renamed ones. Returns the sources added.

        The order of a rotation chain comes from the backup numbers, so they must come from one
        consistent look: a rotation between the directory listing and the ``stat`` calls can
        hide a file from a pass or leave it a stale number, and the newer file would be read
        first. So a pass that changed anything is repeated until one changes nothing.
        """
        added: list[Source] = []
        for _ in range(SCAN_PASSES):
            if not self._scan_pass(added):
                break
        self._order = None
        return added

    def _scan_pass(self, added: list[Source]) -> bool:
        """One listing; returns whether it differed from the previous one."""
        changed = False
        now = time.monotonic()
        for source in self.sources.values():
            if source.unseen_since is None:
                source.unseen_since = now
        for candidate in discover(self.settings.roots, self.settings.default_rank, self.settings.out):
            if candidate.summary:
                self.summaries.add(candidate.path)
                continue
            if candidate.ranked and self.aggregator is not None:
                self.aggregator.expected.add(candidate.rank)
            try:
                source = self.sources.get(Identity.of(os.stat(candidate.path)))
                if source is None:
                    tail = FileTail.open(candidate.path, self.settings.max_line)
                    source = self.sources.get(tail.identity)  # the path changed hands in between
                    if source is not None:
                        tail.close()
                    else:
                        source = self.sources[tail.identity] = self._open_source(candidate, tail)
                        added.append(source)
            except FileNotFoundError:
                changed = True  # renamed or deleted between the listing and now
                continue
            except OSError:
                continue  # unreadable (permissions): the next scan tries again
            changed = changed or source.candidate != candidate or source.unseen_since != now
            source.tail.path = candidate.path  # renamed (rotated) files are found under the new name
            source.candidate = candidate
            source.unseen_since = None
        return changed or any(s.unseen_since == now for s in self.sources.values())

    def moved(self) -> bool:
        """Has a followed path been vacated, or does it now hold a file not followed yet?

        One ``stat`` per file; it lets the live loop rescan right after a rotation or a
        delete + recreate, so steps written to the new file wait for no rescan interval.
        """
        for source in self.sources.values():
            try:
                identity = Identity.of(os.stat(source.tail.path))
            except OSError:
                if source.unseen_since is None:
                    return True
                continue
            if identity not in self.sources:
                return True
        return False

    def _open_source(self, candidate: Candidate, tail: FileTail) -> Source:
        router = RankRouter(candidate.rank, self.settings.rank_pattern)
        source = Source(candidate, tail, router, self.settings.companion_wait)
        restored = self._restored_files.pop(tail.identity.key(), None)
        try:
            if restored is not None:
                tail.offset, tail.skipping = restored.offset, restored.skipping
                if tail.verify(restored.head, restored.marker):
                    for rank, snap in restored.streams.items():
                        source.stream(int(rank)).assembler.restore(snap)
                    for rank, step in restored.prev_steps.items():
                        source.stream(int(rank)).prev_step = step
                else:
                    log.info("%s changed while the sidecar was not running; reading it again from the start",
                             candidate.path)
            elif self.settings.from_end:
                tail.start_at_end()
        except OSError as exc:
            log.warning("cannot open %s: %s", candidate.path, exc)
            tail.close()
            raise
        return source

    # -- reading ---------------------------------------------------------------------------
    def ordered_sources(self) -> list[Source]:
        """Sources in reading order; sorted again only after discovery ran or a source left."""
        if self._order is None:
            self._order = sorted(self.sources.values(), key=lambda s: s.candidate.order())
        return self._order

    def pump(self, budget: int, now: float) -> int:
        """Read and process up to ``budget`` bytes per file; older files of a chain first.

        A newer file of a rotation chain is read only once the older ones gave every complete
        line (a partial last line that may never be finished does not hold it up). When the
        newer file has lines, records still held in the older ones are released first: the
        writer moved on, so their companion line (a bar split off by the rollover) is not
        coming there, and releasing them later would put their step after the newer ones.
        """
        total = 0
        blocked_chain: str | None = None
        drained: list[Source] = []  # older files of the current chain, read to their end
        for source in self.ordered_sources():
            chain = source.candidate.chain
            if chain == blocked_chain:
                continue  # an older file of this rotation chain still has lines to give
            if drained and drained[0].candidate.chain != chain:
                drained = []
            before = source.tail.bytes_read
            try:
                lines = source.tail.read(budget)
            except OSError as exc:
                self._lose(source, exc)
                continue
            total += source.tail.bytes_read - before
            if lines:
                for older in drained:
                    self._release(older)
            for start, raw in lines:
                self._line(source, start, raw, now)
            if source.tail.starved:
                blocked_chain = chain
            else:
                drained.append(source)
        self.bytes_read += total
        if self.aggregator is not None:
            self.aggregator.ready = True  # every file was read once: its ranks are known
        return total + self.summaries.pump()

    def _line(self, source: Source, start: int, raw: bytes, now: float) -> None:
        source.lines += 1
        text = raw.decode("utf-8", "replace")
        if text.endswith("\r"):
            text = text[:-1]
        rank, body = source.router.route(text)
        stream = source.stream(rank)
        if self.aggregator is not None:
            self.aggregator.expected.add(rank)
        message = stream.prefix.split(body)
        parsed = parse_message(message)
        if isinstance(parsed, MalformedLine):
            source.malformed += 1
            parsed = None
        elif isinstance(parsed, PipelineLine) and self.aggregator is not None:
            self.aggregator.note_pipeline(parsed)
        for record in stream.assembler.feed(parsed, message.timestamp, start, now):
            self._deliver(rank, stream, record)

    def tick(self, now: float) -> bool:
        """Release held records whose companion line did not come in time (live mode).

        Returns whether a record is still held: the live loop must then wake again within the
        companion wait, however long it would otherwise sleep.
        """
        if self.aggregator is not None:
            self.aggregator.flush_due(now)
        holding = False
        for source in self.sources.values():
            for rank, stream in source.streams.items():
                for record in stream.assembler.flush_due(now):
                    self._deliver(rank, stream, record)
                holding = holding or stream.assembler.pending_offset is not None
        return holding

    def end_of_input(self) -> None:
        """Release every held record (replay: nothing more will come)."""
        for source in self.sources.values():
            self._release(source)
        if self.aggregator is not None:
            self.aggregator.flush()

    def _release(self, source: Source) -> None:
        for rank, stream in source.streams.items():
            for record in stream.assembler.flush():
                self._deliver(rank, stream, record)

    # -- delivery --------------------------------------------------------------------------
    def run_writer(self, name: str) -> RunWriter:
        """The writer of run ``name``: a rank's own for ``rank_N``, else one of its own."""
        rank = _RANK_RUN.fullmatch(name)
        if rank:
            return self.rank(int(rank.group(1))).writer
        writer = self._other_runs.get(name)
        if writer is None:
            writer = self._other_runs[name] = RunWriter(self.settings.out / name)
        return writer

    def _extra_writers(self) -> list[RunWriter]:
        extra = list(self._other_runs.values())
        return extra + [self.aggregator.writer] if self.aggregator is not None else extra

    def _writers(self) -> list[RunWriter]:
        return [rank.writer for rank in self.ranks.values()] + self._extra_writers()

    def rank(self, rank: int) -> Rank:
        entry = self.ranks.get(rank)
        if entry is None:
            key = str(rank)
            rs = self._restored.ranks.get(key, RankState())
            sequencer = RankSequencer(
                rs.last_step,
                rs.last_wall if rs.last_wall is not None else float("-inf"),
                rs.segment_wall if rs.segment_wall is not None else float("-inf"),
            )
            run = self._restored.runs.get(key)
            since = RunView(dict(run.watermarks), run.file, run.size) if run else None
            entry = self.ranks[rank] = Rank(self.settings.out / f"rank_{rank}", sequencer, since)
            view = entry.writer.view
            if view.newest is not None:
                sequencer.catch_up(*view.newest, view.segment_wall)
        return entry

    def _deliver(self, rank_id: int, stream: Stream, record: Record) -> None:
        rank = self.rank(rank_id)
        stats = rank.stats
        if record.training_step:
            went_back = stream.prev_step is not None and record.step < stream.prev_step
            stream.prev_step = record.step
            verdict = rank.sequencer.judge(record, went_back)
            if verdict is not Verdict.STALE and self.aggregator is not None:
                self.aggregator.observe(rank_id, record, time.monotonic(), verdict is Verdict.RESUME)
            if verdict is Verdict.DUPLICATE:
                stats.duplicates += 1
                return
            if verdict is Verdict.STALE:
                return
            if verdict is Verdict.RESUME:
                stats.resumes += 1
                log.info("rank %d: training went back to step %d; later points replace the old ones",
                         rank_id, record.step)
                rank.writer.resume(record.step, record.wall_time,
                                   f"training resumed at step {record.step}; earlier points from this step on were superseded")
            if record.family is not None:
                stats.families.add(record.family)
            stats.records += 1
            stats.first_step = record.step if stats.first_step is None else min(stats.first_step, record.step)
            stats.last_step = record.step
        elif not rank.sequencer.admits_attached(record):
            return
        self.alerts.observe(rank_id, record)
        if rank.writer.write(record):
            stats.tags.update(record.scalars)
            stats.tags.update(record.texts)

    def _lose(self, source: Source, exc: OSError) -> None:
        log.warning("stopped following %s: %s", source.tail.path, exc)
        source.tail.close()
        self.sources.pop(source.tail.identity, None)
        self._order = None

    # -- output ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Make written events visible to TensorBoard (no fsync)."""
        for writer in self._writers():
            writer.flush()

    def checkpoint(self) -> None:
        """Durability barrier for events, then the offsets that depend on them."""
        state = State(summaries=self.summaries.offsets())
        for writer in self._extra_writers():
            writer.sync()
        for rank_id, rank in self.ranks.items():
            view = rank.writer.sync()
            seq = rank.sequencer
            state.ranks[str(rank_id)] = RankState(
                last_step=seq.last_step,
                last_wall=_finite(seq.last_wall),
                segment_wall=_finite(seq.segment_wall),
            )
            state.runs[str(rank_id)] = RunState(file=view.file, size=view.size, watermarks=dict(view.watermarks))
        for key, rank_state in self._restored.ranks.items():
            state.ranks.setdefault(key, rank_state)
        for key, run_state in self._restored.runs.items():
            state.runs.setdefault(key, run_state)
        for source in self.sources.values():
            file_state = self._file_state(source)
            if file_state is not None:
                state.files.append(file_state)
        self.store.save(state)

    def _file_state(self, source: Source) -> FileState | None:
        tail = source.tail
        offset = source.safe_offset()
        held = offset != tail.offset
        saved_offset, tail.offset = tail.offset, offset
        try:
            head, marker = tail.fingerprint()
        except OSError:
            return None
        finally:
            tail.offset = saved_offset
        return FileState(
            path=str(tail.path),
            dev=tail.identity.dev,
            ino=tail.identity.ino,
            offset=offset,
            skipping=tail.skipping and not held,
            head=head,
            marker=marker,
            streams={str(r): s.assembler.snapshot() for r, s in source.streams.items()},
            prev_steps={str(r): s.prev_step for r, s in source.streams.items() if s.prev_step is not None},
        )

    def forget_gone(self, quiet: float) -> None:
        """Stop following files that left discovery ``quiet`` seconds ago and were read to the end.

        A renamed-away file may still be appended to by a writer that holds it open, so it is
        kept (and read) for the quiet period; one with unread bytes (by a fresh ``fstat``, not
        the size the last read saw) is never dropped.
        """
        now = time.monotonic()
        for identity, source in list(self.sources.items()):
            if (
                source.unseen_since is not None
                and now - source.unseen_since >= quiet
                and all(s.assembler.pending_offset is None for s in source.streams.values())
                and source.tail.drained()
            ):
                source.tail.close()
                del self.sources[identity]
                self._order = None

    def abandon(self) -> None:
        """After a write error: close everything without writing what is still buffered."""
        self._close(RunWriter.abandon)

    def close(self) -> None:
        self._close(RunWriter.close)

    def _close(self, how: Callable[[RunWriter], None]) -> None:
        for writer in self._writers():
            how(writer)
        for source in self.sources.values():
            source.tail.close()


def _finite(value: float) -> float | None:
    return value if value != float("-inf") else None
