"""The sidecar's own log: stderr, with repeated warnings rate-limited.

Text lines carry a timestamp, except under journald (``$JOURNAL_STREAM`` names our stderr),
which stamps every line itself; ``--log-format json`` writes one object per line for log
shippers, its ``time`` in RFC 3339 with the UTC offset (a shipper on another host, or after a
summer-time change, must not have to guess the zone). ``-v`` shows the sidecar's own decisions; the file-event library's debug chatter
(every inotify event) stays hidden, as it says nothing about what the sidecar did.

A diverging run can produce a NaN warning every step on every rank; journald drops a service's
messages past its burst limit, which would hide the first, useful ones. Records that carry a
``rate_key`` are let through at most ``burst`` times per ``window`` seconds per key, and the
number suppressed is reported when the key speaks again.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from datetime import datetime


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


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created).astimezone().isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def under_journald() -> bool:
    """``$JOURNAL_STREAM`` is ``dev:ino`` of the stream systemd connected; it counts only if
    stderr is still that stream (not redirected by a wrapper script)."""
    stream = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return stream == f"{st.st_dev}:{st.st_ino}"


def setup_logging(quiet: bool, verbose: bool, log_format: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    elif under_journald():
        handler.setFormatter(logging.Formatter("mstb-sidecar: %(levelname)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s mstb-sidecar: %(levelname)s: %(message)s"))
    handler.addFilter(RateLimit())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
