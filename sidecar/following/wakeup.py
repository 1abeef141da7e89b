"""File-change wake-ups for the live loop: inotify (inotify_simple) where it works, else nothing.

Polling is the baseline (it is what finds NFS writes from other hosts); file events only cut the
wait between polls. Network and cluster filesystems never deliver remote writes as inotify
events, so on them, and when inotify cannot be set up (watch limits), the loop just polls.

Directories are watched, not files (a directory's watch reports writes to the files in it), one
inotify descriptor for all of them, read by the loop itself in :meth:`WakeUp.wait`: no thread
and no object per event. A training job appends hundreds of lines a second, a burst per step
(every rank's lines): the loop waits :data:`COALESCE` after the first event for the rest of the
burst and takes all queued events in one ``read`` (the kernel merges repeated writes to one file
that nobody has read yet), so it reads a step of every rank in one round. ``--out`` is not watched (our own
writes must not wake us).

Nor does it read more often than every ``--min-read-interval`` (``interval``): a job that
writes faster is read in batches, each round's fixed cost (a wake-up, a ``read`` and an event
write per file, the engine's pass over its sources) shared by every line that came meanwhile,
and the lines processed while the caches are warm (one burst at a time, a round runs after a
sleep in which the writers ran, and the same lines took about 45% longer in a profile). At 20
steps a second the default (0.08 s) reads 12 times a second instead of 20, for 0.8 of the CPU,
and keeps the wait in tens of milliseconds. A line written after a quiet spell is still read
:data:`COALESCE` after its event: the pause is counted from the last return of
:meth:`WakeUp.wait` (after which the loop reads), not from the event.

A watch dies with its directory: ``rm -rf output/log`` (a new job in the same place) deletes the
watched root, and the re-created directory would send no events until the next full rescan.
So the watches are re-armed from the main loop (:meth:`WakeUp.take_structure_change`, one
``stat`` per root): while a root is gone its nearest existing ancestor is watched, for entries
on the way to the root only, so the re-creation is itself an event; once it exists again (a
new directory) it is watched anew and a structure change makes the loop rescan at once. A root
renamed away is an event too; one whose parent was renamed away sends none and is noticed at
the next wake-up, at worst the loop's reconcile interval.

A ``--watch`` path that does not exist yet (the sidecar starts before the job) is a gone root
from the start: it is awaited the same way, and taken for a directory until it appears (a file
named on the command line is then watched through the directory that holds it).

``--watch -`` (standard input) is no directory to watch: bytes waiting on descriptor 0 wake the
loop as a file event does (the same :data:`COALESCE` and read interval), and with no other path
nothing is watched.
"""

from __future__ import annotations

import errno
import logging
import os
import select
from pathlib import Path

from inotify_simple import INotify, flags, parse_events

from sidecar.following.clock import SYSTEM, Clock
from sidecar.following.discovery import linked_dirs
from sidecar.following.tailer import STDIN
from sidecar.following.waker import Bell

log = logging.getLogger(__name__)

NETWORK_FS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "glusterfs", "ceph", "9p", "fuse.sshfs",
     "fuse.juicefs", "fuse.s3fs", "fuse.ossfs", "fuse.obsfs", "fuse.gcsfuse", "afs", "panfs", "wekafs"}
)

# Only writes and changes of the tree wake us: our own opens and reads of the logs must not.
_STRUCTURE = flags.CREATE | flags.DELETE | flags.MOVED_FROM | flags.MOVED_TO | flags.DELETE_SELF | flags.MOVE_SELF
_TREE = flags.MODIFY | flags.CLOSE_WRITE | _STRUCTURE | flags.ONLYDIR | flags.DONT_FOLLOW
# What an ancestor's watch reports: the directories on the way, or a root that is a file.
_ON_THE_WAY = flags.CREATE | flags.DELETE | flags.MOVED_FROM | flags.MOVED_TO | flags.ONLYDIR
COALESCE = 0.005  # after a write wakes the loop, the rest of its burst (every rank's lines) comes along
REARM_PASSES = 3  # a root re-created while its ancestor's watch was being set sends no event
_READ = 1 << 16  # bytes per read of the inotify descriptor (an event is at most 16 + NAME_MAX + 1)


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


def _within(path: Path, top: Path) -> bool:
    return path == top or top in path.parents


class _Inotify:
    """One inotify descriptor (``inotify_simple``); each watch descriptor belongs to one armed key
    ``(dir, recursive)``."""

    def __init__(self) -> None:
        self._inotify = INotify(nonblocking=True)  # OSError where the system has no inotify
        self.fd = self._inotify.fileno()
        self.dirs: dict[int, tuple[Path, tuple[Path, bool]]] = {}  # wd -> (directory, armed key)

    def watch(self, path: Path, mask: int, key: tuple[Path, bool]) -> None:
        """Watch ``path`` for ``key``; a directory watched already (nested roots, a gone root's
        ancestor inside another root) gets both masks, and a tree's key wins (it wakes for more)."""
        wd = self._inotify.add_watch(path, mask | flags.MASK_ADD)
        if wd not in self.dirs or key[1]:
            self.dirs[wd] = (path, key)

    def tree(self, top: Path, key: tuple[Path, bool], out: Path) -> None:
        """Watch ``top`` and every directory below it (links not followed, ``out`` left out);
        one that vanishes or may not be read on the way is skipped (a rescan finds its files)."""
        stack = [top]
        while stack:
            path = stack.pop()
            if _within(path, out):
                continue
            try:
                self.watch(path, _TREE, key)
                with os.scandir(path) as entries:
                    stack.extend(Path(e.path) for e in entries if e.is_dir(follow_symlinks=False))
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EACCES) or path == top:
                    raise

    def forget(self, keys: set[tuple[Path, bool]], below: Path | None = None) -> None:
        """Remove the watches of ``keys`` (only those at or below ``below``, if given)."""
        for wd, (path, key) in list(self.dirs.items()):
            if key in keys and (below is None or _within(path, below)):
                del self.dirs[wd]
                try:
                    self._inotify.rm_watch(wd)
                except OSError:
                    pass  # a watch the kernel already dropped (its directory is gone)

    def events(self) -> list[tuple[int, int, int, str]]:
        """Every queued (wd, mask, cookie, name), without waiting. Read here, not with
        ``INotify.read``, which asks the queue's size with an ``ioctl`` first: the live loop reads
        after every burst of writes, and the descriptor is non-blocking anyway."""
        chunks = []
        try:
            while not chunks or len(chunks[-1]) == _READ:  # a full read may have left more
                chunks.append(os.read(self.fd, _READ))
        except BlockingIOError:
            pass  # nothing (more) queued
        return parse_events(b"".join(chunks)) if chunks else []

    def close(self) -> None:
        self._inotify.close()


class WakeUp:
    """The node daemon's :class:`~sidecar.following.waker.Waker`: ``wait(timeout)`` returns early
    when a watched file changes (if inotify is in use) or when :meth:`wake` is called.

    ``structure_changed`` says a file or directory was created, moved or deleted since the
    last :meth:`take_structure_change`, i.e. a rescan is due now rather than at the next reconcile.
    """

    def __init__(self, roots: list[Path], out: Path, poll_only: bool, interval: float,
                 clock: Clock = SYSTEM) -> None:
        self.event = Bell()
        self._clock = clock
        self.interval = interval
        self._returned = float("-inf")  # when wait() last returned: the loop read then
        self.structure_changed = False
        self._paths, self._out = [r for r in roots if r != STDIN], out.resolve()
        self._missing = [r for r in self._paths if not r.exists()]
        self.roots = self._roots()
        self._inotify: _Inotify | None = None
        self._armed: dict[tuple[Path, bool], tuple[int, int] | None] = {}
        self._rearm_failed = False
        self._poller, self._bell = select.poll(), select.poll()
        self._poller.register(self.event.read_fd, select.POLLIN)
        self._bell.register(self.event.read_fd, select.POLLIN)
        self._stdin = STDIN in roots
        if self._stdin:
            self._poller.register(0, select.POLLIN)
        self.mode = "poll"
        if not self._paths:
            self.mode = "standard input"
            return
        if poll_only:
            return
        network = sorted({t for r in self._paths if (t := filesystem_type(r)) in NETWORK_FS})
        if network:
            log.info("polling only: %s does not deliver file events from other hosts", ", ".join(network))
            return
        try:
            self._inotify = _Inotify()
            self._arm()
        except OSError as exc:
            log.warning("file events unavailable (%s); polling only", exc.strerror or exc)
            if self._inotify is not None:
                self._inotify.close()
                self._inotify = None
            return
        self._poller.register(self._inotify.fd, select.POLLIN)
        self.mode = "inotify+poll"

    def _roots(self) -> list[Path]:
        # a recursive watch does not follow links: their targets are roots too
        return sorted({_root(r) for r in self._paths} | set(linked_dirs(self._paths, self._out)))

    @property
    def events(self) -> bool:
        return self._inotify is not None

    def wake(self) -> None:
        """End the current (or the next) :meth:`wait` now; safe from any thread."""
        self.event.set()

    def take_structure_change(self) -> bool:
        """Was the tree changed (or a watch re-armed) since the last call? Re-arms dead watches."""
        changed, self.structure_changed = self.structure_changed, False
        if self._missing and any(r.exists() for r in self._missing):  # a path waited for appeared
            self._missing = [r for r in self._missing if not r.exists()]
            self.roots = self._roots()
            changed = True
        for _ in range(REARM_PASSES if self._inotify is not None else 0):
            try:
                if not self._arm():
                    break
            except OSError as exc:  # e.g. the watch limit: the next call tries again, rescans go on
                if not self._rearm_failed:
                    log.warning("cannot watch %s again (%s); new files are found by rescans until it works",
                                ", ".join(map(str, self.roots)), exc.strerror or exc)
                self._rearm_failed = True
                break
            changed = True
        return changed

    def _arm(self) -> bool:
        """Watch each root (recursively), or its nearest existing ancestor while it is gone;
        replace watches whose directory is no longer the one watched. Returns whether any changed.
        Asked every round: the common answer (every root is there and is the directory armed)
        takes one ``stat`` per root."""
        inotify = self._inotify
        assert inotify is not None
        if len(self._armed) == len(self.roots) and all(
            (identity := _identity(root)) is not None and self._armed.get((root, True)) == identity
            for root in self.roots
        ):
            return False
        want: dict[tuple[Path, bool], tuple[int, int] | None] = {}
        for root in self.roots:
            here = _nearest_dir(root)
            want[(here, here == root)] = _identity(here)
        stale = {key for key, identity in self._armed.items() if want.get(key, ()) != identity}
        inotify.forget(stale)
        for key in stale:
            del self._armed[key]
        added = [key for key in want if key not in self._armed]
        for key in added:
            path, recursive = key
            self._armed[key] = want[key]
            if recursive:
                inotify.tree(path, key, self._out)
            else:
                inotify.watch(path, _ON_THE_WAY, key)
        return bool(stale or added)

    def wait(self, timeout: float) -> None:
        """Until a file event that matters (then :data:`COALESCE` more, or until :attr:`interval`
        after the last return, whichever is later, but not past ``timeout``), :meth:`wake` or
        ``timeout``; takes every event queued."""
        self._wait(self._clock.monotonic() + timeout)
        self._returned = self._clock.monotonic()

    def _wait(self, deadline: float) -> None:
        while True:
            ready = {fd for fd, _ in self._poller.poll(max(0.0, deadline - self._clock.monotonic()) * 1000)}
            if self.event.read_fd in ready and self.event.take():
                return
            written = self._inotify is not None and self._inotify.fd in ready
            if written or self._stdin and 0 in ready:
                # the rest of the burst, and what comes until the next read is due: all read in one round
                pause = max(COALESCE, min(self._returned + self.interval, deadline) - self._clock.monotonic())
                if self._bell.poll(pause * 1000) and self.event.take():  # a signal does not wait for it
                    return
                if not written or self._take_events():
                    return
            if not ready or self._clock.monotonic() >= deadline:
                return

    def _take_events(self) -> bool:
        """Note structure changes, watch new directories; whether any event should wake the loop."""
        inotify = self._inotify
        if inotify is None:
            return False
        wake = False
        for wd, mask, _, name in inotify.events():
            if not mask & (_STRUCTURE | flags.Q_OVERFLOW | flags.IGNORED):  # a write: only tree watches ask for them,
                wake = True  # and never in --out (not watched; writes inside it are no event here)
                continue
            if mask & flags.Q_OVERFLOW:  # events were lost: rescan
                self.structure_changed = wake = True
                continue
            if mask & flags.IGNORED:  # the kernel dropped the watch (its directory is gone)
                inotify.dirs.pop(wd, None)
                continue
            entry = inotify.dirs.get(wd)
            if entry is None:
                continue
            directory, key = entry
            path = directory / os.fsdecode(name) if name else directory
            if not key[1]:  # an ancestor's watch: only entries on the way to a root
                if any(_within(root, path) for root in self.roots):
                    self.structure_changed = wake = True
                continue
            if _within(path, self._out):  # our own output must not wake us
                continue
            wake = self.structure_changed = True
            if mask & flags.ISDIR and mask & (flags.MOVED_FROM | flags.DELETE):
                inotify.forget({key}, below=path)
            if mask & flags.ISDIR and mask & (flags.CREATE | flags.MOVED_TO):
                try:
                    inotify.tree(path, key, self._out)
                except (FileNotFoundError, NotADirectoryError):
                    pass  # gone again already
                except OSError as exc:  # the watch limit: rescans still find its files
                    log.warning("cannot watch %s (%s); its files are found by rescans", path, exc.strerror or exc)
        return wake

    def stop(self) -> None:
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None
