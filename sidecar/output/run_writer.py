"""One TensorBoard run (``--out/rank_<N>``): records in, de-duplicated events out.

Contract: within the current segment, a (tag, step) is written at most once and steps per tag
strictly increase, so both TensorBoard loaders show every point exactly once. Each writer start
opens a new event file (see :mod:`sidecar.output.event_file`) that begins with one ``SessionLog.START``:
at ``max written step + 1`` on a plain (re)start, which purges nothing, or at the resume step when
training went back to an earlier checkpoint, which makes TensorBoard's Python loader discard the
stale tail exactly as its Rust loader does by per-tag preemption.

Watermarks come from the run directory itself (:func:`sidecar.output.event_scan.scan_run`), so events
written before a crash but after the last offset checkpoint are not written a second time.

What it writes goes on to the other outputs through its :class:`Tap` (none: nothing is handed
on, and the hot path pays one attribute check): every value as written (after de-duplication),
each resume, and, when the writer opens the run, the events the run already holds past the
checkpoint's view (:meth:`Tap.shown`; see :mod:`sidecar.output.tensorboard`); each with its
:class:`~sidecar.output.event_scan.Position` in the run.

Deleted output: :meth:`RunWriter.sync`, the barrier before every checkpoint, checks that what
this writer wrote is still in the run directory and raises :class:`OutputLost` if not, so a
checkpoint never claims events that are gone; the loss is remembered until the writer is
dropped (a resume or ``close`` in between must not hide it). Only the file being written (or,
with none open, the last one) is checked: deleting an older, closed event file of a run is
not noticed.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

from parsers.identity import Identity
from parsers.records import Record
from sidecar.output import scalar_event
from sidecar.output.event_file import EventFileWriter, OutputLost, vanished
from sidecar.output.event_scan import (TEXT_PLUGIN, Position, RunView, TextIdentity, run_holds, run_texts, scan_run,
                                       written_tag)

RESUME_TAG = "events/resume"


class Tap(Protocol):
    """Where a run's points go besides its event files."""

    def wrote(self, record: Record, at: Position) -> None: ...  # what was written of a record (only that)

    def resumed(self, step: int, wall_time: float | None, at: Position) -> None: ...  # before the segment's first point

    def shown(self, event: event_pb2.Event, view: RunView, at: Position) -> None: ...  # found past the checkpoint


class RunWriter:
    def __init__(self, run_dir: Path, since: RunView | None = None, max_file_bytes: int | None = None,
                 tap: Tap | None = None) -> None:
        self.run_dir = run_dir
        self.max_file_bytes = max_file_bytes  # --max-event-file-mb: a new file once one holds this much
        self.tap = tap
        self.view = scan_run(run_dir, since, tap.shown if tap is not None else None) if run_dir.exists() else RunView()
        self._top = self.max_step  # the highest step of any tag (watermarks only grow between resumes)
        self._file: EventFileWriter | None = None
        self._start_step: int | None = None
        self.points_written = 0
        self.lost: str | None = None  # what vanished, once noticed
        self._texts: set[TextIdentity] | None = None  # every text the run holds, once asked (shows)
        self._derived: list[RunWriter] = []  # runs of points made from this one's records (derive)

    @property
    def max_step(self) -> int:
        return max(self.view.watermarks.values(), default=-1)

    def write(self, record: Record) -> int:
        """Write what is new in ``record``; return how many values were written. Scalars alone
        are encoded directly (:mod:`sidecar.output.scalar_event`), anything else by protobuf."""
        wall_time = record.wall_time if record.wall_time is not None else time.time()
        if record.texts:
            values = self._put(record.step, wall_time, _values(record))
            if values and self.tap is not None:
                self.tap.wrote(as_record(record.step, wall_time, values, record.training_step), self._at())
            return len(values)
        step, marks = record.step, self.view.watermarks
        if step > self._top:  # past every tag: all of it is new
            fresh = record.scalars
        else:
            fresh = {tag: value for tag, value in record.scalars.items() if marks.get(tag, -1) < step}
        if fresh:
            self._ensure_file(wall_time).write_encoded(scalar_event.encode(step, wall_time, fresh))
            self._mark(fresh, step)
            if self.tap is not None:
                self.tap.wrote(record if fresh is record.scalars and record.wall_time is not None
                               else replace(record, wall_time=wall_time, scalars=fresh), self._at())
        return len(fresh)

    def write_values(self, step: int, wall_time: float, values: list[summary_pb2.Summary.Value]) -> int:
        """Write the values whose tag has not reached ``step`` yet, as one event."""
        fresh = self._put(step, wall_time, values)
        if fresh and self.tap is not None:
            self.tap.wrote(as_record(step, wall_time, fresh), self._at())
        return len(fresh)

    def _at(self) -> Position:
        """Where the event just written is (the open file, past its buffered records)."""
        assert self._file is not None
        return Position(self._file.path.name, self._file.pending_size)

    def _put(self, step: int, wall_time: float, values: list[summary_pb2.Summary.Value]) -> list[summary_pb2.Summary.Value]:
        """Write the values whose tag has not reached ``step`` yet, as one event; return them."""
        fresh = [v for v in values if self._new(v.tag, step)]
        if fresh:
            event = event_pb2.Event(wall_time=wall_time, step=step, summary=summary_pb2.Summary(value=fresh))
            self._ensure_file(wall_time).write(event)
            self._mark([v.tag for v in fresh], step)
            if self._texts is not None:
                self._texts.update((v.tag, wall_time, v.tensor.string_val[0]) for v in fresh
                                   if v.metadata.plugin_data.plugin_name == TEXT_PLUGIN and v.tensor.string_val)
        return fresh

    def _new(self, tag: str, step: int) -> bool:
        return self.view.watermarks.get(tag, -1) < step

    def _mark(self, tags: dict[str, float] | list[str], step: int) -> None:
        marks = self.view.watermarks
        for tag in tags:
            marks[tag] = step
        self.points_written += len(tags)
        self._top = max(self._top, step)

    def holds(self, key: Identity) -> bool:
        """Does the run hold a point with this identity? (Reads the whole run: rarely asked.)"""
        self.flush()
        return run_holds(self.run_dir, key)

    def derive(self, other: RunWriter) -> None:
        """``other`` holds points made from this run's records (a rank's ``vs samples`` twins):
        its events reach the kernel before this run's do, at every flush, so a SIGKILL never leaves
        this run showing a record or a resume whose derived points were lost. A restart judges the
        records it reads again by this run alone (those it shows are not derived again)."""
        if other not in self._derived:  # asked at every twin written: a list of one, by identity
            self._derived.append(other)

    def _flush_derived(self) -> None:
        for other in self._derived:
            other.flush()

    def shows(self, record: Record) -> bool:
        """Does the run hold one of ``record``'s texts with its timestamp (shown or superseded)?
        Then the record is a copy read again: a ``copytruncate`` copy of lines read before, read
        from its start (one that holds what was read is read on from there, see
        :mod:`sidecar.engine.sources`), whose step (the last training step the stream read) says
        nothing, since it is the copy's position that is old. Asked of timestamped records only; the first question reads the
        whole run, later ones are answered from memory."""
        if record.wall_time is None or not record.texts:
            return False
        if self._texts is None:
            self.flush()
            self._texts = run_texts(self.run_dir)
        return any((tag, record.wall_time, text.encode("utf-8")) in self._texts for tag, text in record.texts.items())

    def resume(self, step: int, wall_time: float | None, note: str) -> None:
        """Training went back to ``step``: start a new segment that supersedes steps >= step."""
        self.close()
        self._start_step = step
        self.view.watermarks = {tag: min(s, step - 1) for tag, s in self.view.watermarks.items()}
        self._top = self.max_step
        self._ensure_file(wall_time if wall_time is not None else time.time())  # its START: where the resume is
        if self.tap is not None:
            self.tap.resumed(step, wall_time, self._at())
        self.write(Record(step, wall_time, texts={RESUME_TAG: note}))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def sync(self) -> RunView:
        """Durability barrier; returns the view to checkpoint alongside the log offsets.

        Raises :class:`OutputLost` when what this writer wrote is no longer on disk.
        """
        self._settle()
        if self.lost is not None:
            raise OutputLost(self.run_dir, self.lost)
        return self.view

    def close(self) -> None:
        """Sync and close; a loss noticed here is raised by the next :meth:`sync`."""
        if self._file is not None:
            self._settle()
            self._file.close()
            self._file = None

    def _settle(self) -> None:
        """fsync the open file, then check that what was written is still in the run."""
        if self._file is not None:
            self._file.sync()
            self.view.file, self.view.size = self._file.path.name, self._file.size
        if self.lost is None:
            self.lost = self._file.lost() if self._file else vanished(self.run_dir, self.view.file, self.view.size)

    def abandon(self) -> None:
        if self._file is not None:
            self._file.abandon()
            self._file = None

    def _ensure_file(self, wall_time: float) -> EventFileWriter:
        if self._file is not None and self.max_file_bytes is not None and self._file.pending_size >= self.max_file_bytes:
            self.close()  # rolled: the next file's START (max step + 1) purges nothing
        if self._file is None:
            self._file = EventFileWriter(self.run_dir, wall_time, self._flush_derived)
            start = self._start_step if self._start_step is not None else self.max_step + 1
            self._start_step = None
            self._file.write(
                event_pb2.Event(
                    wall_time=wall_time,
                    step=start,
                    session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START),
                )
            )
        return self._file


_TEXT_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(
        plugin_name=TEXT_PLUGIN, content=TextPluginData(version=0).SerializeToString()
    )
)


def text_value(tag: str, text: str) -> summary_pb2.Summary.Value:
    """A text value that TensorBoard's text plugin lists under ``tag`` itself.

    tensorboardX's ``text()`` would append ``/text_summary`` to the tag; the README documents
    the plain names (``events/compile``). Runs written that way are read back under the plain
    name (:data:`sidecar.output.event_scan.LEGACY_TEXT_SUFFIX`), so no text is written twice.
    """
    tensor = TensorProto(dtype="DT_STRING", string_val=[text.encode("utf-8")],
                         tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
    return summary_pb2.Summary.Value(tag=tag, metadata=_TEXT_METADATA, tensor=tensor)


CUSTOM_SCALARS_TAG = "custom_scalars__config__"  # the tag TensorBoard's custom_scalars plugin reads
_CUSTOM_SCALARS_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="custom_scalars")
)


def custom_scalars_value(layout: layout_pb2.Layout) -> summary_pb2.Summary.Value:
    """A layout for the Custom Scalars tab, as TensorBoard's plugin reads it (and tensorboardX's
    ``custom_scalars()`` writes it: a string tensor of the serialized layout)."""
    tensor = TensorProto(dtype="DT_STRING", string_val=[layout.SerializeToString()], tensor_shape=TensorShapeProto())
    return summary_pb2.Summary.Value(tag=CUSTOM_SCALARS_TAG, metadata=_CUSTOM_SCALARS_METADATA, tensor=tensor)


def _values(record: Record) -> list[summary_pb2.Summary.Value]:
    values = [summary_pb2.Summary.Value(tag=tag, simple_value=value) for tag, value in record.scalars.items()]
    values.extend(text_value(tag, text) for tag, text in record.texts.items())
    return values


def as_record(step: int, wall_time: float, values: list[summary_pb2.Summary.Value], training_step: bool = False) -> Record:
    """Values of one event as a record, as TensorBoard shows them: scalars, and every string tensor
    as a text (a text, a Custom Scalars layout; decoded as TensorBoard's text plugin does). A value
    of neither kind (the HParams plugin's, which :meth:`Sink.meta <sidecar.output.sink.Sink.meta>`
    gives) is left out."""
    record = Record(step, wall_time, training_step=training_step)
    for value in values:
        if value.HasField("simple_value"):
            record.scalars[value.tag] = value.simple_value
        elif value.tensor.string_val:
            record.texts[written_tag(value)] = value.tensor.string_val[0].decode("utf-8", "replace")
    return record
