"""Following one log file: complete lines only, by identity, through renames and truncation.

Contract: every complete line (ending in ``\\n``) appended to the file is returned exactly once,
in order, with the byte offset where it starts; :attr:`FileTail.offset` always sits on a line
boundary (or inside a line being skipped for length, which :attr:`skipping` records).

Assumptions and how each is guarded:

- The file is identified by ``(st_dev, st_ino)``, not its path: mindformers rotates by rename
  (``info.log`` -> ``info.log.1``), so the open descriptor keeps reading the renamed file to
  EOF while the new ``info.log`` becomes a different tail. The descriptor is opened when the
  file is found and is the file from then on; the path is only where it was last seen.
- A file shorter than our offset was truncated in place (msrun truncates ``worker_N.log`` when
  a new job reuses ``--log_dir``): reading restarts at 0. A file truncated and refilled past our
  offset between two looks is caught by the content check: every read first checks that the
  file's head and the bytes just before the offset are unchanged, and a mismatch also restarts
  at 0. A copytruncate by a writer without ``O_APPEND`` leaves a run of NUL bytes, which is
  skipped between lines.
- A restored offset is trusted only if the file still holds the same bytes before it (the
  *offset marker*) and the same head; otherwise the file is read from 0. Re-reading is safe
  because the sequencer drops records it has already written; skipping would lose data.
  The marker must be evidence, not a coincidence: a job relaunched with ``> train.log`` writes
  the same banner (the head) and records of the same width, and the end of a progress-bar line
  is the same at every step. So it covers whole lines before the offset, at least
  :data:`MARKER_LINES` and at least one that carries a date or a step (:func:`marker_start`,
  up to :data:`MARKER_MAX` bytes); the live content check compares the same bytes.
- A file that lost what was read of it (truncated, rewritten) keeps where it had been read to,
  by that content (:attr:`FileTail.left`, a :class:`Place`): a ``copytruncate`` copy that holds
  the same there is read on from that place (:meth:`FileTail.go_on`), not again from 0.
- A partial last line is left unread until its newline arrives, so a line is never parsed
  half-written, and a restart re-reads it from its first byte.
- A line longer than ``max_line`` is skipped to its newline and counted; the file keeps going.
- A file whose first line (after any NUL filler) holds a control byte no log line has is
  binary, not a log (:func:`looks_binary`, which ``check`` asks too): none of it is returned,
  so no garbage is parsed and no partial "line" waits forever; :attr:`FileTail.binary` says so.

Polling (no file events) a thousand files that do not grow would ``fstat`` each of them every
poll; with :attr:`FileTail.backoff` set, a file that has not grown for :data:`QUIET_AFTER` seconds
is looked at again only after a wait that doubles from :data:`QUIET_START` up to ``backoff``
seconds, and is back to every read as soon as it grows. Those waits are measured on the
:class:`~sidecar.following.clock.Clock` it is given (a test steps a fake one).

A stream (``--watch -``, standard input: a pipe from ``kubectl logs -f`` or ``tee``) is read by
:class:`StreamTail`, with the same line splitting, long-line skipping and binary check. It cannot
be re-read, so none of the identity checks apply and it is never checkpointed as a file: its
offset counts the bytes taken since this process started, and a restart goes on with what
arrives (the sequencer drops records the runs already hold).
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import select
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

from sidecar.following.clock import SYSTEM, Clock

HEAD_BYTES = 1024
MARKER_BYTES = 64  # the marker of checkpoints written before whole-line markers (FileState.marker_kind 1)
MARKER_LINES = 4  # whole lines before the offset that the marker covers, at least
MARKER_MAX = 16 << 10  # bytes before the offset it covers, at most (lines that long are rare)
TEXT_PEEK = 4096  # bytes of a file's first line that looks_binary judges
BINARY = "binary data, not a text log"  # what the engine and ``check`` call such a file
# Bytes no log line holds: NUL and the C0 controls but tab, newline, CR and ESC (colours).
_FILLER = re.compile(rb"\x00*")
_CONTROL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1a\x1c-\x1f\x7f]")
# What tells two runs' lines apart: a date (the timestamp prefix) or a step number.
_EVIDENCE = re.compile(rb"\d{4}-\d\d-\d\d|step\W{0,8}\d")
QUIET_AFTER = 10.0  # seconds without growth before a file is looked at less often (with a backoff)
QUIET_START = 0.125  # the first wait then; it doubles per look that finds nothing new


@dataclass(frozen=True, slots=True)
class Identity:
    dev: int
    ino: int

    @classmethod
    def of(cls, st: os.stat_result) -> "Identity":
        return cls(st.st_dev, st.st_ino)

    def key(self) -> str:
        return f"{self.dev}:{self.ino}"


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def looks_binary(start: bytes) -> bool:
    """Is a file that begins with ``start`` binary rather than a log? Its first line (up to
    :data:`TEXT_PEEK` bytes, after a copytruncate's NUL filler) holds a control byte."""
    begin = _FILLER.match(start).end()
    end = start.find(b"\n", begin, begin + TEXT_PEEK)
    return _CONTROL.search(start, begin, min(len(start), begin + TEXT_PEEK) if end < 0 else end) is not None


def marker_start(before: bytes) -> int:
    """Where the marker begins in ``before`` (bytes that end at the offset, a line boundary):
    the start of the :data:`MARKER_LINES`-th complete line back, or further back to a line with a
    date or a step; 0 when ``before`` holds fewer (the file's start, or :data:`MARKER_MAX`)."""
    end = len(before)
    lines = 0
    evidence = False
    while end > 0:
        start = before.rfind(b"\n", 0, end - 1) + 1
        if start == 0:
            return 0
        lines += 1
        evidence = evidence or _EVIDENCE.search(before, start, end) is not None
        if lines >= MARKER_LINES and evidence:
            return start
        end = start
    return 0


@dataclass(frozen=True, slots=True)
class Place:
    """How far a file was read, and by what it held before that: the digests of
    :meth:`FileTail.fingerprint`. Another file that holds the same there holds the lines read."""

    offset: int
    skipping: bool
    head: str
    marker: str
    kind: int = 2  # of the marker (FileTail.fingerprint)


STDIN = Path("-")  # the --watch path that means standard input
STDIN_NAME = Path("<stdin>")  # its name in messages, and its rotation chain


class FileTail:
    """Reads complete lines from one file; see the module docstring for the contract."""

    stream = False  # a StreamTail: no file behind it

    def __init__(self, path: Path, fd: int, max_line: int = 1 << 20, clock: Clock = SYSTEM) -> None:
        self.path = path
        self._clock = clock  # the backoff's waits
        self.identity = Identity.of(os.fstat(fd))
        self.offset = 0
        self.max_line = max_line
        self.skipping = False
        self.binary = False  # its start is binary data (looks_binary): skipped, not read
        self.long_lines = 0
        self.truncations = 0
        self.size = 0
        self.bytes_read = 0
        self.starved = False  # the last read stopped at its byte limit, complete lines may follow
        self.backoff = 0.0  # longest wait between looks at a file that does not grow (0: look every read)
        self._quiet = 0.0  # the current wait
        self._next_look = 0.0  # monotonic time before which a read does not look
        self._grew = clock.monotonic()  # when a read last found new bytes
        self._fd: int | None = fd
        # The file's first bytes and the bytes just before the offset, as read: a file that
        # still holds both was appended to, not rewritten.
        self._head = b""
        self._before = b""
        self.left: Place | None = None  # how far it was read before it lost that content (truncated, rewritten)

    @classmethod
    def open(cls, path: Path, max_line: int = 1 << 20, clock: Clock = SYSTEM) -> "FileTail":
        """Open ``path`` now: whatever file it names at this instant is the one followed."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return cls(path, fd, max_line, clock)
        except BaseException:
            os.close(fd)
            raise

    # -- identity checks -------------------------------------------------------------------
    def fingerprint(self, kind: int = 2) -> tuple[str, str]:
        """(head digest, offset-marker digest) of the bytes before the offset, as they are now.

        Both cover only bytes the file already had when the offset was reached (the head is
        the first ``min(HEAD_BYTES, offset)`` bytes, empty at 0), so a file that was only
        appended to after a checkpoint still verifies. ``kind`` 2: the marker is whole lines
        (:func:`marker_start`); 1: the last :data:`MARKER_BYTES` bytes (older checkpoints).
        """
        fd = self._open()
        head = os.pread(fd, min(HEAD_BYTES, self.offset), 0)
        return _digest(head), _digest(self._marker(fd) if kind == 2 else self._last(fd, MARKER_BYTES))

    def _last(self, fd: int, count: int) -> bytes:
        start = max(0, self.offset - count)
        return os.pread(fd, self.offset - start, start)

    def _marker(self, fd: int) -> bytes:
        """The marker's bytes (:func:`marker_start`), read back in growing pieces: the lines it
        covers are mostly far shorter than :data:`MARKER_MAX`."""
        want = HEAD_BYTES
        while True:
            before = self._last(fd, want)
            start = marker_start(before)
            if start or want >= MARKER_MAX or len(before) < want:
                return before[start:]
            want = min(4 * want, MARKER_MAX)

    def verify(self, head: str, marker: str, kind: int = 2) -> bool:
        """Is a restored offset still valid for this file's content? If not, restart at 0 (and
        keep the restored place as :attr:`left`)."""
        ok = self._holds(head, marker, kind)
        if not ok:
            if self.offset:
                self.left = Place(self.offset, self.skipping, head, marker, kind)
            self.offset, self.skipping = 0, False
        return ok

    def go_on(self, place: Place) -> bool:
        """Read on from ``place`` (another file's) if this file holds there what was read of that
        one: a copy of it (``copytruncate``), whose lines before are those read. Else stay."""
        offset, skipping = self.offset, self.skipping
        self.offset, self.skipping = place.offset, place.skipping
        if self._holds(place.head, place.marker, place.kind):
            return True
        self.offset, self.skipping = offset, skipping
        return False

    def place(self) -> Place | None:
        """How far it is read, by the bytes read (not the file's now: it may have lost them)."""
        return Place(self.offset, self.skipping, _digest(self._head), _digest(self._before)) if self.offset else None

    def _holds(self, head: str, marker: str, kind: int) -> bool:
        """Does the file hold, before the offset, the bytes with these digests? Then they are the
        reference for later reads."""
        try:
            ok = os.fstat(self._open()).st_size >= self.offset and self.fingerprint(kind) == (head, marker)
            if ok:
                self._remember()
        except OSError:
            ok = False
        return ok

    def start_at_end(self) -> None:
        """Skip what the file holds now, up to its last newline (``--from-end``)."""
        fd = self._open()
        pos = os.fstat(fd).st_size
        while pos > 0:
            step = min(65536, pos)
            nl = os.pread(fd, step, pos - step).rfind(b"\n")
            if nl >= 0:
                self.offset = pos - step + nl + 1
                break
            pos -= step
        self._remember()

    def _remember(self) -> None:
        """Take the bytes before the offset, as they are now, as the reference for later reads
        (at once: a file rewritten before the first read must not become the reference)."""
        fd = self._open()
        self._head = os.pread(fd, min(HEAD_BYTES, self.offset), 0)
        self._before = self._marker(fd)
        self.binary = looks_binary(self._head)  # what it would have been found at its first read

    # -- reading ---------------------------------------------------------------------------
    def read(self, budget: int) -> list[tuple[int, bytes]]:
        """Up to ``budget`` bytes of complete lines as ``(start offset, line without \\n)``."""
        fd = self._open()
        self.starved = False
        if self.backoff and self._clock.monotonic() < self._next_look:
            return []
        self.size = size = os.fstat(fd).st_size
        if size < self.offset:
            self._restart()
        if size == self.offset:
            if self.backoff and (now := self._clock.monotonic()) - self._grew >= QUIET_AFTER:
                self._quiet = min(self.backoff, 2 * self._quiet or QUIET_START)
                self._next_look = now + self._quiet
            return []
        if self._quiet:
            self._quiet = self._next_look = 0.0
        self._grew = self._clock.monotonic()
        data = self._read_checked(fd, max(budget, self.max_line + 1), size)
        base = self.offset
        self.starved = base + len(data) < size
        lines, pos = self._take(data, base)
        if len(self._head) < HEAD_BYTES:
            self._head += data[: min(pos, HEAD_BYTES - len(self._head))]
        if pos:
            before = (self._before + data[max(0, pos - MARKER_MAX) : pos])[-MARKER_MAX:]
            self._before = before[marker_start(before):]
        return lines

    def _take(self, data: bytes, base: int) -> tuple[list[tuple[int, bytes]], int]:
        """The complete lines of ``data`` (read at ``base``) and the position after the last one;
        moves :attr:`offset` and :attr:`bytes_read` past them."""
        if base == 0:
            self.binary = looks_binary(data)
        if self.binary:
            lines, pos = [], len(data)
        elif (lines := self._split(data, base)) is not None:
            pos = len(data) - len(lines.pop()[1])  # the partial last line waits for its newline
        else:
            lines, pos = self._scan(data, base)
        self.offset = base + pos
        self.bytes_read += pos
        return lines, pos

    def _split(self, data: bytes, base: int) -> list[tuple[int, bytes]] | None:
        """The common case in C: no line over ``max_line``, no NUL filler, no line being skipped.
        Returns the lines and, last, the partial line after them; ``None`` if the case is not common."""
        if self.skipping or b"\x00" in data:
            return None
        parts = data.split(b"\n")
        if max(map(len, parts)) > self.max_line or len(parts[-1]) >= self.max_line:
            return None
        return list(zip(accumulate(map((1).__add__, map(len, parts)), initial=base), parts))

    def _scan(self, data: bytes, base: int) -> tuple[list[tuple[int, bytes]], int]:
        """Line by line, skipping NUL filler and over-long lines; returns the lines and the
        position after the last complete one."""
        lines: list[tuple[int, bytes]] = []
        pos = 0
        end = len(data)
        while pos < end:
            if data[pos] == 0:  # copytruncate filler (rare, so the copy does not matter)
                pos = end - len(data[pos:].lstrip(b"\x00"))
                continue
            nl = data.find(b"\n", pos)
            if nl < 0:
                if self.skipping or end - pos >= self.max_line:
                    if not self.skipping:
                        self.long_lines += 1
                    self.skipping = True
                    pos = end  # discard the over-long line's bytes as we go
                break
            if self.skipping:
                self.skipping = False
            elif nl - pos > self.max_line:
                self.long_lines += 1
            else:
                lines.append((base + pos, data[pos:nl]))
            pos = nl + 1
        return lines, pos

    def _read_checked(self, fd: int, limit: int, size: int) -> bytes:
        """Up to ``limit`` bytes from the offset, once the file is known to be the same file.

        It must still start with the bytes it started with and still hold the bytes just before
        the offset; a file truncated and refilled past the offset between two looks fails one or
        the other (lines of equal length can repeat the bytes before the offset, but the first
        line's timestamp is new). Small files cost one ``pread``, larger ones two.
        """
        want = min(limit, size - self.offset)
        if self.offset <= HEAD_BYTES:  # the head is everything before the offset
            chunk = os.pread(fd, self.offset + want, 0)
            if chunk[: self.offset] == self._head:
                return chunk[self.offset :]
        else:
            keep = len(self._before)
            chunk = os.pread(fd, keep + want, self.offset - keep)
            if chunk[:keep] == self._before and os.pread(fd, HEAD_BYTES, 0) == self._head:
                return chunk[keep:]
        self._restart()  # rewritten in place (truncated and refilled past our offset)
        return os.pread(fd, min(limit, size), 0)

    def _restart(self) -> None:
        self.truncations += 1
        self.left = self.place() or self.left
        self.offset, self.skipping = 0, False
        self._head = self._before = b""

    def drained(self) -> bool:
        """Nothing after the offset right now; a file that cannot be read counts as drained."""
        try:
            return not self.skipping and os.fstat(self._open()).st_size <= self.offset
        except OSError:
            return True

    def unread(self) -> int:
        """Bytes after the offset right now (a fresh ``fstat``; none if the file shrank below it)."""
        return max(os.fstat(self._open()).st_size - self.offset, 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _open(self) -> int:
        if self._fd is None:
            raise OSError(errno.EBADF, f"{self.path} is no longer followed")
        return self._fd


class StreamTail(FileTail):
    """Complete lines from a stream (standard input), never blocking: a ``poll`` says whether
    bytes wait, and what follows the last newline is kept for the next read. :attr:`eof`: the
    writer closed it. The descriptor belongs to the process; :meth:`close` leaves it open, so a
    new engine (after output was deleted) goes on reading it."""

    stream = True

    def __init__(self, fd: int = 0, max_line: int = 1 << 20) -> None:
        super().__init__(STDIN_NAME, fd, max_line)
        self.identity = Identity(-1, fd)  # no file's: never taken for a checkpointed file
        self.eof = False
        self._rest = b""  # read after the last complete line
        self._ready = select.poll()
        self._ready.register(fd, select.POLLIN)

    def read(self, budget: int) -> list[tuple[int, bytes]]:
        fd = self._open()
        data, limit = self._rest, max(budget, self.max_line + 1)
        while not self.eof and len(data) < limit and self._ready.poll(0):
            chunk = os.read(fd, limit - len(data))
            self.eof = not chunk
            data += chunk
        self.starved = len(data) >= limit
        lines, pos = self._take(data, self.offset)
        self._rest = data[pos:]
        self.size = self.offset + len(self._rest)
        return lines

    def start_at_end(self) -> None:
        """Nothing to skip: what a stream holds is what arrives from now on."""

    def drained(self) -> bool:
        return not self.skipping and not self._rest

    def unread(self) -> int:
        return len(self._rest)

    def close(self) -> None:
        self._fd = None
