"""Polling backoff of :class:`sidecar.following.tailer.FileTail`: a file that stopped growing is
looked at less and less often, never less often than ``backoff`` seconds, and one that grows is
read at every look again.

The tail measures its waits on a :class:`FakeClock` the test steps, so each wait is checked to
the moment (a look just before it is due finds nothing, one at the moment reads), and
``QUIET_AFTER`` is the daemon's own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.following import tailer
from sidecar.following.clock import FakeClock
from sidecar.following.tailer import QUIET_AFTER, QUIET_START, FileTail

EPS = 1 / 64  # a step of the fake clock that adds up exactly


def _append(path: Path, text: str) -> None:
    with open(path, "ab") as fh:
        fh.write(text.encode())


def _lines(tail: FileTail) -> list[bytes]:
    return [line for _, line in tail.read(1 << 16)]


def test_a_quiet_file_is_looked_at_less_often_and_at_full_pace_once_it_grows(tmp_path: Path) -> None:
    clock = FakeClock()
    path = tmp_path / "info.log"
    path.write_bytes(b"step 1\n")
    tail = FileTail.open(path, clock=clock)
    tail.backoff = 0.5
    try:
        assert _lines(tail) == [b"step 1"]
        clock.advance(QUIET_AFTER - 0.5)
        assert _lines(tail) == [] and _lines(tail) == []  # not quiet for long enough: every read looks
        _append(path, "step 2\n")
        assert _lines(tail) == [b"step 2"]
        clock.advance(QUIET_AFTER)
        # Quiet: each look that finds nothing doubles the wait (0.125, 0.25, then the 0.5 cap).
        assert _lines(tail) == []  # a look: the next one is QUIET_START away
        for wait in (QUIET_START, 2 * QUIET_START, 0.5, 0.5):
            _append(path, "")  # nothing new
            clock.advance(wait - EPS)
            assert _lines(tail) == []
            clock.advance(EPS)
            assert _lines(tail) == []  # looked, still nothing: a longer wait
        _append(path, "step 3\n")
        clock.advance(0.5 - EPS)
        assert _lines(tail) == [], "looked at before its wait was up"
        clock.advance(EPS)
        assert _lines(tail) == [b"step 3"]  # at most `backoff` after the last look
        # It grew: the next line is read at the next look, not after a wait.
        _append(path, "step 4\n")
        assert _lines(tail) == [b"step 4"]
        assert tail.offset == path.stat().st_size
    finally:
        tail.close()


def test_without_backoff_every_read_looks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tailer, "QUIET_AFTER", 0.0)
    path = tmp_path / "info.log"
    path.write_bytes(b"")
    tail = FileTail.open(path, clock=FakeClock())
    try:
        for _ in range(5):
            assert tail.read(1 << 16) == []
        _append(path, "step 1\n")
        assert [line for _, line in tail.read(1 << 16)] == [b"step 1"]  # inotify mode: no look is skipped
    finally:
        tail.close()
