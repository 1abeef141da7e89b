"""The messages between a replay's parent and its worker processes, one type each.

The conversation (:mod:`sidecar.service.replay_workers` has the why):

- worker -> parent: :class:`Batch` after every read (what needs every rank, and the bytes read);
  :class:`Part` for each :data:`Word.PART` asked; :class:`Done` once it read everything; then
  :class:`Final`. :class:`Failed` at any time ends the conversation (the parent replays in one
  process), as does the pipe closing without one (a worker killed).
- parent -> worker: :data:`Word.PART` (your part of a checkpoint, between two reads),
  :data:`Word.STOP` (Ctrl-C: hand over what you wrote, now), or after :class:`Done` the
  :class:`Front` that ranks behind are judged against.

A batch's items are typed by their class: a :class:`StepSeen` for the aggregate and the divergence
check, an :class:`~sidecar.analysis.alerts.Alert` for ``--on-alert``, a pipeline or world-size
line for the aggregate's loss ranks. Messages go through :class:`multiprocessing.connection.
Connection` (pickled). There is one :class:`StepSeen` per rank and training step, so a batch
carries them as plain tuples (:meth:`Batch.__reduce__`): a named tuple pickled one by one costs
about five times as much, which a large replay would feel; the other messages are rare.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

from parsers.records import ParallelConfigLine, PipelineLine
from sidecar.analysis.accounting import Accounting
from sidecar.analysis.alerts import Alert
from sidecar.analysis.detectors import Group
from sidecar.output.state import State

if TYPE_CHECKING:
    from sidecar.engine import RankStats


class StepSeen(NamedTuple):
    """A training step of one of the worker's ranks, as the engine handed it to the aggregate.
    ``scalars``: only the aggregated tags; ``written``: its loss went to the divergence check (as a
    one-process replay's alerts would hand it), ``again`` as a step judged again after a kill
    (:meth:`Alerts.note_loss <sidecar.analysis.alerts.Alerts.note_loss>`)."""

    rank: int
    step: int
    wall: float | None
    scalars: dict[str, float]
    resumed: bool
    written: bool
    again: bool


Item = StepSeen | Alert | PipelineLine | ParallelConfigLine


@dataclass(frozen=True)
class Batch:
    items: list[Item]
    expected: set[int] | None  # every rank the worker knows, when that changed since the last batch
    read: int  # bytes read since the last batch
    pumped: bool  # every file was read once: the worker's ranks are all known

    def __reduce__(self) -> tuple[object, ...]:
        """Pickled with each :class:`StepSeen` as a plain tuple (no other item is one)."""
        plain = [tuple(item) if type(item) is StepSeen else item for item in self.items]
        return _unpack, (plain, self.expected, self.read, self.pumped)


def _unpack(items: list[object], expected: set[int] | None, read: int, pumped: bool) -> Batch:
    make = StepSeen._make
    return Batch([make(item) if type(item) is tuple else item for item in items], expected, read, pumped)


@dataclass(frozen=True)
class Done:
    """Everything read and its held records released: its ranks' last steps."""

    last_steps: dict[int, int]


@dataclass(frozen=True)
class Part:
    """Its part of a checkpoint (:meth:`Engine.state <sidecar.engine.Engine.state>`)."""

    state: State


@dataclass(frozen=True)
class Final:
    """The worker's last word: its part of the checkpoint, its ranks' figures, its counts."""

    part: State
    stats: dict[int, RankStats]
    accounting: Accounting
    counts: Counter[tuple[int, str]]  # alerts raised (sidecar.analysis.alerts.Alerts.counts)
    groups: Counter[Group]
    read: int
    lines: int


@dataclass(frozen=True)
class Failed:
    """The worker failed: ``error`` is raised in the parent (:class:`WorkersFailed`, or
    :class:`~sidecar.output.event_file.OutputLost`: the output is gone, not the worker)."""

    error: BaseException


class WorkersFailed(Exception):
    """A worker met a rank outside its share, failed or was killed: replay in one process instead,
    from the start, or from the checkpoint saved while the workers read if ``checkpointed``."""

    checkpointed = False


class Word(Enum):
    """What the parent asks of a worker between two of its reads."""

    PART = "part"
    STOP = "stop"


@dataclass(frozen=True)
class Front:
    """After :class:`Done`: the furthest step of every rank (``None``: fewer than two ranks)."""

    step: int | None


ToParent = Batch | Done | Part | Final | Failed
ToWorker = Word | Front
