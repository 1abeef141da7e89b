"""One writer per ``--out`` and instance.

Two sidecars writing the same runs and the same checkpoint would each write every record (so
raw records are duplicated) and overwrite each other's offsets. So each process takes an
exclusive, non-blocking ``flock`` on ``--out/.mstb-sidecar/lock-<instance>`` before any work and
holds it until it exits. The kernel releases it when the process ends, however it ends, so a
SIGKILLed sidecar never leaves a stale lock: there is no pid check and nothing to clean up.
Different instances (one per node sharing ``--out``) lock different files.

The file's content (pid, host, start time, command line) is only for the error message and for
people; the lock is the ``flock``. On NFS, Linux maps ``flock`` onto the server's byte-range
locks (unless mounted with ``local_lock``), so two hosts using one instance name are stopped
too. A filesystem without lock support is a warning, not a refusal: the sidecar then runs
unguarded, as before this lock. A second run inside one process (tests call ``main`` twice)
finds the lock already its own.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from sidecar.output.state import STATE_DIR, instance_name

log = logging.getLogger(__name__)

_READ_TRIES = 20  # the holder writes its details right after locking; wait for them this often
_READ_PAUSE = 0.01
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
_HELD: set[tuple[int, int]] = set()  # lock files this process holds, by (st_dev, st_ino)


class LockError(Exception):
    """This process may not write ``--out`` as this instance (the message says why and what to do)."""


def hold(out: Path, instance: str) -> None:
    """Lock ``out`` for ``instance`` for the rest of this process, or raise :class:`LockError`.

    The descriptor is deliberately never closed (closing it would release the lock). Holding
    it already (a second run in one process, as tests do) is fine: that is still one writer.
    """
    name = instance_name(instance)
    path = out / STATE_DIR / f"lock-{name}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise LockError(f"cannot create {path}: {exc.strerror or exc}; choose an --out you can write to") from None
    identity = _identity(os.fstat(fd))
    if identity in _HELD:
        os.close(fd)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise LockError(
            f"another sidecar ({holder}) already writes {out} as instance {name}; "
            "stop it, or give this one its own --instance"
        ) from None
    except OSError as exc:
        if exc.errno not in _NO_LOCKS:
            os.close(fd)
            raise LockError(f"cannot lock {path}: {exc.strerror or exc}") from None
        log.warning("cannot lock %s (%s): make sure no other sidecar writes %s as instance %s",
                    path, exc.strerror, out, name)
    _HELD.add(identity)
    with contextlib.suppress(OSError):  # who holds it is for people; a full disk is reported by the writers
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_me()).encode() + b"\n", 0)


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _me() -> dict[str, object]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": sys.argv,
    }


def _holder(fd: int) -> str:
    """'pid 1234 on host, started ...' from the lock file, read until the holder has written it."""
    for _ in range(_READ_TRIES):
        try:
            info = json.loads(os.pread(fd, 1 << 16, 0))
            return f"pid {info['pid']} on {info['host']}, started {info['started']}"
        except (ValueError, KeyError, TypeError, OSError):
            time.sleep(_READ_PAUSE)
    return "a process that has not said who it is"
