"""``--on-alert CMD``: a user's command run for each alert, with the alert as JSON on stdin
(:meth:`sidecar.analysis.alerts.Alert.as_json`; its schema is in docs/alerts.md).

The command is an argument list (split once at start-up, like a shell would split it) and is
run without a shell, so nothing in an alert (paths, log text) can become shell syntax. It runs on
a thread of its own, one alert at a time in order, so a slow or hung command never holds up
reading: alerts wait in a bounded queue, and when the queue is full the newest are dropped,
counted and logged. Each run is killed after ``timeout`` seconds. A failing command (non-zero
exit, not found, timeout) is logged with the first line of its stderr, rate-limited, and does
not stop later alerts. :meth:`close` waits for what is queued, bounded, so a replay's alerts
are delivered before it exits.
"""

from __future__ import annotations

import json
import logging
import queue
import subprocess
import threading
import time

from sidecar.analysis.alerts import Alert

log = logging.getLogger(__name__)

QUEUE = 1000  # alerts waiting for the command, at most


class AlertCommand:
    def __init__(self, argv: list[str], timeout: float) -> None:
        self.argv = argv
        self.timeout = timeout
        self.dropped = 0
        self.failed = 0
        self._queue: queue.Queue[Alert | None] = queue.Queue(QUEUE)
        self._thread = threading.Thread(target=self._run, name="on-alert", daemon=True)
        self._thread.start()

    def __call__(self, alert: Alert) -> None:
        """The sink: never blocks."""
        try:
            self._queue.put_nowait(alert)
        except queue.Full:
            self.dropped += 1
            log.warning("--on-alert is behind (%d alerts waiting): %d alert(s) not sent so far", QUEUE,
                        self.dropped, extra={"rate_key": "on-alert-full"})

    def close(self, wait: float) -> None:
        """Let queued alerts run, at most ``wait`` seconds in all."""
        deadline = time.monotonic() + wait
        try:
            self._queue.put(None, timeout=wait)
        except queue.Full:
            pass
        self._thread.join(max(deadline - time.monotonic(), 0.0))
        if self._thread.is_alive():
            log.warning("--on-alert: %d alert(s) still waiting at exit were not sent", self._queue.qsize())

    def _run(self) -> None:
        while (alert := self._queue.get()) is not None:
            self._send(alert)

    def _send(self, alert: Alert) -> None:
        payload = json.dumps(alert.as_json()).encode()
        try:
            done = subprocess.run(self.argv, input=payload, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  timeout=self.timeout, check=False)
        except subprocess.TimeoutExpired:
            why = f"killed after {self.timeout:g} s"
        except OSError as exc:
            why = exc.strerror or str(exc)
        else:
            if done.returncode == 0:
                return
            first = done.stderr.decode(errors="replace").strip().splitlines()
            why = f"exit {done.returncode}" + (f": {first[0][:200]}" if first else "")
        self.failed += 1
        log.warning("--on-alert %s failed for %s (%s)", self.argv[0], alert.name, why,
                    extra={"rate_key": "on-alert-failed"})
