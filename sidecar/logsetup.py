"""The sidecar's own log: stderr (journald-friendly), with repeated warnings rate-limited.

A diverging run can produce a NaN warning every step on every rank; journald drops a service's
messages past its burst limit, which would hide the first, useful ones. Records that carry a
``rate_key`` are let through at most ``burst`` times per ``window`` seconds per key, and the
number suppressed is reported when the key speaks again.
"""

from __future__ import annotations

import logging
import sys
import time


class RateLimit(logging.Filter):
    def __init__(self, burst: int = 5, window: float = 60.0) -> None:
        super().__init__()
        self.burst, self.window = burst, window
        self._seen: dict[object, tuple[float, int, int]] = {}  # key -> (window start, sent, dropped)

    def filter(self, record: logging.LogRecord) -> bool:
        key = getattr(record, "rate_key", None)
        if key is None:
            return True
        now = time.monotonic()
        start, sent, dropped = self._seen.get(key, (now, 0, 0))
        if now - start >= self.window:
            if dropped:
                record.msg = f"{record.msg} (and {dropped} similar messages suppressed)"
            start, sent, dropped = now, 0, 0
        if sent >= self.burst:
            self._seen[key] = (start, sent, dropped + 1)
            return False
        self._seen[key] = (start, sent + 1, dropped)
        return True


def setup_logging(quiet: bool, verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("mstb-sidecar: %(levelname)s: %(message)s"))
    handler.addFilter(RateLimit())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
