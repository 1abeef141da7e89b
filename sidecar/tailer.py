"""Following one log file: complete lines only, by identity, through renames and truncation.

Contract: every complete line (ending in ``\\n``) appended to the file is returned exactly once,
in order, with the byte offset where it starts; :attr:`FileTail.offset` always sits on a line
boundary (or inside a line being skipped for length, which :attr:`skipping` records).

Assumptions and how each is guarded:

- The file is identified by ``(st_dev, st_ino)``, not its path: mindformers rotates by rename
  (``info.log`` -> ``info.log.1``), so the open descriptor keeps reading the renamed file to
  EOF while the new ``info.log`` becomes a different tail.
- A file shorter than our offset was truncated in place (msrun truncates ``worker_N.log`` when
  a new job reuses ``--log_dir``): reading restarts at 0. A copytruncate by a writer without
  ``O_APPEND`` leaves a run of NUL bytes, which is dropped from the line start.
- A restored offset is trusted only if the file still holds the same bytes before it (the
  *offset marker*) and the same head; otherwise the file is read from 0. Re-reading is safe
  because the sequencer drops records it has already written; skipping would lose data.
- A partial last line is left unread until its newline arrives, so a line is never parsed
  half-written, and a restart re-reads it from its first byte.
- A line longer than ``max_line`` is skipped to its newline and counted; the file keeps going.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

HEAD_BYTES = 1024
MARKER_BYTES = 64
_NUL = b"\x00"


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


class FileTail:
    """Reads complete lines from one file; see the module docstring for the contract."""

    def __init__(self, path: Path, identity: Identity, offset: int = 0, max_line: int = 1 << 20) -> None:
        self.path = path
        self.identity = identity
        self.offset = offset
        self.max_line = max_line
        self.skipping = False
        self.long_lines = 0
        self.truncations = 0
        self.size = 0
        self.bytes_read = 0
        self._fd: int | None = None

    # -- identity checks -------------------------------------------------------------------
    def fingerprint(self) -> tuple[str, str]:
        """(head digest, offset-marker digest) of the bytes as they are now."""
        fd = self._open()
        head = os.pread(fd, HEAD_BYTES, 0)
        start = max(0, self.offset - MARKER_BYTES)
        marker = os.pread(fd, self.offset - start, start)
        return _digest(head[: min(HEAD_BYTES, self.offset) or HEAD_BYTES]), _digest(marker)

    def verify(self, head: str, marker: str) -> bool:
        """Is a restored offset still valid for this file's content? If not, restart at 0."""
        try:
            size = os.fstat(self._open()).st_size
            ok = size >= self.offset and self.fingerprint() == (head, marker)
        except OSError:
            ok = False
        if not ok:
            self.offset, self.skipping = 0, False
        return ok

    # -- reading ---------------------------------------------------------------------------
    def read(self, budget: int) -> list[tuple[int, bytes]]:
        """Up to ``budget`` bytes of complete lines as ``(start offset, line without \\n)``."""
        fd = self._open()
        self.size = size = os.fstat(fd).st_size
        if size < self.offset:
            self.truncations += 1
            self.offset, self.skipping = 0, False
        if size == self.offset:
            return []
        data = os.pread(fd, min(max(budget, self.max_line + 1), size - self.offset), self.offset)
        lines: list[tuple[int, bytes]] = []
        base = self.offset
        pos = 0
        end = len(data)
        while pos < end:
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
                line = data[pos:nl]
                if line[:1] == _NUL:
                    line = line.lstrip(_NUL)
                lines.append((base + pos, line))
            pos = nl + 1
        self.offset = base + pos
        self.bytes_read += pos
        return lines

    @property
    def at_eof(self) -> bool:
        return self.offset >= self.size and not self.skipping

    def stat(self) -> os.stat_result:
        return os.fstat(self._open())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    def _open(self) -> int:
        if self._fd is None:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            if Identity.of(os.fstat(fd)) != self.identity:
                os.close(fd)
                raise FileNotFoundError(f"{self.path} is no longer the file being followed")
            self._fd = fd
        return self._fd
