"""The one interface between the pipeline and what it feeds (Vector's source -> transform -> sink).

A sink is an output: TensorBoard run writers, the cross-rank aggregate, Prometheus gauges, alert
hooks, and the next ones (object storage, push exporters, experiment trackers) as modules of their
own. The hub hands every sink the same things, in log order, and never branches on which sink it is.

Contract (what the hub promises, what a sink must keep):

- :meth:`Sink.write` gets every record the rank sequencer did not supersede, for the run it
  belongs to (``run``: its path under ``--out``, e.g. ``rank_3`` or ``exp/aggregate``; ``rank``:
  ``None`` for runs that are not one rank's). ``again`` is true for a record read again after a
  restart that the primary output (the TensorBoard run) already shows; a sink whose own durable
  state lags that output (a tracker that was down, a bucket not yet uploaded to) sends it then,
  any other ignores it. A sink shows each (run, tag, step) at most once, judged against its own
  durable state, however often the hub is killed and restarted.
- :meth:`Sink.resume` says training went back to ``step``: later points of the run replace the
  old ones from that step on (a sink that cannot replace says how it shows them, in its docs).
  ``again`` as for ``write``.
- ``at`` (:class:`~sidecar.output.event_scan.Position`) is where the run's event files hold the
  record or the resume's ``SessionLog.START``; handed again, it is how a sink tells what it took
  before: a run handed again from its start repeats old segments, whose steps a mark of the
  newest segment's steps cannot judge. ``None`` from a caller that has no run (tests).
- :meth:`Sink.meta` gives a run's settings when they change (what ``run.json`` holds).
- :meth:`Sink.sync` is the durability barrier of a checkpoint: what was handed over must be
  durable (written, uploaded or spooled to local disk) before it returns, and what it returns is
  saved in the checkpoint with the offsets that passed it, and given back to :meth:`Sink.restore`
  at the next start, before anything is written.
- A sink never blocks the pipeline on the network: slow or failing destinations queue (bounded,
  spilled to disk where the sink promises exactly-once), retry with backoff, and count drops
  under a named reason that the status and metrics show (:meth:`Sink.health`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from parsers.records import Record
from sidecar.output.event_scan import Position

SinkState = dict[str, object]  # JSON-able: a sink's part of the checkpoint


class Sink(Protocol):
    name: str  # short, stable: the key of its checkpoint part and its metrics label

    def restore(self, state: SinkState | None) -> None: ...

    def write(self, run: str, rank: int | None, record: Record, again: bool = False,
              at: Position | None = None) -> None: ...

    def resume(self, run: str, rank: int | None, step: int, wall_time: float | None, again: bool = False,
               at: Position | None = None) -> None: ...

    def meta(self, run: str, rank: int | None, settings: Mapping[str, object]) -> None: ...

    def flush(self) -> None: ...

    def sync(self) -> SinkState | None: ...

    def health(self) -> Mapping[str, int]: ...  # counts by reason (queued, sent, dropped-..., retries)

    def close(self) -> None: ...


class PassiveSink:
    """A base for sinks that act on few of the calls: each call does nothing, keeps no state and
    counts nothing, so a subclass overrides only what it acts on (and says why the rest is empty
    in its docstring)."""

    name = "passive"

    def restore(self, state: SinkState | None) -> None:
        return None

    def write(self, run: str, rank: int | None, record: Record, again: bool = False,
              at: Position | None = None) -> None:
        return None

    def resume(self, run: str, rank: int | None, step: int, wall_time: float | None, again: bool = False,
               at: Position | None = None) -> None:
        return None

    def meta(self, run: str, rank: int | None, settings: Mapping[str, object]) -> None:
        return None

    def flush(self) -> None:
        return None

    def sync(self) -> SinkState | None:
        return None

    def health(self) -> Mapping[str, int]:
        return {}

    def close(self) -> None:
        return None
