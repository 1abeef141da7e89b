"""systemd's notify protocol (``Type=notify``): readiness, status, watchdog, stopping.

A no-op when ``$NOTIFY_SOCKET`` is unset, so the daemon runs the same under Slurm, in a
container or from a shell. The watchdog is pinged at half of ``$WATCHDOG_USEC``, and only by the
main loop after a healthy iteration, so a stuck writer stops the pings and systemd restarts us.
"""

from __future__ import annotations

import os

from sdnotify import SystemdNotifier

from sidecar.following.clock import SYSTEM, Clock


class Notifier:
    def __init__(self, clock: Clock = SYSTEM) -> None:
        self.clock = clock  # the loop's: the health probe measures the loop in its own time
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._sd = SystemdNotifier() if self.enabled else None
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        watchdog = self.enabled and usec is not None and (pid is None or pid == str(os.getpid()))
        self.watchdog_interval = int(usec) / 2e6 if watchdog and usec else None
        self._last_ping = 0.0
        self._last_status = ""
        self.ready_at: float | None = None  # monotonic; also read by the metrics endpoint's /readyz
        self.healthy_at: float | None = None  # and /healthz

    def send(self, message: str) -> None:
        if self._sd is not None:
            self._sd.notify(message)

    def ready(self, status: str) -> None:
        self.send(f"READY=1\nSTATUS={status}")
        self._last_status = status
        self.ready_at = self.clock.monotonic()

    def status(self, status: str) -> None:
        if status != self._last_status:
            self.send(f"STATUS={status}")
            self._last_status = status

    def healthy(self) -> None:
        """Called by the main loop after an iteration that made progress or was idle-healthy."""
        now = self.healthy_at = self.clock.monotonic()
        if self.watchdog_interval is None:
            return
        if now - self._last_ping >= self.watchdog_interval:
            self.send("WATCHDOG=1")
            self._last_ping = now

    def since_healthy(self) -> float | None:
        """Seconds since the loop last said it ran (or since it was ready); None before that."""
        last = self.healthy_at or self.ready_at
        return None if last is None else self.clock.monotonic() - last

    def stopping(self) -> None:
        self.send("STOPPING=1")
