"""File-change wake-ups for the live loop: inotify through watchdog where it works, else nothing.

Polling is the baseline (it is what finds NFS writes from other hosts); file events only cut the
wait between polls. Network and cluster filesystems never deliver remote writes as inotify
events, so on them, and when inotify cannot be set up (watch limits), the loop just polls.

A watch dies with its directory: ``rm -rf output/log`` (a new job in the same place) deletes the
watched root, and the re-created directory would send no events until the next full rescan.
So the watches are re-armed from the main loop (:meth:`WakeUp.take_structure_change`, one
``stat`` per root): while a root is gone its nearest existing ancestor is watched, for entries
on the way to the root only, so the re-creation is itself an event; once it exists again (a
new directory) it is watched anew and a structure change makes the loop rescan at once. A root
renamed away sends no event (inotify's ``IN_MOVE_SELF`` is not reported) and is noticed at the
next wake-up, at worst the loop's reconcile interval.

A ``--watch`` path that does not exist yet (the sidecar starts before the job) is a gone root
from the start: it is awaited the same way, and taken for a directory until it appears (a file
named on the command line is then watched through the directory that holds it).
"""

from __future__ import annotations

import logging
import os
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
from watchdog.observers.api import ObservedWatch

from sidecar.following.discovery import linked_dirs

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
# What an ancestor's watch reports: the directories on the way, or a root that is a file.
_ON_THE_WAY = (DirCreatedEvent, DirMovedEvent, DirDeletedEvent, FileCreatedEvent, FileMovedEvent)
REARM_PASSES = 3  # a root re-created while its ancestor's watch was being set sends no event


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


class _Await(FileSystemEventHandler):
    """For the watch on a gone root's ancestor: wakes the loop only for entries on the way to a
    root (a busy ancestor such as a home directory must not wake it for anything else)."""

    def __init__(self, owner: "WakeUp") -> None:
        self._owner = owner

    def on_any_event(self, event: FileSystemEvent) -> None:
        paths = [Path(str(p)) for p in (event.src_path, event.dest_path) if p]
        if any(p == root or p in root.parents for p in paths for root in self._owner.roots):
            self._owner.structure_changed = True
            self._owner.event.set()


def _nearest_dir(path: Path) -> Path:
    while not path.is_dir():
        path = path.parent
    return path


def _root(path: Path) -> Path:
    """The directory watched for a ``--watch`` path: itself, or the directory of a file."""
    return path.resolve().parent if path.is_file() else path.resolve()


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class WakeUp:
    """``wait(timeout)`` returns early when a watched file changes (if inotify is in use).

    ``structure_changed`` says a file or directory was created, moved or deleted since the
    last :meth:`take_structure_change`, i.e. a rescan is due now rather than at the next reconcile.
    """

    def __init__(self, roots: list[Path], out: Path, poll_only: bool) -> None:
        self.event = threading.Event()
        self.structure_changed = False
        self._paths, self._out = roots, out
        self._missing = [r for r in roots if not r.exists()]
        self.roots = self._roots()
        self._observer: Observer | None = None
        self._wake = _Wake(self, str(out.resolve()) + "/")
        self._await = _Await(self)
        self._armed: dict[tuple[Path, bool], tuple[ObservedWatch, tuple[int, int] | None]] = {}
        self._rearm_failed = False
        self.mode = "poll"
        if poll_only:
            return
        network = sorted({t for r in roots if (t := filesystem_type(r)) in NETWORK_FS})
        if network:
            log.info("polling only: %s does not deliver file events from other hosts", ", ".join(network))
            return
        observer = Observer()
        try:
            observer.start()
            self._observer = observer
            self._arm(observer)
        except OSError as exc:
            log.warning("file events unavailable (%s); polling only", exc)
            self.stop()
            self._observer = None
            return
        self.mode = "inotify+poll"

    def _roots(self) -> list[Path]:
        # a recursive watch does not follow links: their targets are roots too
        return sorted({_root(r) for r in self._paths} | set(linked_dirs(self._paths, self._out)))

    @property
    def events(self) -> bool:
        return self._observer is not None

    def take_structure_change(self) -> bool:
        """Was the tree changed (or a watch re-armed) since the last call? Re-arms dead watches."""
        changed, self.structure_changed = self.structure_changed, False
        if self._missing and any(r.exists() for r in self._missing):  # a path waited for appeared
            self._missing = [r for r in self._missing if not r.exists()]
            self.roots = self._roots()
            changed = True
        observer = self._observer
        for _ in range(REARM_PASSES if observer is not None else 0):
            try:
                if not self._arm(observer):
                    break
            except OSError as exc:  # e.g. the watch limit: the next call tries again, rescans go on
                if not self._rearm_failed:
                    log.warning("cannot watch %s again (%s); new files are found by rescans until it works",
                                ", ".join(map(str, self.roots)), exc)
                self._rearm_failed = True
                break
            changed = True
        return changed

    def _arm(self, observer: Observer) -> bool:
        """Watch each root (recursively), or its nearest existing ancestor while it is gone;
        replace watches whose directory is no longer the one watched. Returns whether any changed."""
        want: dict[tuple[Path, bool], tuple[int, int] | None] = {}
        for root in self.roots:
            here = _nearest_dir(root)
            want[(here, here == root)] = _identity(here)
        stale = [key for key, (_, identity) in self._armed.items() if want.get(key, ()) != identity]
        for key in stale:
            observer.unschedule(self._armed.pop(key)[0])
        added = [key for key in want if key not in self._armed]
        for path, recursive in added:
            handler, kinds = (self._wake, [*_CONTENT, *_STRUCTURE]) if recursive else (self._await, list(_ON_THE_WAY))
            watch = observer.schedule(handler, str(path), recursive=recursive, event_filter=kinds)
            self._armed[(path, recursive)] = (watch, want[(path, recursive)])
        return bool(stale or added)

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
