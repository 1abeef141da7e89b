"""Polling backoff of :class:`sidecar.following.tailer.FileTail`: a file that stopped growing is
looked at less and less often, never less often than ``backoff`` seconds, and one that grows is
read at every look again.

``QUIET_AFTER`` (10 s in the daemon: how long a file must not grow before it is left alone) is
set to 0 here, so the test need not wait for it; the waits themselves are the real ones.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sidecar.following import tailer
from sidecar.following.tailer import FileTail


def _append(path: Path, text: str) -> None:
    with open(path, "ab") as fh:
        fh.write(text.encode())


def _read_when_seen(tail: FileTail, limit: float) -> tuple[list[bytes], float]:
    """Read every 10 ms (as a fast poll would) until a line comes; the lines and how long it took."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        lines = tail.read(1 << 16)
        if lines:
            return [line for _, line in lines], time.monotonic() - started
        time.sleep(0.01)
    return [], limit


def test_a_quiet_file_is_looked_at_less_often_and_at_full_pace_once_it_grows(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tailer, "QUIET_AFTER", 0.0)
    path = tmp_path / "info.log"
    path.write_bytes(b"step 1\n")
    tail = FileTail.open(path)
    tail.backoff = 0.5
    try:
        assert [line for _, line in tail.read(1 << 16)] == [b"step 1"]
        # Quiet: each look that finds nothing doubles the wait (0.125, 0.25, then the 0.5 cap).
        deadline = time.monotonic() + 1.2
        while time.monotonic() < deadline:
            assert tail.read(1 << 16) == []
            time.sleep(0.01)
        time.sleep(0.6)
        assert tail.read(1 << 16) == []  # a look: the next one is at least QUIET_START away
        _append(path, "step 2\n")
        assert tail.read(1 << 16) == []  # not looked at yet
        lines, waited = _read_when_seen(tail, 2.0)
        assert lines == [b"step 2"]
        assert waited <= 0.5 + 0.1  # at most `backoff` after the last look
        # It grew: the next line is read at the next look, not after a wait.
        _append(path, "step 3\n")
        assert [line for _, line in tail.read(1 << 16)] == [b"step 3"]
        assert tail.offset == path.stat().st_size
    finally:
        tail.close()


def test_without_backoff_every_read_looks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tailer, "QUIET_AFTER", 0.0)
    path = tmp_path / "info.log"
    path.write_bytes(b"")
    tail = FileTail.open(path)
    try:
        for _ in range(5):
            assert tail.read(1 << 16) == []
        _append(path, "step 1\n")
        assert [line for _, line in tail.read(1 << 16)] == [b"step 1"]  # inotify mode: no look is skipped
    finally:
        tail.close()
