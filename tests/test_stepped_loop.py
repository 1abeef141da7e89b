"""The real live loops, in-process, stepped: time is a FakeClock, the wait is a ManualWaker.

``run_daemon`` and ``run_job_aggregate`` run in a thread with a :class:`FakeClock`, a
:class:`ManualWaker` and their own :class:`Requests` (no signal handlers). Each
:meth:`SteppedLoop.step` moves the clock, lets exactly one round run and returns once the loop
waits again, so a companion wait, a stall threshold, a checkpoint interval or an aggregate
timeout is crossed by stepping time, never by sleeping, and the output is read back between two
rounds (the loop is parked) with TensorBoard's loaders and the checkpoint's own model. (The
engine reads the same clock, :attr:`Settings.clock`, so a step's arrival and the loop agree.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from live_helpers import RankLog, loss_value
from sidecar.analysis.job_aggregate import JOB, MISSING_TAG
from sidecar.following.clock import FakeClock
from sidecar.following.waker import ManualWaker
from sidecar.output.state import StateStore
from sidecar.service.config import SidecarConfig
from sidecar.service.daemon import run_daemon
from sidecar.service.job_daemon import run_job_aggregate
from sidecar.service.signals import Requests
from tb_read import scalars, texts

INSTANCE = "test"


class SteppedLoop:
    """One live loop in a thread, parked in its wait between the test's steps."""

    def __init__(self, run: Callable[..., int], config: SidecarConfig, events: bool = True) -> None:
        self.config = config
        self.clock = FakeClock()
        self.waker = ManualWaker(self.clock, events=events)
        self.requests = Requests()
        self.status: int | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(run,), daemon=True)

    def _run(self, run: Callable[..., int]) -> None:
        try:
            self.status = run(self.config, clock=self.clock, wake=self.waker, requests=self.requests)
        except BaseException as exc:  # shown by the test, not lost in the thread
            self.error = exc
            self.waker.stop()

    def start(self) -> "SteppedLoop":
        """Start, and return once the first round (a scan and a read of all there is) is done."""
        self._thread.start()
        self.waker.parked()
        self._check()
        return self

    def step(self, advance: float | None = None) -> None:
        self.waker.step(advance)
        self._check()

    def stop(self) -> int | None:
        """What SIGTERM does: drain, checkpoint, return."""
        self.requests.stop = True
        self.waker.step(0)
        self._thread.join(10)
        assert not self._thread.is_alive(), "the loop did not end after the stop request"
        self._check()
        return self.status

    def _check(self) -> None:
        if self.error is not None:
            raise AssertionError("the loop raised") from self.error

    @property
    def wait_asked(self) -> float:
        """The timeout of the loop's current wait: when it means to wake by itself."""
        return self.waker.timeouts[-1]


def _config(tmp_path: Path, **options: object) -> SidecarConfig:
    out = tmp_path / "tb"
    out.mkdir(exist_ok=True)
    return SidecarConfig(**{"out": out, "paths": [tmp_path / "output"], "instance": INSTANCE, **options})


def _log(tmp_path: Path, rank: int) -> RankLog:
    return RankLog(tmp_path / "output" / "log" / f"rank_{rank}" / "info.log", rank)


def _losses(run: Path) -> dict[int, float]:
    return scalars(run).get("loss", {}) if run.is_dir() else {}


def _checkpointed(out: Path, log: RankLog) -> int | None:
    """The offset the checkpoint claims for ``log``'s file, or None (no checkpoint of it)."""
    state = StateStore(out, INSTANCE).load()
    return next((f.offset for f in state.files if Path(f.path) == log.path), None)


def test_checkpoint_interval(tmp_path: Path) -> None:
    """Events are visible every round; the checkpoint follows every --checkpoint-interval of
    the loop's clock, and a change made just after one waits for the next, not longer."""
    log = _log(tmp_path, 0)
    log.step(3)
    loop = SteppedLoop(run_daemon, _config(tmp_path, checkpoint_interval=5.0)).start()
    rank_0 = loop.config.out / "rank_0"
    assert _losses(rank_0) == {s: loss_value(0, s) for s in (1, 2, 3)}
    first = log.path.stat().st_size
    assert _checkpointed(loop.config.out, log) == first  # the first round is checkpointed at once

    log.step(3)
    loop.step(1.0)  # a file event one second later: read and written, not checkpointed yet
    assert _losses(rank_0) == {s: loss_value(0, s) for s in range(1, 7)}
    assert _checkpointed(loop.config.out, log) == first
    loop.step(3.5)  # 4.5 s after the last checkpoint
    assert _checkpointed(loop.config.out, log) == first
    loop.step(0.5)  # 5 s: due
    assert _checkpointed(loop.config.out, log) == log.path.stat().st_size
    assert loop.stop() == 0


def test_companion_wait(tmp_path: Path) -> None:
    """A step's head without its progress bar is held for --companion-wait of the loop's clock
    (the loop asks to wake by then), then written without the bar's throughput."""
    log = _log(tmp_path, 0)
    log.step(9)
    loop = SteppedLoop(run_daemon, _config(tmp_path, companion_wait=0.5)).start()
    rank_0 = loop.config.out / "rank_0"
    assert set(_losses(rank_0)) == set(range(1, 10))
    record = log.take()
    log.write(record[:record.index(b"\n") + 1])  # step 10's head, not its bar
    loop.step(0.0)
    assert loop.wait_asked <= 0.5, "a held head must bound the wait"
    assert 10 not in _losses(rank_0)
    loop.step(0.25)
    assert 10 not in _losses(rank_0), "released before its companion wait"
    loop.step(0.25)
    assert _losses(rank_0)[10] == loss_value(0, 10)
    assert 10 not in scalars(rank_0).get("throughput", {})  # its bar never came
    assert loop.stop() == 0


def test_job_aggregate_timeout(tmp_path: Path) -> None:
    """``aggregate``: a step some rank never reports is written --aggregate-timeout seconds of
    the loop's clock after it was first read, without that rank and marked, not a moment before."""
    logs = [_log(tmp_path, rank) for rank in (0, 1)]
    logs[0].step(3)
    logs[1].step(2)  # rank 1 stops before step 3
    node = SteppedLoop(run_daemon, _config(tmp_path, aggregate=False)).start()
    assert node.stop() == 0
    config = _config(tmp_path, instance=JOB, aggregate_timeout=30.0, poll_interval=1.0)
    job = SteppedLoop(lambda c, **kw: run_job_aggregate(c, False, **kw), config, events=False).start()
    mean = job.config.out / "aggregate" / "job"
    both = {s: (loss_value(0, s) + loss_value(1, s)) / 2 for s in (1, 2)}
    assert scalars(mean)["loss/mean"] == pytest.approx(both)
    job.step(29.5)
    assert 3 not in scalars(mean)["loss/mean"], "written before its timeout"
    job.step(0.5)
    assert scalars(mean)["loss/mean"] == pytest.approx({**both, 3: loss_value(0, 3)})
    marks = texts(mean)[MISSING_TAG]
    assert list(marks) == [3] and "rank(s) 1" in marks[3], marks
    assert job.stop() == 0


def test_stall_threshold(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A rank with no new step for --alerts stall min-seconds of the loop's clock (its median
    step time being short) is paged once, at that moment and not before, while the other goes
    on; the loop asks to wake by then however long it would otherwise wait."""
    config = _config(tmp_path, alerts={"stall": {"factor": 10, "min_seconds": 60}})
    logs = [_log(tmp_path, rank) for rank in (0, 1)]
    for log in logs:
        log.step(3)
    loop = SteppedLoop(run_daemon, config).start()
    for _ in range(5):  # a step of each rank every second
        for log in logs:
            log.step()
        loop.step(1.0)
    for _ in range(5):  # rank 1 hangs; rank 0 goes on, a step every 10 s
        logs[0].step()
        loop.step(10.0)
        assert loop.wait_asked <= 10.05
    assert "ALERT stall" not in caplog.text
    loop.step(10.0)  # 60 s after rank 1's last step: due, not past
    assert "ALERT stall" not in caplog.text and not texts(loop.config.out / "rank_1").get("alerts/stall")
    loop.step(1 / 64)
    assert caplog.text.count("ALERT stall: rank 1") == 1 and "ALERT stall: rank 0" not in caplog.text
    assert list(texts(loop.config.out / "rank_1")["alerts/stall"]) == [8]  # at rank 1's last step
    loop.step(None)
    assert caplog.text.count("ALERT stall: rank 1") == 1  # paged once
    assert loop.stop() == 0
