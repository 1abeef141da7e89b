"""Which files carry training metrics, which rank each belongs to, and in what order to read them.

Recognised (``mindformers-log-formats.md`` §10-§11):

- ``rank_N/info.log`` and its rotated backups ``info.log.1`` ... ``.5`` (r0.6+);
- ``rank_N/mindformers.log`` (r0.2-r0.3 INFO file) and ``rank_N/mindformer.log`` (rank-table
  stdout capture), plus their backups;
- msrun's ``worker_N.log``;
- r0.3 rank-table copies ``mf_parallelN/...`` (the device index is the rank on one node);
- any file named explicitly on the command line; a live log name (``info.log``, ...) brings
  its rotated backups along, which hold its unread rest when it was rotated while the sidecar
  was down (the engine finds the file it followed by identity under its new name).

``error.log`` is left out: every line in it is also in ``info.log``. The rank is the innermost
``rank_N`` / ``mf_parallelN`` / ``worker_N.log`` in the path, else the caller's default.
Within one rotation chain the oldest backup is read first, so steps come out in order.

Symbolic links (a linked ``output/log``, rank directory or log file) are followed, and paths
are kept as reached, so a link's own name gives the rank. Each real directory is entered once
and each real file is reported once (see :class:`_Walk`), so link loops end and ``--out`` stays
excluded however it is reached. The walk stops ``MAX_DEPTH`` directories below a root.

A directory that cannot be listed (permissions, I/O error) is reported to the caller with its
error, never skipped in silence: the rank directories below it are invisible until it is
readable, and the user must be told why curves are missing.
"""

from __future__ import annotations

import os
import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_LOG_NAME = re.compile(r"(?:info\.log|mindformers?\.log|worker_\d+\.log)(?:\.(\d+))?")
# MindSpore SummaryRecord files: <prefix>.out.events.summary.<seconds>.<device>.<host>_MS / _lineage
SUMMARY_NAME = re.compile(r".*\.out\.events\.summary\.(\d+)\..*(_MS|_lineage)")
_RANK_PART = re.compile(r"rank_(\d+)|mf_parallel(\d+)|worker_(\d+)\.log(?:\.\d+)?")
MAX_DEPTH = 8


@dataclass(frozen=True, slots=True)
class Candidate:
    """A file to follow. ``chain`` groups a live log with its rotated backups.

    ``ranked``: the rank comes from the path (not the default); ``summary``: a MindSpore
    summary file (converted by :mod:`sidecar.mindspore.ms_follow`), not a log.
    """

    path: Path
    rank: int
    chain: str
    backup: int  # 0 for the live file, N for ``.N`` (older as N grows)
    ranked: bool = False
    summary: bool = False

    def order(self) -> tuple[int, str, int]:
        return (self.rank, self.chain, -self.backup)


def rank_of(path: Path) -> int | None:
    """The innermost rank named by the path, or ``None``."""
    for part in reversed(path.parts):
        m = _RANK_PART.fullmatch(part)
        if m:
            return int(next(g for g in m.groups() if g is not None))
    return None


def discover(roots: list[Path], default_rank: int = 0, exclude: Path | None = None,
             unreadable: dict[Path, OSError] | None = None) -> list[Candidate]:
    """Every metric-bearing log under ``roots``, in reading order; directories that could not
    be listed go to ``unreadable``.

    A root that does not exist (now) yields nothing: the command line checks the paths once at
    start, and a live sidecar must outlive a job directory that is removed and made again.
    """
    walk = _Walk(exclude, unreadable)
    paths = [path for root in roots for path in walk.files(root)]
    if walk.linked:  # a file may have been reached under two paths: keep the first
        paths = _unique(paths)
    found = {path: _candidate(path, default_rank) for path in paths}
    return sorted(found.values(), key=Candidate.order)


def linked_dirs(roots: list[Path], exclude: Path | None = None) -> list[Path]:
    """Real directories that links under ``roots`` lead to, outside the roots' own trees: a
    linked directory, a linked file's directory. File events must be watched there too (a
    recursive watch on a root does not follow links). A link to an ancestor of a root (a loop)
    is left out, as watching it would watch far more than the job; rescans still read what it
    reaches.
    """
    walk = _Walk(exclude)
    for root in roots:
        for _ in walk.files(root):
            pass  # the walk records the links it followed
    trees = [root.resolve() if root.is_dir() else root.resolve().parent for root in roots if root.exists()]
    chosen: list[Path] = []
    for directory in walk.targets:
        inside = any(directory.is_relative_to(d) for d in trees + chosen)
        loop = any(tree.is_relative_to(directory) for tree in trees)
        if not inside and not loop:
            chosen.append(directory)
    return chosen


def _candidate(path: Path, default_rank: int) -> Candidate:
    rank = rank_of(path)
    m = _LOG_NAME.fullmatch(path.name)
    backup = int(m.group(1)) if m and m.group(1) else 0
    chain = str(path.with_suffix("")) if backup else str(path)
    summary = SUMMARY_NAME.fullmatch(path.name) is not None
    return Candidate(path, default_rank if rank is None else rank, chain, backup, rank is not None, summary)


def _wanted(name: str) -> bool:
    return _LOG_NAME.fullmatch(name) is not None or SUMMARY_NAME.fullmatch(name) is not None


class _Walk:
    """One discovery pass: symlinks followed as users lay out job trees, loops cut.

    Paths are kept as reached (a link's own name, ``rank_3 -> ../../store/r3``, gives the rank),
    but each real directory is entered once, by ``(st_dev, st_ino)``: a link to an ancestor or
    two links to one directory end there, and ``--out`` is never entered however it is reached.
    The walk is breadth-first, so a directory is entered under its shortest path from the root
    (``log/rank_3``, not ``log/loop/store/rank_3`` through a link to an ancestor), and within a
    directory real entries come before links (``rank_0``, not ``latest -> rank_0``). A file can
    then be reached twice only through a link to it, or by being named: ``linked`` says whether
    that happened, and ``targets`` lists the real directories links led to.
    """

    def __init__(self, exclude: Path | None, unreadable: dict[Path, OSError] | None = None) -> None:
        self._dirs: set[tuple[int, int]] = set()
        self._unreadable = {} if unreadable is None else unreadable
        self.linked = False
        self.targets: list[Path] = []
        if exclude is not None:
            try:
                self._dirs.add(_identity(os.stat(exclude)))
            except OSError:
                pass  # no --out yet: nothing of it to leave out

    def files(self, root: Path) -> Iterator[Path]:
        """``root`` itself when it is a file (with its rotated backups when it is a live log
        name: they hold its unread rest after a rotation), else the wanted files under it."""
        try:
            if root.is_file():
                self.linked = True
                yield root
                yield from _backups(root)
                return
        except OSError as exc:  # a path component we may not search
            self._unreadable[root] = exc
            return
        queue = deque([(root, 0)]) if self._enter(root) else deque()
        while queue:
            directory, depth = queue.popleft()
            try:
                entries = sorted(os.scandir(directory), key=lambda e: (e.is_symlink(), e.name))
            except (FileNotFoundError, NotADirectoryError):
                continue  # vanished mid-walk: the next rescan looks again
            except OSError as exc:
                self._unreadable[directory] = exc  # the next rescan tries again
                continue
            for entry in entries:
                path = Path(entry.path)
                try:
                    if entry.is_dir():
                        if depth < MAX_DEPTH and self._enter(path):
                            queue.append((path, depth + 1))
                            if entry.is_symlink():
                                self.targets.append(path.resolve())
                    elif _wanted(entry.name) and entry.is_file():
                        if entry.is_symlink():
                            self.linked = True
                            self.targets.append(path.resolve().parent)
                        yield path
                except OSError:
                    continue

    def _enter(self, directory: Path) -> bool:
        """First time this real directory is reached (and it is not ``--out``)?"""
        try:
            key = _identity(os.stat(directory))
        except (FileNotFoundError, NotADirectoryError):
            return False  # not there (yet)
        except OSError as exc:  # a path component we may not search
            self._unreadable[directory] = exc
            return False
        if key in self._dirs:
            return False
        self._dirs.add(key)
        return True


def _unique(paths: list[Path]) -> list[Path]:
    """The first path to each file (by ``(st_dev, st_ino)``); vanished ones are left out."""
    seen: set[tuple[int, int]] = set()
    out = []
    for path in paths:
        try:
            key = _identity(os.stat(path))
        except OSError:
            continue
        if key not in seen:
            seen.add(key)
            out.append(path)
    return out


def _backups(live: Path) -> list[Path]:
    """``info.log.1`` ... next to a live log file named on the command line."""
    m = _LOG_NAME.fullmatch(live.name)
    if m is None or m.group(1):
        return []
    prefix = live.name + "."
    try:
        names = [e.name for e in os.scandir(live.parent)]
    except OSError:
        return []
    return [live.with_name(n) for n in sorted(names) if n.startswith(prefix) and n[len(prefix):].isdecimal()]


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino
