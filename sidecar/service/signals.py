"""What signals ask of a live loop, as a plain object the loop reads between rounds.

:class:`Requests` holds the flags (stop, reload, report); the loop looks at them once per round
and clears what it handled. :func:`install` makes SIGTERM/SIGINT (and, for the node daemon,
SIGHUP/SIGUSR1) set them. A test builds :class:`Requests` itself, sets a flag and steps the loop
(:class:`~sidecar.following.waker.ManualWaker`): no signal, no second process.

The handlers only set flags. Waking the loop with ``Event.set()`` inside a handler deadlocks: the
handler runs in the main thread, which may hold the event's lock (inside ``wait``/``clear``) when
the signal lands; the process then ignores even SIGTERM. Instead Python's C-level handler writes
each signal to a pipe (``signal.set_wakeup_fd``) and a small thread turns that into the waker's
``wake()``.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType


@dataclass
class Requests:
    stop: bool = False  # SIGTERM/SIGINT: drain, checkpoint, exit 0
    reload: bool = False  # SIGHUP: rescan now
    report: bool = False  # SIGUSR1: log the status line now


def install(requests: Requests, wake: Callable[[], None], reload: bool = True) -> None:
    """Signals set ``requests`` and call ``wake`` (from a relay thread); main thread only.
    ``reload``: SIGHUP and SIGUSR1 too (the node daemon; the job aggregate takes only the stops)."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_relay, args=(read_fd, wake), name="signal-wakeup", daemon=True).start()

    def on(name: str) -> Callable[[int, FrameType | None], None]:
        def handler(signum: int, frame: FrameType | None) -> None:
            setattr(requests, name, True)
        return handler

    signal.signal(signal.SIGTERM, on("stop"))
    signal.signal(signal.SIGINT, on("stop"))
    if reload:
        signal.signal(signal.SIGHUP, on("reload"))
        signal.signal(signal.SIGUSR1, on("report"))


def _relay(read_fd: int, wake: Callable[[], None]) -> None:
    while os.read(read_fd, 64):
        wake()
