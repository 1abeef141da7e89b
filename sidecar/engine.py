"""The pipeline, shared by ``replay`` and the live daemon.

    discover files -> tail bytes -> split lines by rank -> parse -> assemble per-rank records
    -> sequence (new / duplicate / superseded / resume) -> write events, raise alerts -> checkpoint

Beside the records, each stream collects the run configuration lines (:mod:`parsers.run_config`)
into the rank's run metadata (:mod:`sidecar.output.run_meta`, written at checkpoints), which also
names the run (``--run-name``, :mod:`sidecar.output.run_names`) and gives the global batch size
for the batch-derived tags and their ``vs samples`` twins (:mod:`sidecar.output.samples`);
``--every`` thins what reaches a rank's run (:mod:`sidecar.output.thinning`). The aggregate and
layout runs are the experiment's, beside its rank runs (:func:`run_names.beside
<sidecar.output.run_names.beside>`): placed at start, or, when their path holds the configuration
hash, at the first rank run named (:meth:`Engine._place`).

Invariant: every (rank, tag, step) reaches its run's event files exactly once, however often
the engine is stopped, killed or restarted, and in whatever order overlapping files
(``info.log`` and ``worker_N.log``, attempt directories) are read; every step record read is
written or counted under a named reason (:mod:`sidecar.analysis.accounting`). What gives it:

1. a checkpointed offset never passes a line whose record is not yet durably written (offsets
   are the start of the oldest held or unprocessed line; writers are synced before the state
   is saved), and a state that does not match the runs on disk is not trusted;
2. chains are read in the order their data gives (:mod:`sidecar.following.chains`) and the rank
   sequencer judges each record by position and identity, never by clock
   (:mod:`sidecar.analysis.sequencer`);
3. a run writer never writes a (tag, step) its directory already shows, even if that was written
   after the last checkpoint.
4. what later output depends on is in the checkpoint with the offsets that passed the lines it
   came from, and restored before anything is read: each rank's run metadata (so the global
   batch size and world size), the parallel layout its log stated, a head let go without its
   bar (:mod:`parsers.assembler`), the alert detectors (:mod:`sidecar.analysis.watch`). A step
   read again after a restart still marks where its segment began and carries the layout its run
   may not show yet; one written after the checkpoint is judged by the alerts again, paging no
   one twice (:meth:`Engine._judge_again`).

Ranks are read so that they reach the cross-rank aggregate together: while more than
:data:`LEAD` steps wait there for some ranks, only those ranks' files are read (unless they have
no input left), so ranks whose logs differ in bytes per step, or a rank that went back to a
checkpoint first, never make the aggregate hold more than 3·LEAD (the check is made per batch,
see :meth:`Engine._process`). It holds them by design, not by a cap that would write steps
without every rank.

Most lines mean nothing (dataset, memory, MindSpore warnings): :mod:`parsers.fast_path` spots
them (by their shape, mostly without decoding them), and for a run of them the engine does only
what the full path would have done (the stream, the rank, the last timestamp); every other line
takes the full path.

Outputs are sinks (:mod:`sidecar.output.sink`): TensorBoard's (:mod:`sidecar.output.tensorboard`)
owns every run writer and hands what they write to the others (:attr:`Settings.sinks`); each
sink's ``sync()`` is saved in the checkpoint with the offsets it passed, and given back to its
``restore()`` before anything is written. Time comes only from :attr:`Settings.clock`.

The engine is single-threaded and never sleeps: callers decide when to scan, pump and checkpoint.
A replay may run one engine per share of the ranks in worker processes (:meth:`Engine.restrict`,
:mod:`sidecar.service.replay_workers`); what needs every rank then goes through :class:`CrossRank`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from parsers import tags
from parsers.custom_metrics import CustomMatcher, CustomMetric
from parsers.fast_path import TIMED, TORN, Shapes
from parsers.line import text_of
from parsers.prefix import Cut, Message
from parsers.rank_labels import RankRouter
from parsers.records import Family, MalformedLine, ParallelConfigLine, ParsedLine, PipelineLine, Record
from parsers.torn import tears
from sidecar.analysis.accounting import Accounting, Reason
from sidecar.analysis.aggregate import CrossRankAggregator, EarlyNotes
from sidecar.analysis.alerts import Alert, Alerts, LifecycleChange, WatchState
from sidecar.analysis.detectors import AlertSettings, Group
from sidecar.analysis.parallel_layout import LAYOUT_TAG, LayoutNote
from sidecar.analysis.sequencer import RankSequencer, Verdict, record_identity
from sidecar.following.chains import LATE, Chain, Stream, first_record
from sidecar.following.clock import SYSTEM, Clock
from sidecar.following.discovery import Candidate, discover
from sidecar.following.tailer import BINARY, STDIN, STDIN_NAME, FileTail, Identity, StreamTail
from sidecar.mindspore.ms_follow import SummaryFollower
from sidecar.output import run_names
from sidecar.output.event_scan import RunView
from sidecar.output.layout import LayoutRun
from sidecar.output.run_meta import RunMetadata
from sidecar.output.run_writer import RunWriter
from sidecar.output.samples import SAMPLES_RUN, SampleTags
from sidecar.output.sink import Sink
from sidecar.output.state import (
    FileState,
    RankFacts,
    RunState,
    State,
    StateStore,
    StreamState,
    instance_name,
    runs_match,
)
from sidecar.output.tensorboard import TensorBoardSink
from sidecar.output.thinning import Thinner

log = logging.getLogger(__name__)

SCAN_PASSES = 4
LEAD = 256  # steps the aggregate may hold before only the ranks it waits for are read
TOTAL_READ = 8 << 20  # bytes read ahead over all files at once (split between them)
MIN_READ = 64 << 10
_RANK_RUN = re.compile(r"rank_(\d+)")
CROSS_RANK = (Group.BEHIND, Group.DIVERGENCE)  # alerts that also go to the aggregate run
_NOTED = {MalformedLine, PipelineLine, ParallelConfigLine}  # parsed lines _note looks at


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
    alerts: AlertSettings = field(default_factory=AlertSettings)
    alert_sinks: list[Callable[[Alert], None]] = field(default_factory=list)  # besides the log and the runs
    live: bool = False
    run_name: str = run_names.DEFAULT
    label: str | None = None
    job: str | None = None  # --job: the {job} of --run-name
    every: int = 1  # --every: keep every N-th step per tag (sidecar.output.thinning)
    max_file_bytes: int | None = None  # --max-event-file-mb
    metrics: list[CustomMetric] = field(default_factory=list)  # the config file's metrics:
    ranks: set[int] | None = None  # follow only these ranks (a replay worker's share, sidecar.service.replay_workers)
    sinks: list[Sink] = field(default_factory=list)  # outputs besides TensorBoard, fed what it writes
    clock: Clock = SYSTEM  # the engine's only source of time


class ForeignRank(Exception):
    """A line of a rank outside :attr:`Settings.ranks` (a labelled line in another rank's file):
    this engine must not write that rank's run, another one does."""


class CrossRank(Protocol):
    """What sees every rank's training steps: the aggregator, or a replay worker's relay to it."""

    expected: set[int]

    def observe(self, rank: int, record: Record, now: float, resumed: bool = False) -> None: ...

    def note_pipeline(self, line: PipelineLine) -> None: ...

    def note_parallel(self, line: ParallelConfigLine) -> None: ...

    def pending_steps(self) -> int: ...

    def waits_for(self, rank: int) -> bool: ...

    def compared_ranks(self) -> set[int]: ...


class Source:
    """A followed file: its tail, its chain, and the lines read but not processed yet."""

    def __init__(self, candidate: Candidate, tail: FileTail, router: RankRouter, chain: Chain) -> None:
        self.candidate = candidate
        self.tail = tail
        self.router = router
        self.chain = chain
        self.backlog: list[tuple[int, bytes]] = []  # lines read, processed up to ``next``
        self.next = 0
        self.active = False  # it had input left after the last pump
        self.long_lines = 0  # of the tail's count, already accounted
        self.unseen_since: float | None = None  # monotonic time it left discovery
        self.place = 0  # its place in its chain's reading order, oldest first (Engine._place_files)
        self.after_gap = 0  # records left to check for a gap before it (Engine._place_files, Engine._gap)
        self.binary = False  # said that it is binary (FileTail.binary)

    def unprocessed(self) -> bool:
        return self.next < len(self.backlog)

    def holds_records(self) -> bool:
        return any(s.assembler.pending_origin is self for s in self.chain.streams.values())

    def safe_offset(self) -> int:
        """Where a restart must read from: the oldest line whose record is not written yet (or
        that opens a configuration dump not read to its end)."""
        streams = self.chain.streams.values()
        pending = [s.assembler.pending_offset for s in streams if s.assembler.pending_origin is self]
        pending += [dump[0] for s in streams if (dump := s.open_dump) is not None and dump[1] is self]
        if self.unprocessed():
            pending.append(self.backlog[self.next][0])
        return min((p for p in pending if p is not None), default=self.tail.offset)


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


class Engine:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = StateStore(settings.out, settings.instance,
                                run_names.experiment(settings.run_name, settings.label, settings.job))
        self._restored = _trusted(self.store.load(), settings.out)
        self._restored_files = {f"{f.dev}:{f.ino}": f for f in self._restored.files}
        self.sources: dict[Identity, Source] = {}
        self.chains: dict[str, Chain] = {}
        self._order: list[Source] | None = None
        self._pumped = False  # chains found before the first read are ordered by their data
        self._chain_seq = 0  # then in the order found
        self._rescan = False  # a backup appeared before the lines just read: find it first
        self._looked_for: set[Identity] = set()
        self.ranks: dict[int, Rank] = {}
        self.stats: dict[int, RankStats] = {}  # per rank, also of ranks replay workers wrote
        self.accounting = Accounting()
        self.alerts = Alerts(settings.alerts, settings.live)
        self.alerts.writers.append(self._alert_event)
        self.alerts.sinks += settings.alert_sinks
        self.alerts.lifecycle_sinks.append(self._lifecycle_event)
        self._restore_alerts()
        self.tensorboard = TensorBoardSink(settings.out, settings.max_file_bytes, settings.sinks)
        self.sinks: list[Sink] = [self.tensorboard, *settings.sinks]  # in this order at each checkpoint
        for sink in self.sinks:  # before anything is written
            sink.restore(self._restored.sinks.get(sink.name))
        self.summaries = SummaryFollower(self.run_writer, dict(self._restored.summaries))
        self._layouts: dict[int, LayoutNote] = {}  # per rank: what its log states of the parallel layout
        self._fed: dict[int, set[str]] = {}  # per rank: the chains whose lines stated its metadata or layout
        self._recalled: set[int] = set()  # ranks whose facts came back from the checkpoint (_recall)
        self.aggregator: CrossRankAggregator | None = None
        self.layout: LayoutRun | None = None
        self.aggregate_run = ""  # its path under --out, once placed
        self._notes = EarlyNotes() if settings.aggregate else None  # until it is placed
        self.cross: CrossRank | None = self._notes
        self._placing = True  # the experiment's aggregate and layout runs are still to be placed (here)
        self.adopted: list[State] = []  # what replay workers read and wrote (their checkpoint parts)
        self.meta = RunMetadata()
        self.custom = CustomMatcher(settings.metrics) if settings.metrics else None
        self.samples = SampleTags(self.meta.batch, lambda rank: self.run_writer(f"{self.rank(rank).name}/{SAMPLES_RUN}"))
        if not run_names.needs_hash(settings.run_name):
            self._place(run_names.render(settings.run_name, 0, settings.label, None, settings.job))
        self.bytes_read = 0
        self.lines_read = 0
        self._shapes = Shapes()  # the fast path's answers, per line shape

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
        self._place_files(set(added))
        self._order_chains()
        self._order = None
        return added

    def _scan_pass(self, added: list[Source]) -> bool:
        """One listing; returns whether it differed from the previous one."""
        changed = False
        now = self.settings.clock.monotonic()
        for source in self.sources.values():
            if source.unseen_since is None:
                source.unseen_since = now
        unlisted: dict[Path, OSError] = {}  # directories that could not be listed
        for candidate in discover(self.settings.roots, self.settings.default_rank, self.settings.out, unlisted):
            if candidate.summary:
                self.summaries.add(candidate.path)
                continue
            if self.settings.ranks is not None and candidate.rank not in self.settings.ranks:
                continue
            if candidate.ranked and self.cross is not None:
                self.cross.expected.add(candidate.rank)
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
            except OSError as exc:
                self.accounting.unreadable(candidate.path, candidate.rank, exc)
                continue  # the next scan tries again
            self.accounting.readable(candidate.path)
            changed = changed or source.candidate != candidate or source.unseen_since != now
            source.tail.path = candidate.path  # renamed (rotated) files are found under the new name
            source.candidate = candidate
            source.unseen_since = None
        self.accounting.directories(unlisted, self.settings.default_rank)
        if STDIN in self.settings.roots:
            self._follow_stdin(added)
        return changed or any(s.unseen_since == now for s in self.sources.values())

    def _follow_stdin(self, added: list[Source]) -> None:
        """``--watch -``: standard input, one source for the life of the process (it cannot be
        opened again), its rank from its lines' labels or ``--rank``. Its chain ``<stdin>`` is not
        checkpointed: a restart reads a stream that starts over (``kubectl logs -f`` from the pod's
        first line) or goes on from now, and either way the steps it brings are judged afresh
        (the sequencer's identity check drops what the runs hold); the facts its lines stated
        (run metadata, layout) come back."""
        source = next((s for s in self.sources.values() if s.tail.stream), None)
        if source is None:
            try:
                tail = StreamTail(0, self.settings.max_line)
            except OSError as exc:  # no standard input at all (closed)
                self.accounting.unreadable(STDIN_NAME, self.settings.default_rank, exc)
                return
            candidate = Candidate(STDIN_NAME, self.settings.default_rank, str(STDIN_NAME), 0)
            source = self.sources[tail.identity] = self._open_source(candidate, tail)
            added.append(source)
            if self.cross is not None:  # no path names its ranks: those it brought before are expected
                self.cross.expected.update(int(rank) for rank in self._restored.runs)
        source.unseen_since = None

    def input_ended(self) -> bool:
        """Standard input is the input and was read to its end (the live run ends with it)."""
        return any(isinstance(s.tail, StreamTail) and s.tail.eof and not s.unprocessed()
                   for s in self.sources.values())

    def _place_files(self, added: set[Source]) -> None:
        """Each chain's reading order, from this scan's (consistent) backup numbers.

        A file that left discovery keeps the number it was last listed under, which says nothing
        against this listing's: a live file followed while the sidecar was stopped across six
        rollovers was deleted as ``info.log.5`` when it was last seen as ``info.log``, and its
        unread rest must still come before the five files made since. So listed files are ordered
        by their numbers now, and a file that is gone keeps its place: before the listed files
        that came after it, and before every new one (a writer renames or deletes the oldest; it
        never makes a file older than one it let go of). When every file of a chain is new and
        one that was there is gone, the writer may have deleted files it made meanwhile before
        any was read: the oldest new file is marked :attr:`Source.after_gap` (see :meth:`_gap`).
        """
        chains: dict[str, list[Source]] = {}
        for source in self.sources.values():
            chains.setdefault(source.chain.key, []).append(source)
        for members in chains.values():
            before = sorted(members, key=lambda s: (s in added, s.place))
            gone = [s for s in before if s.unseen_since is not None]
            listed = sorted((s for s in members if s.unseen_since is None), key=lambda s: -s.candidate.backup)
            order: list[Source] = []
            for source in listed:
                older = gone if source in added else [g for g in gone if g.place < source.place]
                order += older
                order.append(source)
                gone = [g for g in gone if g not in older]
            order += gone
            if listed and len(order) > len(listed) and all(s in added for s in listed):
                listed[0].after_gap = 2  # the first may be a step whose head was in the file before
            for place, source in enumerate(order):
                source.place = place

    def _order_chains(self) -> None:
        """Give new chains their place: by their first training step before the first read,
        last (in the order found) once reading has begun; see :mod:`sidecar.following.chains`."""
        unordered: dict[str, list[Source]] = {}
        for source in self.sources.values():
            if source.chain.order is None:
                unordered.setdefault(source.chain.key, []).append(source)
        for key, members in sorted(unordered.items()):
            chain = self.chains[key]
            first = None
            if not self._pumped and not members[0].tail.stream:
                paths = [s.tail.path for s in sorted(members, key=lambda s: -s.candidate.backup)]
                startup: dict[int, list[dict[str, object]]] = {}
                first = first_record(paths, members[0].candidate.rank, self.settings.rank_pattern, startup)
                for rank, updates in startup.items():  # the configuration before any run is named
                    if rank not in self._recalled:  # else the checkpoint has it, and maybe more since
                        self._fed.setdefault(rank, set()).add(key)
                        for update in updates:
                            self.meta.note(rank, update)
            self._chain_seq += 1
            chain.order = (*(first if first is not None else LATE), self._chain_seq)

    def moved(self) -> bool:
        """Has a followed path been vacated, or does it now hold a file not followed yet?

        One ``stat`` per file; it lets the live loop rescan right after a rotation or a
        delete + recreate, so steps written to the new file wait for no rescan interval.
        """
        for source in self.sources.values():
            if source.tail.stream:
                continue
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
        chain = self.chains.get(candidate.chain)
        if chain is None:
            chain = self.chains[candidate.chain] = Chain(candidate.chain)
            self._recall(chain.key)
        source = Source(candidate, tail, RankRouter(candidate.rank, self.settings.rank_pattern), chain)
        restored = self._restored_files.pop(tail.identity.key(), None)
        try:
            if restored is not None:
                tail.offset, tail.skipping = restored.offset, restored.skipping
                if not tail.verify(restored.head, restored.marker, restored.marker_kind):
                    if restored.path == str(candidate.path):
                        log.warning("%s was rewritten while the sidecar was not running (it no longer holds the "
                                    "lines read before byte %d); reading it again from the start",
                                    candidate.path, restored.offset)
                    else:  # a rotation deleted that file, and a new one got its inode
                        log.info("%s is a new file in the place (inode) of %s; reading it from the start",
                                 candidate.path, restored.path)
            elif self.settings.from_end:
                tail.start_at_end()
        except OSError:
            tail.close()
            raise
        return source

    def _recall(self, chain: str) -> None:
        """A chain found: the checkpointed facts of the ranks its lines stated, before anything
        is read (see point 4 of the module docstring)."""
        for key, facts in self._restored.facts.items():
            rank = int(key)
            if chain not in facts.chains or rank in self._recalled or rank in self._fed:
                continue
            self._recalled.add(rank)
            self._fed[rank] = set(facts.chains)
            if facts.meta is not None:
                run = self._restored.runs.get(key)
                self.meta.load(rank, facts.meta, self.settings.out / (run.name if run and run.name else f"rank_{rank}"))
            if facts.layout is not None:
                self._layouts[rank] = LayoutNote(facts.layout)

    def _stream(self, chain: Chain, rank: int) -> Stream:
        stream = chain.streams.get(rank)
        if stream is None:
            stream = chain.stream(rank, self.settings.companion_wait)
            saved = self._restored.chains.get(chain.key, {}).get(str(rank))
            if saved is not None:
                stream.assembler.restore(saved.assembler)
                stream.cursor.prev_step, stream.cursor.live = saved.prev_step, saved.live
        return stream

    # -- reading ---------------------------------------------------------------------------
    def ordered_sources(self) -> list[Source]:
        """Sources in reading order: per rank, chains in their order, each chain oldest file
        first. Sorted again only after discovery ran or a source left."""
        if self._order is None:
            self._order = sorted(
                self.sources.values(),
                key=lambda s: (s.candidate.rank, s.chain.order, s.chain.key, s.place),
            )
        return self._order

    def pump(self, budget: int, now: float) -> int:
        """Read and process input; returns how much was done (bytes read + lines processed).

        Per rank, a file is read only once every file before it in reading order has given all
        its complete lines (a partial last line that may never be finished does not hold it
        up): a rotation chain's older files first, and a copy or a later attempt after what it
        copies or continues. Across ranks, the aggregate's hold-back (see the module docstring).
        """
        self._pumped = True
        held = self._holding_back()
        stalled = held and not any(self._waited(s) for s in self.sources.values() if s.active)
        work = self._round(budget, now, stalled)
        if held and not stalled and not work:
            work = self._round(budget, now, True)  # the ranks waited for gave nothing after all
        if self._rescan:
            self._rescan = False
            self.scan()
        if self.aggregator is not None:
            self.aggregator.ready = True  # every file was read once: its ranks are known
            self.aggregator.flush_due(now)  # steps complete since then
        return work + self.summaries.pump()

    def _round(self, budget: int, now: float, unheld: bool) -> int:
        sources = self.ordered_sources()
        per_file = max(MIN_READ, min(budget, TOTAL_READ // max(len(sources), 1)))
        work = 0
        busy: set[int] = set()  # ranks whose earlier file still has input
        for source in sources:
            rank = source.candidate.rank
            if rank in busy or not (unheld or self._may_read(source)):
                continue
            fresh = not source.unprocessed()  # read now; else only lines read before are processed
            if fresh:
                before = source.tail.bytes_read
                try:
                    source.backlog, source.next = source.tail.read(per_file), 0
                except OSError as exc:
                    self._lose(source, exc)
                    continue
                read = source.tail.bytes_read - before
                self.bytes_read += read
                work += read
                self.accounting.drop(rank, Reason.TOO_LONG, source.tail.long_lines - source.long_lines)
                source.long_lines = source.tail.long_lines
                if source.tail.binary != source.binary:
                    self._binary(source)
                if read and source.backlog and source.backlog[0][0] == 0 and self._new_backup(source):
                    # copytruncate: the content before these lines is now in a backup that
                    # comes first in the chain. Find it before reading on.
                    self._rescan = True
                    source.active = True
                    busy.add(rank)
                    continue
            work += self._process(source, now, unheld)
            # lines read in an earlier round (held for a rescan, or by the aggregate) say nothing
            # of what the file holds now: the files after it wait until it was read again
            source.active = source.unprocessed() or source.tail.starved or not fresh
            if source.active:
                busy.add(rank)
        return work

    def _binary(self, source: Source) -> None:
        """A file found binary (or text again, rewritten): said once, counted as an unreadable file."""
        source.binary = source.tail.binary
        if source.binary:
            self.accounting.drop(source.candidate.rank, Reason.UNREADABLE)
            log.warning("%s holds %s; it is not read ('mstb-sidecar check PATH' shows what each file was taken for)",
                        source.tail.path, BINARY)

    def _new_backup(self, source: Source) -> bool:
        """Is there a first backup (``info.log.1``) of this live file that no scan has seen yet?
        (Asked once per backup: one that discovery does not take must not stall the file.) Asked
        only of reads from byte 0: a new file or one truncated in place; lines after others read
        before follow them, whatever a rotation did since."""
        if source.candidate.backup:
            return False
        try:
            backup = Identity.of(os.stat(source.tail.path.with_name(source.tail.path.name + ".1")))
        except OSError:
            return False
        if backup in self.sources or backup in self._looked_for:
            return False
        self._looked_for.add(backup)
        return True

    def _holding_back(self) -> bool:
        return self.cross is not None and self.cross.pending_steps() > LEAD

    def _waited(self, source: Source) -> bool:
        return self.cross is not None and self.cross.waits_for(source.candidate.rank)

    def _may_read(self, source: Source) -> bool:
        """Below LEAD waiting steps every file may be read; above it, only the files of ranks the
        oldest waiting step waits for."""
        return not self._holding_back() or self._waited(source)

    def _process(self, source: Source, now: float, unheld: bool) -> int:
        """Lines of the backlog, while the file may be read (see :meth:`_may_read`), in batches
        checked once each. At or below LEAD waiting steps a batch may take them to 2·LEAD (a line
        adds at most one); a file the oldest waiting step waits for takes LEAD lines at a time
        (it is behind that step, so at most LEAD more wait after them). Batches of a line or two
        would cost more than the lines."""
        done = 0
        aggregator = self.cross
        while (left := len(source.backlog) - source.next) > 0:
            if unheld or aggregator is None:
                batch = left
            elif (pending := aggregator.pending_steps()) <= LEAD:
                batch = 2 * LEAD + 1 - pending
            elif self._waited(source):
                batch = LEAD
            else:
                break
            batch = min(batch, left)
            self._lines(source, source.next, source.next + batch, now)
            source.next += batch
            done += batch
        self.lines_read += done
        return done

    def _lines(self, source: Source, begin: int, end: int, now: float) -> None:
        """Backlog lines ``begin`` to ``end``: plain ones (:mod:`parsers.fast_path`) passed over, the
        others parsed."""
        classify = self._shapes.classify if source.router.plain_lines and self.custom is None else None
        skipped = False  # lines the fast path found nothing in since the last full one
        timed = None  # the last of them with a timestamp
        for start, raw in source.backlog[begin:end]:
            if classify is None:  # custom metrics look at every line, and a --rank-pattern labels any
                if at := tears(raw, source.router.plain_lines):
                    raw = self._torn(source, start, raw, at)
                text, cut = text_of(raw), None
            else:
                kind, text, cut = classify(raw)
                if kind == TORN:
                    if skipped:  # the torn pieces' labels move the router on
                        self._skip(source, timed)
                        skipped, timed = False, None
                    raw = self._torn(source, start, raw, tears(raw))
                    kind, text, cut = classify(raw)
                if kind:
                    skipped = True
                    if kind == TIMED:
                        timed = raw
                    continue
            if skipped:
                self._skip(source, timed)
                skipped, timed = False, None
            self._line(source, start, text, now, cut)
        if skipped:
            self._skip(source, timed)

    def _torn(self, source: Source, start: int, raw: bytes, at: list[int]) -> bytes:
        """A line that holds later log lines (:mod:`parsers.torn`): each piece before the last was
        cut off by the next and is counted as malformed, under the rank its label names; the
        last piece is read as the line, at the line's offset (a checkpoint never points inside
        a line: a restart reads the whole line again and splits it again)."""
        for begin, end in zip([0, *at], at):
            rank, _ = source.router.route(text_of(raw[begin:end]))
            self.accounting.drop(rank, Reason.MALFORMED)
        log.warning("%s: the line at byte %d holds the start of another at byte %d (a writer killed mid-line); "
                    "the part cut off is not read", source.tail.path, start, start + at[-1], extra={"rate_key": "torn"})
        return raw[at[-1]:]

    def _skip(self, source: Source, timed: bytes | None) -> None:
        """What the full path does with a run of plain lines (the stream, the rank, the time of
        the last one with a time): they keep the rank of the line before them."""
        rank = source.router.current
        stream = self._stream(source.chain, rank)
        if timed is not None:
            stream.skip(text_of(timed))
        if self.cross is not None:
            self.cross.expected.add(rank)

    def _line(self, source: Source, start: int, text: str, now: float, cut: Cut | None) -> None:
        rank, body = source.router.route(text)
        stream = self._stream(source.chain, rank)
        if self.cross is not None:
            self.cross.expected.add(rank)
        parsed, records = stream.feed(body, start, now, source, cut if body is text else None)
        if stream.startup.updates:
            self.meta.note(rank, stream.startup.take())
            self._fed.setdefault(rank, set()).add(source.chain.key)
        if parsed is None:
            if self.custom is not None and stream.message is not None:
                self._custom(rank, stream, stream.message)
        elif type(parsed) in _NOTED:
            self._note(rank, parsed, source.chain.key)
        if stream.assembler.malformed:
            self.accounting.drop(rank, Reason.MALFORMED, stream.assembler.take_malformed())
        for record in records:
            if source.after_gap and record.training_step:
                self._gap(source, rank, stream, record)
            self._deliver(rank, stream, record)

    def _gap(self, source: Source, rank: int, stream: Stream, record: Record) -> None:
        """One of the first records after files the writer may have deleted unread: if the steps
        jump past the chain's stride, they did; warn and count the steps lost."""
        source.after_gap -= 1
        prev, stride = stream.cursor.prev_step, stream.cursor.stride
        if prev is None or record.step <= prev + stride:
            return
        source.after_gap = 0
        lost = (record.step - prev) // stride - 1
        self.accounting.drop(rank, Reason.DELETED_UNREAD, lost)
        log.warning("rank %d: steps %d-%d are lost: the writer deleted the rotated backups that held them before "
                    "they were read (%s rolled over more often than it keeps backups while the sidecar was stopped "
                    "or behind)", rank, prev + stride, record.step - stride, source.chain.key)

    def _note(self, rank: int, parsed: ParsedLine, chain: str) -> None:
        """A line that is not a record but tells the engine something (or is counted)."""
        if isinstance(parsed, (PipelineLine, ParallelConfigLine)):
            self._layouts.setdefault(rank, LayoutNote()).note(parsed)  # not the run: it is named at its first step
            self._fed.setdefault(rank, set()).add(chain)
        if isinstance(parsed, MalformedLine):
            self.accounting.drop(rank, Reason.MALFORMED)
        elif isinstance(parsed, PipelineLine) and self.cross is not None:
            self.cross.note_pipeline(parsed)
        elif isinstance(parsed, ParallelConfigLine) and self.cross is not None:
            self.cross.note_parallel(parsed)

    def _custom(self, rank: int, stream: Stream, message: Message) -> None:
        """A line no built-in parser claimed: the ``metrics:`` of the config file."""
        assert self.custom is not None
        malformed = self.custom.malformed
        found = self.custom.match(message)
        if found is not None:
            self._deliver(found[0] if found[0] is not None else rank, stream, found[1])
        elif self.custom.malformed != malformed:
            self.accounting.drop(rank, Reason.MALFORMED)

    def tick(self, now: float) -> bool:
        """Release held records whose companion line did not come in time (live mode).

        Returns whether a record is still held: the live loop must then wake again within the
        companion wait, however long it would otherwise sleep.
        """
        if self.aggregator is not None:
            self.aggregator.flush_due(now)
        holding = False
        for chain in self.chains.values():
            for rank, stream in chain.streams.items():
                for record in stream.assembler.flush_due(now):
                    self._deliver(rank, stream, record)
                holding = holding or stream.assembler.pending_offset is not None
        if not any(source.active for source in self.sources.values()):  # caught up: ranks compare fairly
            self.alerts.check_behind()
        self.alerts.check_stalls(now)
        return holding

    def end_of_input(self) -> None:
        """Replay: nothing more will come (:meth:`drain`, then :meth:`finish`)."""
        self.drain()
        self.finish()

    def drain(self) -> None:
        """Release every held record. A file that ends in an unfinished line (a writer killed
        mid-line) is not parsed there, since a cut number would be a wrong value: that line is
        counted as malformed."""
        for source in self.sources.values():
            if not source.tail.skipping and not source.tail.drained():
                self.accounting.drop(source.candidate.rank, Reason.MALFORMED)
                log.warning("%s ends in an unfinished line; it is not read", source.tail.path)
        for chain in self.chains.values():
            for rank, stream in chain.streams.items():
                for record in stream.assembler.flush():
                    self._deliver(rank, stream, record)
                stream.startup.flush()
                if stream.startup.updates:
                    self.meta.note(rank, stream.startup.take())

    def finish(self, front: int | None = None) -> None:
        """After :meth:`drain`: write what the aggregate still holds, judge ranks behind (against
        ``front``, the furthest step of every rank, when other engines follow some of them) and
        write the last points ``--every`` held back."""
        if self.aggregator is not None:
            self.aggregator.flush()
        self.alerts.check_behind(front)
        self._write_last_points()

    def _write_last_points(self) -> None:
        """``--every``: each tag's last point, if it was not kept (see :mod:`sidecar.output.thinning`)."""
        for rank_id, rank in self.ranks.items():
            if rank.thinner is not None:
                for record in rank.thinner.last_points():
                    self.samples.twins(rank_id, record)
                    rank.writer.write(record)

    # -- delivery --------------------------------------------------------------------------
    def run_writer(self, name: str) -> RunWriter:
        """The writer of run ``name``: a rank's own for ``rank_N``, else one of its own."""
        rank = _RANK_RUN.fullmatch(name)
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

    def _judge_again(self, rank_id: int, rank: Rank, record: Record, now: float, shown: bool) -> None:
        """A record its run holds (``shown``, or superseded since), written after the checkpoint the
        alert baselines come from (read again after a kill): judged again, once, so they are where
        an uninterrupted run's are; what it raises was paged before (``again``). A superseded one
        is no longer the ranks' step: not compared across ranks."""
        key = record_identity(record)
        if key in rank.unjudged:
            rank.unjudged.discard(key)
            compared = self.cross.compared_ranks() if self.cross is not None and shown else set()
            self.alerts.observe(rank_id, record, now, compared, again=True)

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

    def _restore_alerts(self) -> None:
        """The checkpoint's lifecycles and open alert episodes (:meth:`Alerts.restore`)."""
        now, mine = self.settings.clock.monotonic(), self.settings.ranks
        for key, run in self._restored.runs.items():
            if run.alerts is not None and (mine is None or int(key) in mine):
                self.alerts.restore(int(key), run.alerts, now)
        if self._restored.together is not None or self._restored.firing:
            self.alerts.restore(-1, self._restored.together or WatchState(firing=self._restored.firing), now)

    def _lose(self, source: Source, exc: OSError) -> None:
        self.accounting.unreadable(source.tail.path, source.candidate.rank, exc)
        source.tail.close()
        self.sources.pop(source.tail.identity, None)
        self._order = None

    # -- replay workers (sidecar.service.replay_workers) --------------------------------------
    def restrict(self, ranks: set[int], cross: CrossRank) -> None:
        """Become a worker's engine: read only the files of ``ranks``; what needs every rank (the
        aggregate, divergence) goes to ``cross``, which relays it to the parent."""
        self.settings.ranks = ranks
        self.alerts.only(ranks)
        for identity, source in list(self.sources.items()):
            if source.candidate.rank not in ranks:
                source.tail.close()
                del self.sources[identity]
        self._order = None
        self.aggregator = None
        self.cross = cross
        self._placing = False  # the parent places them (hand_over)

    def hand_over(self) -> None:
        """The parent's side of :meth:`restrict`: workers read every file, none is read here. The
        aggregate, which the parent writes, is placed now if it still waits for a rank's run name:
        the one a worker gives its lowest rank from the start-up lines read so far (:meth:`scan`)."""
        self.alerts.only(set())
        if self._placing and self.sources:
            self._place(self._run_name(min(source.candidate.rank for source in self.sources.values())))
        for source in self.sources.values():
            source.tail.close()
        self.sources.clear()
        self.chains.clear()
        self._order = None

    def files(self) -> dict[str, int]:
        """Every file followed, here or by replay workers: path -> offset read to."""
        found = {f.path: f.offset for part in self.adopted for f in part.files}
        found.update((str(s.tail.path), s.tail.offset) for s in self.sources.values())
        return found

    def adopt(self, part: State, stats: dict[int, RankStats], accounting: Accounting) -> None:
        """What a worker read and wrote: its checkpoint part (saved with this engine's), its
        ranks' figures and its counts."""
        self.adopted.append(part)
        self.stats.update(stats)
        self.accounting.merge(accounting)

    # -- output ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Make what was written visible (TensorBoard: no fsync)."""
        for sink in self.sinks:
            sink.flush()

    def checkpoint(self, parts: list[State] | None = None) -> None:
        """Durability barrier for events, then the offsets that depend on them. ``parts``: those
        replay workers handed over while they read, instead of their last ones (:attr:`adopted`)."""
        parts = self.adopted if parts is None else parts
        marks = [rank.writer.view.watermarks for rank in self.ranks.values()]
        marks += [run.watermarks for part in parts for run in part.runs.values()]
        if self.layout is not None:
            self.layout.update((t for m in marks for t in m),
                               self.aggregator.writer.view.watermarks if self.aggregator is not None else ())
        self.store.save(self.state(parts))

    def state(self, parts: list[State] | None = None) -> State:
        """Sync every writer and describe what they hold and where each file was read to, with the
        parts replay workers handed over (``parts``, by default :attr:`adopted`)."""
        for rank_id, values in self.meta.write_due({rank_id: rank.writer for rank_id, rank in self.ranks.items()}).items():
            self.tensorboard.meta(self.ranks[rank_id].name, rank_id, values)
        mine = self.settings.ranks  # a worker hands over only its own ranks
        state = State(summaries=self.summaries.offsets(), facts=self._facts(mine))
        for part in self.adopted if parts is None else parts:
            state.files += part.files
            state.runs.update(part.runs)
            state.facts.update(part.facts)
            for key, streams in part.chains.items():
                state.chains.setdefault(key, {}).update(streams)
        handed = set(state.runs)
        for sink in self.sinks:  # TensorBoard first: what the others were handed is durable in the runs
            saved = sink.sync()
            if saved is not None:
                state.sinks[sink.name] = saved
        if self.aggregator is not None:
            state.aggregate, state.aggregate_run = self.aggregator.snapshot(), self.aggregate_run
        elif self._placing:  # not placed yet: what the checkpoint had of it still holds
            state.aggregate, state.aggregate_run = self._restored.aggregate, self._restored.aggregate_run
        for rank_id, rank in self.ranks.items():
            view = rank.writer.view  # synced above
            state.runs[str(rank_id)] = RunState(name=rank.name, file=view.file, size=view.size,
                                                watermarks=dict(view.watermarks))
        for key, run_state in self._restored.runs.items():
            if mine is None or int(key) in mine:
                state.runs.setdefault(key, run_state)
        for key, facts in self._restored.facts.items():  # of logs not followed again (yet)
            if mine is None or int(key) in mine:
                state.facts.setdefault(key, facts)
        for chain in self.chains.values():
            if chain.key == str(STDIN_NAME):  # a stream is not read again: after a restart its steps begin anew
                continue
            state.chains[chain.key] = {
                str(rank): StreamState(assembler=s.assembler.snapshot(), prev_step=s.cursor.prev_step, live=s.cursor.live)
                for rank, s in chain.streams.items()
            }
        for key, streams in self._restored.chains.items():
            state.chains.setdefault(key, {r: s for r, s in streams.items() if mine is None or int(r) in mine})
        for key, run_state in state.runs.items():  # but those replay workers observed, and handed over
            if key not in handed and (watch := self.alerts.snapshot(int(key))) is not None:
                state.runs[key] = run_state.model_copy(update={"alerts": watch})
        state.together = self.alerts.snapshot(-1)
        state.firing = state.together.firing if state.together is not None else []
        for source in self.sources.values():
            file_state = self._file_state(source)
            if file_state is not None:
                state.files.append(file_state)
        return state

    def _facts(self, mine: set[int] | None) -> dict[str, RankFacts]:
        """Each rank's (of ``mine``, if given) metadata and layout, with the chains that stated them."""
        metas = self.meta.snapshot(mine)
        ranks = {int(key) for key in metas} | {rank for rank in self._layouts if mine is None or rank in mine}
        return {
            str(rank): RankFacts(chains=sorted(self._fed.get(rank, ())), meta=metas.get(str(rank)),
                                 layout=note.snapshot() if (note := self._layouts.get(rank)) is not None else None)
            for rank in ranks
        }

    def _file_state(self, source: Source) -> FileState | None:
        tail = source.tail
        if tail.stream:  # cannot be read again: only its chain's state is kept
            return None
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
            marker_kind=2,
        )

    def forget_gone(self, quiet: float) -> None:
        """Stop following files that left discovery ``quiet`` seconds ago and were read to the end.

        A renamed-away file may still be appended to by a writer that holds it open, so it is
        kept (and read) for the quiet period; one with unread bytes (by a fresh ``fstat``, not
        the size the last read saw) or a held record is never dropped.
        """
        now = self.settings.clock.monotonic()
        for identity, source in list(self.sources.items()):
            if (
                source.unseen_since is not None
                and now - source.unseen_since >= quiet
                and not source.unprocessed()
                and not source.holds_records()
                and source.tail.drained()
            ):
                source.tail.close()
                del self.sources[identity]
                self._order = None

    def abandon(self) -> None:
        """After a write error: close everything without writing what is still buffered."""
        self.tensorboard.abandon()
        self._close_sources()

    def close(self) -> None:
        self._write_last_points()
        for sink in self.sinks:
            sink.close()
        self._close_sources()

    def _close_sources(self) -> None:
        for source in self.sources.values():
            source.tail.close()


def _trusted(state: State, out: Path) -> State:
    """The restored state, if it describes the runs on disk; else a fresh start, with a warning.

    A state copied from another job, rolled back, or left after the runs were deleted would
    claim points the runs do not have, and its offsets would skip them for good. Reading every
    log again instead loses nothing: the run writers drop what the runs already show.
    """
    lost = runs_match(out, state)
    if not lost:
        return state
    log.warning("the checkpoint does not match the runs in %s (%s); reading every log again from the start, "
                "points the runs already show are not written twice", out, "; ".join(lost.values()))
    return State()
