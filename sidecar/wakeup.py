"""File-change wake-ups for the live loop: inotify through watchdog where it works, else nothing.

Polling is the baseline (it is what finds NFS writes from other hosts); file events only cut the
wait between polls. Network and cluster filesystems never deliver remote writes as inotify
events, so on them, and when inotify cannot be set up (watch limits), the loop just polls.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer

log = logging.getLogger(__name__)

NETWORK_FS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "glusterfs", "ceph", "9p", "fuse.sshfs",
     "fuse.juicefs", "fuse.s3fs", "fuse.ossfs", "fuse.obsfs", "fuse.gcsfuse", "afs", "panfs", "wekafs"}
)


def filesystem_type(path: Path, mounts: str = "/proc/mounts") -> str | None:
    """Type of the filesystem holding ``path`` (longest matching mount point)."""
    try:
        table = Path(mounts).read_text()
    except OSError:
        return None
    target = str(path.resolve())
    best, kind = "", None
    for line in table.splitlines():
        fields = line.split()
        if len(fields) >= 3:
            point = fields[1].replace("\\040", " ")
            if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


# Only writes and changes of the tree wake us: our own opens and reads of the logs must not.
_CONTENT = (FileModifiedEvent, FileClosedEvent)
_STRUCTURE = (FileCreatedEvent, FileMovedEvent, FileDeletedEvent, DirCreatedEvent, DirMovedEvent, DirDeletedEvent)


class _Wake(FileSystemEventHandler):
    def __init__(self, owner: "WakeUp", ignore: str) -> None:
        self._owner = owner
        self._ignore = ignore

    def on_any_event(self, event: FileSystemEvent) -> None:
        if str(event.src_path).startswith(self._ignore):  # our own output must not wake us
            return
        if isinstance(event, _STRUCTURE):
            self._owner.structure_changed = True
        self._owner.event.set()


class WakeUp:
    """``wait(timeout)`` returns early when a watched file changes (if inotify is in use).

    ``structure_changed`` says a file or directory was created, moved or deleted since the
    last :meth:`take_structure_change`, i.e. a rescan is due now rather than at the next reconcile.
    """

    def __init__(self, roots: list[Path], out: Path, poll_only: bool) -> None:
        self.event = threading.Event()
        self.structure_changed = False
        self._observer: Observer | None = None
        self.mode = "poll"
        if poll_only:
            return
        network = sorted({t for r in roots if (t := filesystem_type(r)) in NETWORK_FS})
        if network:
            log.info("polling only: %s does not deliver file events from other hosts", ", ".join(network))
            return
        observer = Observer()
        try:
            for root in roots:
                watched = root.resolve() if root.is_dir() else root.resolve().parent
                observer.schedule(_Wake(self, str(out.resolve()) + "/"), str(watched), recursive=True,
                                  event_filter=[*_CONTENT, *_STRUCTURE])
            observer.start()
        except OSError as exc:
            log.warning("file events unavailable (%s); polling only", exc)
            return
        self._observer = observer
        self.mode = "inotify+poll"

    @property
    def events(self) -> bool:
        return self._observer is not None

    def take_structure_change(self) -> bool:
        changed, self.structure_changed = self.structure_changed, False
        return changed

    def wait(self, timeout: float) -> None:
        self.event.wait(timeout)
        self.event.clear()

    def stop(self) -> None:
        if self._observer is not None:
            # Stopping races an emitter thread's last read, which watchdog logs as an ERROR
            # ("queue_events() called when the thread is inactive"); nothing is lost at exit, and
            # a spurious error line must not stand next to (or in for) the real reason we stop.
            logging.getLogger("watchdog.observers.inotify").setLevel(logging.CRITICAL)
            self._observer.stop()
            self._observer.join(timeout=5)
