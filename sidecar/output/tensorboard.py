"""The TensorBoard output, as the primary sink: it owns every run writer of an engine, and what
those write is what every other sink is handed (:mod:`sidecar.output.sink`).

Why the other sinks are fed from here and not from the engine: the run writers are where a point
is judged new (a (tag, step) the run already shows is dropped, :mod:`sidecar.output.run_writer`),
so a sink handed exactly what they write gets each (run, tag, step) once, in log order, with
resumes where TensorBoard has them, for the rank runs and every other run alike (samples,
aggregate, layout, MindSpore summaries, alert and lifecycle texts, run metadata cards).

Contract, besides :class:`~sidecar.output.sink.Sink`'s:

- every value a writer writes goes to each other sink's ``write`` (``again=False``) right after
  it is in the event file's buffer; each resume to ``resume`` before the new segment's first point;
  each with its position in the run (``at``), which only grows for fresh ones;
- when a writer opens a run whose event files hold events past the checkpoint's view of it (or
  any, without a view: no checkpoint, or a run it does not describe), those are handed on at
  that moment as ``again=True``, resumes among them as ``resume(again=True)``, in the run's order
  with their positions: what a sink killed with the engine may not have made durable. A sink
  keeps what its own durable state lacks: those past the position of the last it took;
- :meth:`meta` hands a run's settings on; this sink has them already (``run.json`` and the
  config card, :mod:`sidecar.output.run_meta`, written through its writers);
- values are handed as read (Python floats), those handed again as the event files hold them
  (float32), as TensorBoard shows both;
- ``rank`` is the rank whose run it is at training steps (its own run), else ``None`` (its
  ``vs samples`` twins, the aggregate, the layout);
- without other sinks no writer has a tap: the hot path pays nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from tensorboard.compat.proto import event_pb2

from parsers.records import Record
from sidecar.output.event_scan import Position, RunView
from sidecar.output.run_writer import RunWriter, as_record
from sidecar.output.sink import Sink, SinkState


class _Fan:
    """One run's :class:`~sidecar.output.run_writer.Tap`: to every other sink."""

    def __init__(self, run: str, rank: int | None, sinks: list[Sink]) -> None:
        self.run, self.rank, self.sinks = run, rank, sinks

    def wrote(self, record: Record, at: Position, again: bool = False) -> None:
        for sink in self.sinks:
            sink.write(self.run, self.rank, record, again, at)

    def resumed(self, step: int, wall_time: float | None, at: Position, again: bool = False) -> None:
        for sink in self.sinks:
            sink.resume(self.run, self.rank, step, wall_time, again, at)

    def shown(self, event: event_pb2.Event, view: RunView, at: Position) -> None:
        """An event the run holds past the checkpoint (``view``: what the run showed before it)."""
        if event.HasField("session_log"):
            if event.session_log.status == event_pb2.SessionLog.START and \
                    event.step <= max(view.watermarks.values(), default=-1):  # a resume: it purges
                self.resumed(event.step, event.wall_time, at, again=True)
        elif event.HasField("summary"):
            record = as_record(event.step, event.wall_time, list(event.summary.value))
            if record.scalars or record.texts:
                self.wrote(record, at, again=True)


class TensorBoardSink:
    """Every run writer under ``--out``, by run path; ``others``: the sinks fed from them."""

    name = "tensorboard"

    def __init__(self, out: Path, max_file_bytes: int | None, others: list[Sink]) -> None:
        self.out = out
        self.max_file_bytes = max_file_bytes
        self.others = others
        self.writers: dict[str, RunWriter] = {}

    def writer(self, run: str, rank: int | None = None, since: RunView | None = None) -> RunWriter:
        """The writer of ``run`` (its path under ``--out``), opened at the first ask; ``since``:
        the checkpoint's view of it."""
        writer = self.writers.get(run)
        if writer is None:
            tap = _Fan(run, rank, self.others) if self.others else None
            writer = self.writers[run] = RunWriter(self.out / run, since, self.max_file_bytes, tap)
        return writer

    def restore(self, state: SinkState | None) -> None:
        """Nothing: what the runs hold is the checkpoint's ``runs`` and the event files themselves."""

    def write(self, run: str, rank: int | None, record: Record, again: bool = False,
              at: Position | None = None) -> None:
        if not again:  # a point read again is one the run shows
            self.writer(run, rank).write(record)

    def resume(self, run: str, rank: int | None, step: int, wall_time: float | None, again: bool = False,
               at: Position | None = None) -> None:
        if not again:
            self.writer(run, rank).resume(step, wall_time, f"training resumed at step {step}")

    def meta(self, run: str, rank: int | None, settings: Mapping[str, object]) -> None:
        for sink in self.others:
            sink.meta(run, rank, settings)

    def flush(self) -> None:
        """Make written events visible to TensorBoard (no fsync)."""
        for writer in self.writers.values():
            writer.flush()

    def sync(self) -> SinkState | None:
        """fsync every run; raises :class:`~sidecar.output.event_file.OutputLost` if one is gone."""
        for writer in self.writers.values():
            writer.sync()
        return None

    def health(self) -> Mapping[str, int]:
        return {"written": sum(writer.points_written for writer in self.writers.values())}

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()

    def abandon(self) -> None:
        """After a write error: close every run without writing what is still buffered."""
        for writer in self.writers.values():
            writer.abandon()
