"""One TensorBoard event file, written synchronously with a real durability barrier.

Why not tensorboardX's ``SummaryWriter``: its ``flush()`` does not drain its queue, its writer
thread dies silently on ENOSPC (later adds block forever), and its file name (epoch seconds +
hostname, opened ``'wb'``) lets two writers in one second truncate each other. This class writes
TensorBoard's own event protos (40 ms to import; tensorboardX's package imports numpy and its
writer, 190 ms, on every start) in TFRecord framing (:mod:`sidecar.output.tfrecord`) and owns the file:

- the file is created with ``O_EXCL`` and never truncated or reopened;
- its name sorts after every event file already in the run directory, even if the clock went
  back, because TensorBoard reads a run's files in name order and later records win;
- ``write`` buffers (and hands the buffer to the kernel once it holds :data:`BUFFER_BYTES`, so a
  long replay between two checkpoints needs no more memory than a short one); ``flush`` hands
  bytes to the kernel (visible to TensorBoard); ``sync`` adds ``fsync`` (durable). A failed write is trimmed back to the last whole record, so
  the file never ends in garbage that a later reader would choke on.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable, Collection
from pathlib import Path

from tensorboard.compat.proto import event_pb2

from sidecar.output.tfrecord import frame

PREFIX = "events.out.tfevents."
BUFFER_BYTES = 256 << 10
_NAME = re.compile(r"events\.out\.tfevents\.(\d+)\.")
_OURS = re.compile(r"events\.out\.tfevents\.(\d+)\.(.+)\.(\d+)\.\d+\.mstb")  # seconds, host, pid
_HOST_UNSAFE = re.compile(r"[^A-Za-z0-9.-]+")
_counter = 0


class OutputLost(Exception):
    """Events written to ``run_dir`` are no longer there (deleted, moved away or replaced)."""

    def __init__(self, run_dir: Path, what: str) -> None:
        super().__init__(f"output lost: {what}")
        self.run_dir = run_dir
        self.what = what

    def __reduce__(self) -> tuple[type[OutputLost], tuple[Path, str]]:  # raised in a replay worker too
        return (OutputLost, (self.run_dir, self.what))


def event_files(run_dir: Path) -> list[Path]:
    """Event files of a run directory in TensorBoard's reading order (by name)."""
    try:
        names = sorted(n for n in os.listdir(run_dir) if "tfevents" in n)
    except FileNotFoundError:
        return []
    return [run_dir / n for n in names]


def vanished(run_dir: Path, name: str, size: int) -> str | None:
    """Why the first ``size`` bytes of event file ``name`` are no longer in ``run_dir``, or None."""
    if not name:
        return None
    path = run_dir / name
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return _deleted(path)
    if st.st_size < size:
        return f"{path} holds {st.st_size} of the {size} bytes written"
    return None


def _deleted(path: Path) -> str:
    return f"{path.parent if not path.parent.is_dir() else path} was deleted"


def next_file_name(run_dir: Path, now: float | None = None) -> str:
    """A name that sorts after every existing event file in ``run_dir``."""
    global _counter
    _counter += 1
    seconds = int(time.time() if now is None else now)
    existing = event_files(run_dir)
    if existing:
        m = _NAME.match(existing[-1].name)
        newest = int(m.group(1)) if m else 0
        candidate = _name(seconds, _counter)
        if candidate <= existing[-1].name:
            seconds = max(seconds, newest + 1)
    return _name(seconds, _counter)


def _name(seconds: int, counter: int) -> str:
    return f"{PREFIX}{seconds:010d}.{_host()}.{os.getpid()}.{counter}.mstb"


def _host() -> str:
    return _HOST_UNSAFE.sub("_", socket.gethostname())[:64] or "host"


def made_by(name: str, pids: Collection[int], since: float) -> bool:
    """Did one of this host's processes ``pids`` create the event file ``name`` at ``since`` or
    later (by its name)? A file named earlier belongs to an earlier process that had the pid."""
    m = _OURS.fullmatch(name)
    return m is not None and m.group(2) == _host() and int(m.group(3)) in pids and int(m.group(1)) >= int(since)


class EventFileWriter:
    """Appends framed ``Event`` records to a brand-new file; see the module docstring."""

    def __init__(self, run_dir: Path, wall_time: float, before_flush: Callable[[], None] | None = None) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self._before_flush = before_flush  # called before buffered records go to the kernel
        self.path = run_dir / next_file_name(run_dir)
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:  # the run directory was deleted right after it was made
            raise OutputLost(run_dir, _deleted(self.path)) from None
        st = os.fstat(self._fd)
        self._identity = (st.st_dev, st.st_ino)
        self._buffer: list[bytes] = []
        self._buffered = 0
        self._durable_size = 0
        self.size = 0
        self.write(event_pb2.Event(wall_time=wall_time, file_version="brain.Event:2"))

    def write(self, event: event_pb2.Event) -> None:
        self.write_encoded(event.SerializeToString())

    def write_encoded(self, payload: bytes) -> None:
        """An ``Event`` already in wire format (:mod:`sidecar.output.scalar_event`)."""
        record = frame(payload)
        self._buffer.append(record)
        self._buffered += len(record)
        if self._buffered >= BUFFER_BYTES:
            self.flush()

    @property
    def pending_size(self) -> int:
        """The file's size once the buffer is flushed."""
        return self.size + self._buffered

    def flush(self) -> None:
        """Hand buffered records to the kernel; on error trim the partial write and re-raise."""
        if not self._buffer:
            return
        if self._before_flush is not None:
            self._before_flush()
        data = b"".join(self._buffer)
        try:
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError:
            self._trim()
            raise
        self._buffer.clear()
        self._buffered = 0
        self.size += len(data)

    def sync(self) -> None:
        """Flush, then fsync: after this returns every written record survives a crash."""
        self.flush()
        if self._durable_size != self.size:
            os.fsync(self._fd)
            self._durable_size = self.size

    def lost(self) -> str | None:
        """Why this file is no longer the one TensorBoard reads at its path, or None if it is."""
        if os.fstat(self._fd).st_nlink == 0:
            return _deleted(self.path)
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return f"{self.path} was moved away"
        if (st.st_dev, st.st_ino) != self._identity:
            return f"{self.path} was replaced by another file"
        return None

    def close(self) -> None:
        try:
            self.sync()
        finally:
            os.close(self._fd)

    def abandon(self) -> None:
        """Close without writing what is still buffered (after a write error)."""
        self._buffer.clear()
        self._buffered = 0
        os.close(self._fd)

    def _trim(self) -> None:
        try:
            os.ftruncate(self._fd, self.size)
        except OSError:
            pass  # the disk is failing anyway; readers skip a truncated last record
