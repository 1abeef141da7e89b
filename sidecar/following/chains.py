"""Chains: a log file with its rotated backups, one rank's stream through them, and their order.

A *chain* is what one logger wrote: ``info.log.5`` ... ``info.log.1``, ``info.log`` (or a
``worker_N.log``, or a file named on the command line). Within a chain the position is the
order, so one rank's stream (line assembly, the previous step) runs through all of its files:
a step head at the end of ``info.log.1`` is completed by the bar at the start of ``info.log``.

Several chains can report one rank, and how their names sort says nothing about their order
(``attempt_10`` sorts before ``attempt_9``). Chains found at start-up are therefore ordered by
what their data says: the first training step each one holds, read ahead (:func:`first_record`),
so an attempt that resumed at step 801 is read after the one that ran steps 1-1000, whatever
the directory names. Only when two chains start at the same step does the first record's
timestamp break the tie (two fresh starts: the later start continues), then discovery order.
Copies of one attempt (``info.log`` and ``worker_N.log``) start with the same record; the
sequencer recognises the second as a copy. A chain that appears while the sidecar runs is
newer than everything before it and is ordered last.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from parsers.assembler import StreamAssembler
from parsers.line import parse_message, text_of
from parsers.prefix import Cut, Message, PrefixSplitter
from parsers.rank_labels import RankRouter
from parsers.records import MalformedLine, ParsedLine, Record
from parsers.run_config import StartupCollector
from parsers.torn import tears

PEEK_BYTES = 4 << 20  # how far ahead a chain's first training step is looked for
PEEK_PIECE = 64 << 10
LATE = (math.inf, math.inf)


@dataclass
class ChainCursor:
    """Where one chain is for one rank: its previous training step in position order, and
    whether its latest step record belongs to the run's current segment (what the rank
    sequencer, :mod:`sidecar.analysis.sequencer`, judges by). ``stride``: how far its last step
    moved forward (``per_print_times`` logs every N-th step; not checkpointed)."""

    prev_step: int | None = None
    live: bool = True
    stride: int = 1


class Stream:
    """One rank's lines within one chain: prefix split, parse, assemble, and its cursor."""

    def __init__(self, companion_wait: float) -> None:
        self.assembler = StreamAssembler(companion_wait)
        self.prefix = PrefixSplitter()
        self.cursor = ChainCursor()
        self._plain: str | None = None  # the last timestamped line skipped as plain since the last feed
        self.startup = StartupCollector()  # run configuration lines (:mod:`parsers.run_config`)
        self._dump_start: tuple[int, object] = (0, None)  # where the dump being collected began
        self.message: Message | None = None  # the last line fed, for the custom metrics

    def feed(self, body: str, start: int, now: float, origin: object,
             cut: Cut | None = None) -> tuple[ParsedLine | None, list[Record]]:
        """``cut``: where the line's prefix is, if the fast path knows it."""
        message = self.message = self.prefix.split(body, cut)
        opened = not self.startup.collecting
        self.startup.feed(message)
        if opened and self.startup.collecting:
            self._dump_start = (start, origin)
        if self._plain is not None:
            if message.timestamp is None:  # the record takes the time of the line before it
                self.assembler.feed(None, self.prefix.split(self._plain).timestamp, start, now, origin)
            self._plain = None
        parsed = parse_message(message)
        meaning = None if isinstance(parsed, MalformedLine) else parsed  # a bad line must not release a held head
        return parsed, self.assembler.feed(meaning, message.timestamp, start, now, origin)

    @property
    def open_dump(self) -> tuple[int, object] | None:
        """(offset, origin) of the first line of a configuration dump still being collected: a
        checkpoint must not pass it, or a restart would never read the dump whole."""
        return self._dump_start if self.startup.collecting else None

    def skip(self, line: str) -> None:
        """A line :func:`parsers.fast_path.plain` found nothing in, with a timestamp: all the full
        path would take from it is that, and only the next line without one of its own needs it."""
        self._plain = line


@dataclass
class Chain:
    key: str
    order: tuple[float, float, int] | None = None  # set by the engine once the chain is found
    streams: dict[int, Stream] = field(default_factory=dict)

    def stream(self, rank: int, companion_wait: float) -> Stream:
        stream = self.streams.get(rank)
        if stream is None:
            stream = self.streams[rank] = Stream(companion_wait)
        return stream


def first_record(paths: list[Path], default_rank: int, rank_pattern: str | None,
                 startup: dict[int, list[dict[str, object]]] | None = None) -> tuple[int, float] | None:
    """(step, timestamp or +inf) of the first training-step record in ``paths`` (oldest file
    first), within the first :data:`PEEK_BYTES`; ``None`` if there is none (yet). ``startup``
    receives, per rank, the run configuration lines read before it (:mod:`parsers.run_config`)."""
    found = next(head_records(paths, default_rank, rank_pattern, startup), None)
    if found is None:
        return None
    record = found[1]
    return record.step, record.wall_time if record.wall_time is not None else math.inf


def head_records(paths: list[Path], default_rank: int, rank_pattern: str | None,
                 startup: dict[int, list[dict[str, object]]] | None = None) -> Iterator[tuple[int, Record]]:
    """(rank, record) for the training-step records in the first :data:`PEEK_BYTES` of
    ``paths`` (oldest file first), parsed as the engine parses them; a head whose bar is past
    the end of a file comes out when that file ends."""
    router = RankRouter(default_rank, rank_pattern)
    streams: dict[int, Stream] = {}
    budget = PEEK_BYTES
    for path in paths:
        for raw in _lines(path, budget):
            budget -= len(raw) + 1
            if at := tears(raw, router.plain_lines):  # read as the engine reads it (its _torn)
                raw = raw[at[-1]:]
            rank, body = router.route(text_of(raw))
            stream = streams.setdefault(rank, Stream(math.inf))
            records = stream.feed(body, 0, 0.0, None)[1]
            if startup is not None and stream.startup.updates:
                startup.setdefault(rank, []).append(stream.startup.take())
            for record in records:
                if record.training_step:
                    yield rank, record
        for rank, stream in streams.items():
            for record in stream.assembler.flush():
                if record.training_step:
                    yield rank, record
        if budget <= 0:
            return


def _lines(path: Path, budget: int) -> Iterator[bytes]:
    """Complete lines from the start of ``path``, read in small pieces, up to ``budget`` bytes."""
    try:
        with open(path, "rb") as fh:
            rest = b""
            while budget > 0:
                piece = fh.read(min(PEEK_PIECE, budget))
                if not piece:
                    return
                budget -= len(piece)
                *lines, rest = (rest + piece).split(b"\n")
                yield from lines
    except OSError:
        return  # the engine reports unreadable files when it opens them
