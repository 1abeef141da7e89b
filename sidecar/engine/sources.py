"""The engine's inputs: which files it follows (discovery), in what order it reads them, and when
it lets them go.

Contract: a file is followed by identity (device, inode), not by path, so a rotation renames it
without a second read; each rotation chain is read oldest file first, and chains in the order
their data gives (:mod:`sidecar.following.chains`); the order of a chain comes from one
consistent listing (:meth:`SourcesPart.scan` repeats a pass that changed anything); a new backup
that holds what a file of its chain was read to (a ``copytruncate`` copy) is read on from there
(:meth:`SourcesPart._read_on_in_copies`). A file is let go only once it left discovery for the
quiet period, was read to its end and holds no record (:meth:`SourcesPart.forget_gone`). A
replay worker follows only its share of the ranks (:meth:`SourcesPart.restrict`); its parent
then follows none (:meth:`SourcesPart.hand_over`).

Invariant: :meth:`Source.safe_offset` never passes a line whose record is not written yet (or
a configuration dump not read to its end): it is the offset a checkpoint saves.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from parsers.rank_labels import RankRouter
from sidecar.following.chains import LATE, Chain, Stream, first_record
from sidecar.following.discovery import Candidate, discover
from sidecar.following.tailer import STDIN, STDIN_NAME, FileTail, Identity, StreamTail
from sidecar.analysis.parallel_layout import LayoutNote
from sidecar.engine.settings import SCAN_PASSES, CrossRank

log = logging.getLogger(__name__)


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



class SourcesPart:
    """The engine's part that finds, orders and lets go of its files (a mixin of :class:`Engine`)."""

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
        self._read_on_in_copies(added)
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

    def _read_on_in_copies(self, added: list[Source]) -> None:
        """A new backup that holds what a file of its chain was read to (logrotate's
        ``copytruncate`` copied it, while the sidecar ran or was down) is read on from there: its
        lines before are those read, and the chain's stream is where they left it. Read again from
        its start, its lines before its first step would come at the step the stream has reached
        since (a relaunch's start-up events, which an uninterrupted run wrote at an earlier step
        or dropped as that step's). A file's place counts only once its lines read are processed
        (the place it lost, :attr:`FileTail.left`, always is: the read that found the loss came
        after them)."""
        for source in added:
            if not source.candidate.backup or source.tail.stream or source.tail.offset:
                continue
            places = [place for other in self.sources.values() if other.chain is source.chain and other is not source
                      for place in (other.tail.left, None if other.unprocessed() else other.tail.place()) if place]
            for place in sorted(places, key=lambda p: -p.offset):
                if source.tail.go_on(place):
                    log.info("%s is a copy of what was read of its chain up to byte %d; reading it on from there",
                             source.tail.path, place.offset)
                    break

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

    def ordered_sources(self) -> list[Source]:
        """Sources in reading order: per rank, chains in their order, each chain oldest file
        first. Sorted again only after discovery ran or a source left."""
        if self._order is None:
            self._order = sorted(
                self.sources.values(),
                key=lambda s: (s.candidate.rank, s.chain.order, s.chain.key, s.place),
            )
        return self._order

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

    def _lose(self, source: Source, exc: OSError) -> None:
        self.accounting.unreadable(source.tail.path, source.candidate.rank, exc)
        source.tail.close()
        self.sources.pop(source.tail.identity, None)
        self._order = None

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
