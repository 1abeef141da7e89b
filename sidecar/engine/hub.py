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
It is this module's hub (reading rounds, the per-line hot path, ticks, the end of input) and
four parts: :mod:`~sidecar.engine.sources` (which files, in what order),
:mod:`~sidecar.engine.delivery` (records to runs), :mod:`~sidecar.engine.checkpoint` (state
saved and taken back) and :mod:`~sidecar.engine.progress` (what it did, as one snapshot); :mod:`~sidecar.engine.settings` holds what they share.
A replay may run one engine per share of the ranks in worker processes (:meth:`Engine.restrict`,
:mod:`sidecar.service.replay_workers`); what needs every rank then goes through :class:`CrossRank`.
"""

from __future__ import annotations

import logging

from parsers.custom_metrics import CustomMatcher
from parsers.fast_path import TIMED, TORN, Shapes
from parsers.line import text_of
from parsers.prefix import Cut, Message
from parsers.records import MalformedLine, ParallelConfigLine, ParsedLine, PipelineLine, Record
from parsers.torn import tears
from sidecar.analysis.accounting import Accounting, Reason
from sidecar.analysis.aggregate import CrossRankAggregator, EarlyNotes
from sidecar.analysis.alerts import Alerts
from sidecar.analysis.parallel_layout import LayoutNote
from sidecar.following.chains import Chain, Stream
from sidecar.following.tailer import BINARY, Identity
from sidecar.mindspore.ms_follow import SummaryFollower
from sidecar.output import run_names
from sidecar.output.layout import LayoutRun
from sidecar.output.run_meta import RunMetadata
from sidecar.output.samples import SampleTags
from sidecar.output.sink import Sink
from sidecar.output.state import State, StateStore
from sidecar.output.tensorboard import TensorBoardSink
from sidecar.engine.checkpoint import CheckpointPart, trusted
from sidecar.engine.delivery import DeliveryPart, Rank, RankStats
from sidecar.engine.progress import ProgressPart
from sidecar.engine.settings import LEAD, MIN_READ, NOTED, TOTAL_READ, CrossRank, Settings
from sidecar.engine.sources import Source, SourcesPart

log = logging.getLogger(__name__)


class Engine(SourcesPart, DeliveryPart, CheckpointPart, ProgressPart):
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = StateStore(settings.out, settings.instance,
                                run_names.experiment(settings.run_name, settings.label, settings.job))
        self._restored = trusted(self.store.load(), settings.out)
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
        self.samples = SampleTags(self.meta.batch, self._twins_writer)
        if not run_names.needs_hash(settings.run_name):
            self._place(run_names.render(settings.run_name, 0, settings.label, None, settings.job))
        self.bytes_read = 0
        self.lines_read = 0
        self._shapes = Shapes()  # the fast path's answers, per line shape

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
        elif type(parsed) in NOTED:
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

    def flush(self) -> None:
        """Make what was written visible (TensorBoard: no fsync)."""
        for sink in self.sinks:
            sink.flush()

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
