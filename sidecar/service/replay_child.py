"""A replay worker: the engine restricted to a share of the ranks, in a forked process.

It reads, parses, sequences and writes its ranks' runs and raises their alerts, as a one-process
replay does for those ranks; what needs every rank goes to the parent through its pipe
(:class:`Relay`, messages of :mod:`sidecar.service.replay_protocol`). The parent's side, and why it
is split this way, is :mod:`sidecar.service.replay_workers`.

Guards: a worker never outlives the parent (:func:`_die_with`), ignores Ctrl-C (the parent decides
and tells it), and any failure, a line of a rank outside its share included
(:class:`~sidecar.engine.ForeignRank`), is told to the parent as :class:`Failed` before it exits
with status 1; it never returns into the parent's code.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from multiprocessing.connection import Connection

from parsers.records import ParallelConfigLine, PipelineLine, Record
from sidecar.analysis.aggregate import AGGREGATED_TAGS
from sidecar.analysis.alerts import Alert
from sidecar.engine import Engine, ForeignRank
from sidecar.output.event_file import OutputLost
from sidecar.service.replay_protocol import (
    Batch,
    Done,
    Failed,
    Final,
    Front,
    Item,
    Part,
    StepSeen,
    Word,
    WorkersFailed,
)

BATCH = 256  # relayed items per message: small enough to keep ranks in step, large enough to be cheap
_PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent ends


class Relay:
    """A worker's stand-in for the aggregate (:class:`~sidecar.engine.CrossRank`): it forwards
    what needs every rank to the parent and keeps the worker's own ranks in step."""

    def __init__(self, conn: Connection, ranks: set[int]) -> None:
        self.conn = conn
        self.expected: set[int] = set(ranks)
        self._last: dict[int, int] = {}  # rank -> latest training step observed
        self._items: list[Item] = []
        # the step observed last, until the next item: its loss may still be written (:meth:`loss`)
        self._seen: tuple[int, int, float | None, dict[str, float], bool] | None = None
        self._written = self._again = False
        self._said_expected = 0
        self.pumped = False

    # CrossRank: what the engine hands the aggregate
    def observe(self, rank: int, record: Record, now: float, resumed: bool = False) -> None:
        self._take_seen()
        if len(self._items) >= BATCH:
            self.send(0)
        self._last[rank] = record.step
        scalars = record.scalars  # copied, since the engine adds derived tags to the record later (in C if it can)
        scalars = dict(scalars) if scalars.keys() <= AGGREGATED_TAGS else {
            tag: v for tag, v in scalars.items() if tag in AGGREGATED_TAGS}
        self._seen = (rank, record.step, record.wall_time, scalars, resumed)
        self._written = self._again = False

    def note_pipeline(self, line: PipelineLine) -> None:
        self._add(line)

    def note_parallel(self, line: ParallelConfigLine) -> None:
        self._add(line)

    def pending_steps(self) -> int:
        """How far apart this worker's ranks are (the aggregate's count of waiting steps, here)."""
        steps = self._steps()
        return max(steps) - min(steps) if steps else 0

    def waits_for(self, rank: int) -> bool:
        steps = self._steps()
        return bool(steps) and self._last.get(rank, -1) == min(steps)

    def _steps(self) -> Iterable[int]:
        """Each rank's latest step, -1 before its first (ranks are added to ``expected`` as found)."""
        if len(self._last) < len(self.expected):
            for rank in self.expected:
                self._last.setdefault(rank, -1)
        return self._last.values()

    def compared_ranks(self) -> set[int]:
        return self.expected  # every loss goes to the parent, which knows whose loss counts

    # what the worker's alerts hand on (:meth:`Alerts.relay <sidecar.analysis.alerts.Alerts.relay>`)
    def loss(self, rank: int, step: int, loss: float, wall: float | None, ranks: set[int] | None,
             again: bool = False) -> None:
        """The step observed last was written with this loss (or, ``again``, judged again after a
        kill): its :class:`StepSeen` says so (the parent takes the loss from its scalars)."""
        self._written, self._again = True, again

    def alert(self, alert: Alert) -> None:
        self._add(alert)

    def _add(self, item: Item) -> None:
        self._take_seen()
        self._items.append(item)  # rare: sent with the next batch

    def _take_seen(self) -> None:
        if self._seen is not None:
            self._items.append(StepSeen(*self._seen, self._written, self._again))
            self._seen = None

    def send(self, read: int) -> None:
        """Hand over what was gathered, with ``read`` more bytes done."""
        self._take_seen()
        expected = None
        if len(self.expected) != self._said_expected:
            expected, self._said_expected = set(self.expected), len(self.expected)
        self.conn.send(Batch(self._items, expected, read, self.pumped))
        self._items = []


def child(engine: Engine, ranks: set[int], conn: Connection, budget: int, parent: int) -> None:
    """A worker: its share of the replay, then its part of the result. Never returns."""
    status = 0
    try:
        _die_with(parent)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; Ctrl-C reaches it too
        relay = Relay(conn, ranks)
        engine.restrict(ranks, relay)
        # --on-alert runs in the parent, the divergence check too
        engine.alerts.relay(relay.loss, relay.alert, engine.settings.alert_sinks)
        stopped = False
        while not stopped:
            before = engine.bytes_read
            n = engine.pump(budget, time.monotonic())
            relay.pumped = True
            relay.send(engine.bytes_read - before)
            stopped = _listen(engine, conn)
            if n == 0:
                break
        if not stopped:
            engine.drain()
            relay.send(0)
            conn.send(Done({r: s.last_step for r, s in engine.stats.items() if s.last_step is not None}))
            while (word := conn.recv()) is Word.PART:  # asked before the parent heard Done
                _hand_part(engine, conn)
            if isinstance(word, Front):
                engine.finish(word.step)
        part = engine.state()
        engine.close()
        a = engine.alerts
        conn.send(Final(part, engine.stats, engine.accounting, a.counts, a.groups,
                        engine.bytes_read, engine.lines_read))
    except BaseException as exc:  # noqa: BLE001 - whatever it is, the parent must hear it
        status = 1
        try:
            conn.send(Failed(exc if isinstance(exc, OutputLost) else WorkersFailed(_say(exc))))
        except Exception:  # noqa: BLE001 - the parent is gone: nothing to tell
            pass
    finally:
        os._exit(status)


def _die_with(parent: int) -> None:
    """A worker does not outlive the replay: one whose parent was killed would go on writing runs
    and hold the lock on ``--out`` it inherited, and the next replay could not start."""
    import ctypes  # only here: a replay in one process does not need it

    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # gone before that
        os._exit(1)


def _listen(engine: Engine, conn: Connection) -> bool:
    """Between two reads: hands over its part for each :data:`Word.PART`; whether the parent said STOP."""
    while conn.poll():
        if conn.recv() is Word.STOP:
            return True
        _hand_part(engine, conn)
    return False


def _hand_part(engine: Engine, conn: Connection) -> None:
    conn.send(Part(engine.state()))


def _say(exc: BaseException) -> str:
    if isinstance(exc, ForeignRank):
        return f"a line of rank {exc.args[0]} is in a file of another rank"
    return f"a replay worker failed: {exc!r}"
