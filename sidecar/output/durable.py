"""Durable small files: written whole or not at all (a new file, fsync, rename, fsync of the directory).

What a checkpoint depends on (the state file, ``run.json``, a sink's spool) must survive a crash at
any moment either as it was or as it is now, never torn: readers take the old or the new file.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` once this returns, durably; a crash leaves the old content."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # never shared between processes
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    sync_dir(path.parent)


def sync_dir(directory: Path) -> None:
    """fsync ``directory``: a file created, renamed or deleted in it stays so after a crash."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
