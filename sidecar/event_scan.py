"""What a run directory already shows, as TensorBoard would read it: the newest step per tag.

Used at start-up so that a restarted sidecar never writes a (tag, step) the run already has,
even when it was killed after writing events but before checkpointing its offsets. The scan
applies TensorBoard's own discard rule: a ``SessionLog.START`` at step S (our resume marker)
purges every earlier point with step >= S, so the watermarks describe the current segment.

The scan can start from a remembered (file, size) position: everything before it is already
summarised by the remembered watermarks, so a restart reads only the last checkpoint interval.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tensorboardX.proto import event_pb2

from sidecar.event_file import event_files
from sidecar.tfrecord import CorruptRecord, iter_records


@dataclass
class RunView:
    """Newest step per tag, and where the scan stopped (the resume point for the next scan).

    ``newest`` (step, wall time of the last point read) and ``segment_wall`` (wall time of the
    last START that purged points, i.e. a training resume) describe only what the scan read
    after its starting position: what a crash wrote after the last checkpoint. The sequencer
    catches up with them, so lines re-read from the checkpoint are judged against what the run
    already holds, not against the older checkpoint (a dead segment's lines then stay dead).
    """

    watermarks: dict[str, int] = field(default_factory=dict)
    file: str = ""
    size: int = 0
    newest: tuple[int, float] | None = None
    segment_wall: float | None = None

    def apply(self, event: event_pb2.Event) -> None:
        if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
            cut = event.step
            if any(step >= cut for step in self.watermarks.values()):
                self.segment_wall = event.wall_time
            self.watermarks = {tag: min(step, cut - 1) for tag, step in self.watermarks.items() if cut > 0}
            return
        if event.HasField("summary"):
            self.newest = (event.step, event.wall_time)
            for value in event.summary.value:
                if self.watermarks.get(value.tag, -1) < event.step:
                    self.watermarks[value.tag] = event.step


def scan_run(run_dir: Path, since: RunView | None = None) -> RunView:
    """Fold every event after ``since`` (or all of them) into a :class:`RunView`."""
    files = event_files(run_dir)
    view = RunView(dict(since.watermarks), since.file, since.size) if since else RunView()
    names = [f.name for f in files]
    if since is not None and (since.file not in names or files[names.index(since.file)].stat().st_size < since.size):
        view = RunView()  # the remembered file shrank or vanished: trust only a full scan
    start_name, start_offset = view.file, view.size
    for path in files:
        if start_name and path.name < start_name:
            continue
        offset = start_offset if path.name == start_name else 0
        with open(path, "rb") as fh:
            try:
                for record in iter_records(fh, offset):
                    event = event_pb2.Event.FromString(record.payload)
                    view.apply(event)
                    offset = record.end
            except CorruptRecord:
                pass  # TensorBoard stops reading a file here too
        view.file, view.size = path.name, offset
    return view
