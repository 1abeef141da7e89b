"""What a run directory already shows, as TensorBoard would read it: the newest step per tag.

Used at start-up so that a restarted sidecar never writes a (tag, step) the run already has,
even when it was killed after writing events but before checkpointing its offsets. The scan
applies TensorBoard's own discard rule: a ``SessionLog.START`` at step S (our resume marker)
purges every earlier point with step >= S, so the watermarks describe the current segment.

The scan can start from a remembered (file, size) position: everything before it is already
summarised by the remembered watermarks, so a restart reads only the last checkpoint interval.
The records identities it reads there (:func:`parsers.identity.identity`) let the sequencer
recognise the lines it re-reads from the checkpoint as copies; :func:`run_holds` answers the
same question for any older record, by reading the whole run (rarely: once per new chain).

Text tags are read back under today's names: earlier versions wrote ``events/compile`` as
``events/compile/text_summary`` (tensorboardX's ``text()``), and a restart on such a run must
not write the same text again under the plain name.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from tensorboard.compat.proto import event_pb2, summary_pb2

from parsers import tags
from parsers.identity import WINDOW, Identity, identity
from sidecar.output.event_file import event_files
from sidecar.output.tfrecord import CorruptRecord, iter_records

TEXT_PLUGIN = "text"
LEGACY_TEXT_SUFFIX = "/text_summary"  # earlier versions wrote text tags through tensorboardX's text()


class Position(NamedTuple):
    """Where a run holds an event: its event file and the offset just past it. Positions of one
    run sort in TensorBoard's reading order (a new event file's name sorts after every other,
    :func:`sidecar.output.event_file.next_file_name`), so an output that keeps the last one it took
    knows which events handed to it again it has."""

    file: str
    offset: int


@dataclass
class RunView:
    """Newest step per tag, and where the scan stopped (the resume point for the next scan).

    ``recent`` holds the identities of the points read after the scan's starting position
    (what a crash wrote after the last checkpoint), ``True`` while shown and ``False`` once a
    later START superseded them; at most :data:`parsers.identity.WINDOW` of them.
    """

    watermarks: dict[str, int] = field(default_factory=dict)
    file: str = ""
    size: int = 0
    recent: OrderedDict[Identity, bool] = field(default_factory=OrderedDict)

    def apply(self, event: event_pb2.Event) -> None:
        if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
            cut = event.step
            self.watermarks = {tag: min(step, cut - 1) for tag, step in self.watermarks.items() if cut > 0}
            for key in self.recent:
                if key[0] >= cut:
                    self.recent[key] = False
            return
        if event.HasField("summary"):
            self.recent[_identity(event)] = True
            if len(self.recent) > WINDOW:
                self.recent.popitem(last=False)
            for value in event.summary.value:
                tag = written_tag(value)
                if self.watermarks.get(tag, -1) < event.step:
                    self.watermarks[tag] = event.step


def written_tag(value: summary_pb2.Summary.Value) -> str:
    """The tag the sidecar writes for ``value`` today: a text written by an earlier version as
    ``events/compile/text_summary`` counts as ``events/compile``, so a restart on an old run
    does not write that text again under the new name."""
    if value.metadata.plugin_data.plugin_name == TEXT_PLUGIN:
        return value.tag.removesuffix(LEGACY_TEXT_SUFFIX)
    return value.tag


def _identity(event: event_pb2.Event) -> Identity:
    loss = next((v.simple_value for v in event.summary.value if v.tag == tags.LOSS), None)
    return identity(event.step, event.wall_time, loss)


def _events(run_dir: Path, start_name: str = "", start_offset: int = 0,
            holding: bytes = b"") -> Iterator[tuple[Path, int, event_pb2.Event | None]]:
    """(file, end offset, event) for every whole record from the start position on (only those
    whose bytes hold ``holding``: the others are not decoded); each file ends with a ``None``
    event at the offset where reading stopped."""
    for path in event_files(run_dir):
        if start_name and path.name < start_name:
            continue
        offset = start_offset if path.name == start_name else 0
        with open(path, "rb") as fh:
            try:
                for record in iter_records(fh, offset):
                    offset = record.end
                    if holding in record.payload:
                        yield path, offset, event_pb2.Event.FromString(record.payload)
            except CorruptRecord:
                pass  # TensorBoard stops reading a file here too
        yield path, offset, None


def scan_run(run_dir: Path, since: RunView | None = None,
             each: Callable[[event_pb2.Event, RunView, Position], None] | None = None) -> RunView:
    """Fold every event after ``since`` (or all of them) into a :class:`RunView`; ``each`` is
    shown every such event first, with the view before it (what the run showed until then) and
    its position."""
    files = event_files(run_dir)
    view = RunView(_current_names(since.watermarks), since.file, since.size) if since else RunView()
    names = [f.name for f in files]
    if since is not None and (since.file not in names or files[names.index(since.file)].stat().st_size < since.size):
        view = RunView()  # the remembered file shrank or vanished: trust only a full scan
    for path, offset, event in _events(run_dir, view.file, view.size):
        if event is None:
            view.file, view.size = path.name, offset
        else:
            if each is not None:
                each(event, view, Position(path.name, offset))
            view.apply(event)
    return view


def _current_names(watermarks: dict[str, int]) -> dict[str, int]:
    """Checkpointed watermarks under today's tag names (a checkpoint of an earlier version
    names texts with :data:`LEGACY_TEXT_SUFFIX`)."""
    out: dict[str, int] = {}
    for tag, step in watermarks.items():
        name = tag.removesuffix(LEGACY_TEXT_SUFFIX)
        out[name] = max(step, out.get(name, -1))
    return out


TextIdentity = tuple[str, float, bytes]  # tag (as written today), wall time (the line's timestamp), text


def run_texts(run_dir: Path) -> set[TextIdentity]:
    """The identity of every text any event file of the run holds (shown or superseded). Only
    events that name the text plugin are decoded: a run is mostly scalars."""
    return {(written_tag(value), event.wall_time, value.tensor.string_val[0])
            for _, _, event in _events(run_dir, holding=TEXT_PLUGIN.encode()) if event is not None
            for value in event.summary.value
            if value.metadata.plugin_data.plugin_name == TEXT_PLUGIN and value.tensor.string_val}


def run_holds(run_dir: Path, key: Identity) -> bool:
    """Does any event file of the run hold a point with this identity (shown or superseded)?"""
    return any(event is not None and event.step == key[0] and _identity(event) == key
               for _, _, event in _events(run_dir))
