"""WakeUp's pace with inotify: a burst is taken at once after a quiet spell, a writer faster
than ``interval`` is read in batches, and neither a signal nor the caller's timeout waits for
the batch.

Real inotify and real time: the bounds that matter here are lower ones (no return sooner than
the interval), which a loaded machine cannot break; the upper ones are generous.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.following.clock import SYSTEM, Clock, FakeClock
from sidecar.following.wakeup import WakeUp


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "log").mkdir()
    return tmp_path


def _wake(tree: Path, interval: float, clock: Clock = SYSTEM) -> WakeUp:
    wake = WakeUp([tree / "log"], tree / "out", poll_only=False, interval=interval, clock=clock)
    if not wake.events:
        pytest.skip("inotify is not available here")
    return wake


def _append(tree: Path) -> None:
    with open(tree / "log" / "info.log", "a") as fh:
        fh.write("a line\n")


def _timed_wait(wake: WakeUp, timeout: float = 10.0) -> float:
    started = time.monotonic()
    wake.wait(timeout)
    return time.monotonic() - started


def test_a_write_after_a_quiet_spell_is_taken_at_once(tree: Path) -> None:
    """The interval is counted on the WakeUp's clock, stepped here (a fake clock stands still
    while the wait runs): quiet for longer than the interval, a write is taken at once."""
    clock = FakeClock()
    wake = _wake(tree, interval=3.0, clock=clock)
    try:
        _append(tree)
        assert _timed_wait(wake) < 1.5  # the first read: no interval to wait out
        clock.advance(3.2)  # quiet for longer than the interval
        _append(tree)
        assert _timed_wait(wake) < 1.5
    finally:
        wake.stop()


def test_a_writer_faster_than_the_interval_is_read_in_batches(tree: Path) -> None:
    wake = _wake(tree, interval=0.5)
    stop = threading.Event()

    def write() -> None:  # a line every 20 ms until stopped
        _append(tree)
        while not stop.wait(0.02):
            _append(tree)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        wake.wait(10)
        returns = [time.monotonic()]
        while returns[-1] - returns[0] < 3.0:
            wake.wait(10)
            returns.append(time.monotonic())
    finally:
        stop.set()
        writer.join()
        wake.stop()
    gaps = [b - a for a, b in zip(returns, returns[1:])]
    assert min(gaps) >= 0.49, gaps  # 150 writes in 3 s, at most one read per interval
    assert len(gaps) <= 7, gaps


def test_interval_zero_takes_every_burst(tree: Path) -> None:
    wake = _wake(tree, interval=0.0)
    try:
        wake.wait(0)
        took = 0.0
        for _ in range(10):
            _append(tree)
            took += _timed_wait(wake)
        assert took < 1.0  # about 5 ms each
    finally:
        wake.stop()


@pytest.fixture
def batching(tree: Path) -> Iterator[WakeUp]:
    """A write read just now, and another one: the next read is due in 30 s."""
    wake = _wake(tree, interval=30.0)
    _append(tree)
    wake.wait(10)
    _append(tree)
    yield wake
    wake.stop()


def test_a_signal_does_not_wait_for_the_batch(batching: WakeUp) -> None:
    threading.Timer(0.3, batching.wake).start()  # SIGTERM's relay rings the bell
    assert _timed_wait(batching) < 5


def test_the_batch_ends_with_the_callers_timeout(batching: WakeUp) -> None:
    """The loop's timeout is a promise too (a held record due, systemd's watchdog ping)."""
    assert 0.25 <= _timed_wait(batching, timeout=0.3) < 5
