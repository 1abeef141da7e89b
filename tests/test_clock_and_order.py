"""Log timestamps are data, not an order; sources of one rank are ordered by what they hold.

Issue 9, items 1 and 2, in replay and live, read back with TensorBoard's loader:

- the end of summer time (``TZ=Europe/Berlin``: local time falls back an hour), an NTP step back
  of two minutes, and a resume on a host whose clock is 20 s behind all keep every record in
  file order, and a step that goes back in a file is a resume whatever its timestamp;
- ``info.log`` and ``worker_N.log`` carrying the same records (a resume included) are written once;
- two attempt directories whose names sort against their age (``attempt_10`` resumed at 800 from
  ``attempt_9``'s steps 1-1000), given in either order, with ``attempt_10``'s clock behind.
"""

from __future__ import annotations

import os
import subprocess
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from live_helpers import BIN, LiveEnv, RankLog, all_written, raw_run, tb_points, wait_until

pytest_plugins = ["live_helpers"]


def replay(paths: list[Path], out: Path, tz: str = "UTC") -> str:
    done = subprocess.run(
        [str(BIN), "replay", *map(str, paths), "--out", str(out), "--instance", "test", "--no-aggregate"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TZ": tz},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def dst_log(path: Path, steps: int) -> RankLog:
    """Steps 10 s apart from 02:00 local on the last Sunday of October 2026: the hour
    02:00-03:00 happens twice in Europe/Berlin, so timestamps jump back an hour at step 361."""
    log = RankLog(path, 0, start=datetime(2026, 10, 25, 1, 59, 59))
    for step in range(1, steps + 1):
        if step == 361:
            log.clock -= timedelta(hours=1)
        log.write(log.take())
        log.clock += timedelta(seconds=10) - timedelta(milliseconds=3)
    return log


def test_replay_across_the_end_of_summer_time_keeps_every_step(tmp_path: Path) -> None:
    log = dst_log(tmp_path / "output/log/rank_0/info.log", 720)
    summary = replay([tmp_path / "output"], tmp_path / "tb", tz="Europe/Berlin")
    assert dict(tb_points(tmp_path / "tb/rank_0")) == log.expected
    assert len(log.expected) == 720
    assert "by reason" not in summary


def ntp_step_back(log: RankLog, steps: int, at: int) -> None:
    for step in range(1, steps + 1):
        if step == at:
            log.clock -= timedelta(minutes=2)
        log.step()


def test_replay_with_an_ntp_step_back_keeps_every_step(tmp_path: Path) -> None:
    log = RankLog(tmp_path / "output/log/rank_0/info.log", 0)
    ntp_step_back(log, 60, at=31)
    replay([tmp_path / "output"], tmp_path / "tb")
    assert dict(tb_points(tmp_path / "tb/rank_0")) == log.expected
    assert sorted(log.expected) == list(range(1, 61))


def test_live_with_an_ntp_step_back_and_summer_time_keeps_every_step(live: LiveEnv) -> None:
    log = live.info_log(0)
    log.step(10)
    sidecar = live.sidecar().start()
    wait_until(lambda: all_written(live.out, [log]), 10, "the first steps")
    ntp_step_back(log, 50, at=5)  # steps 11-60, the clock two minutes back from step 15 on
    log.clock -= timedelta(hours=1)
    log.step(20)
    live.finish(sidecar, [log])
    assert sorted(log.expected) == list(range(1, 81))


def behind_resume(log: RankLog, at: int, lag: timedelta) -> None:
    """Training resumes at ``at`` on a host whose clock is ``lag`` behind the first one."""
    log.go_back(at)
    log.clock -= lag
    log.step(15)


def test_replay_resume_on_a_host_whose_clock_is_behind_shows_the_new_values(tmp_path: Path) -> None:
    log = RankLog(tmp_path / "output/log/rank_0/info.log", 0)
    log.step(40)
    behind_resume(log, 30, timedelta(seconds=20))
    replay([tmp_path / "output"], tmp_path / "tb")
    assert dict(tb_points(tmp_path / "tb/rank_0")) == log.expected
    assert log.expected[35] == 35.25  # the resumed segment's value, not the first attempt's
    assert raw_run(tmp_path / "tb/rank_0").starts[-1] == 30


def test_live_resume_on_a_host_whose_clock_is_behind_shows_the_new_values(live: LiveEnv) -> None:
    log = live.info_log(0)
    log.step(40)
    sidecar = live.sidecar().start()
    wait_until(lambda: all_written(live.out, [log]), 10, "the first attempt")
    behind_resume(log, 30, timedelta(seconds=20))
    live.finish(sidecar, [log])


class Mirrored:
    """One rank's records written to ``info.log`` and, byte for byte, to ``worker_N.log``."""

    def __init__(self, output: Path, rank: int) -> None:
        self.log = RankLog(output / "log" / f"rank_{rank}" / "info.log", rank)
        self.worker = output / "msrun_log" / f"worker_{rank}.log"
        self.worker.parent.mkdir(parents=True, exist_ok=True)

    def step(self, count: int) -> None:
        for _ in range(count):
            data = self.log.take()
            self.log.write(data)
            with open(self.worker, "ab") as fh:
                fh.write(data)


def test_replay_info_and_worker_logs_with_a_resume_are_written_once(tmp_path: Path) -> None:
    mirror = Mirrored(tmp_path / "output", 0)
    mirror.step(40)
    mirror.log.go_back(25)
    mirror.log.clock -= timedelta(minutes=5)  # and the clock was stepped back meanwhile
    mirror.step(30)
    summary = replay([tmp_path / "output"], tmp_path / "tb")
    run = tmp_path / "tb/rank_0"
    assert dict(tb_points(run)) == mirror.log.expected
    assert raw_run(run).starts.count(25) == 1, "one resume, not one per copy"
    # Each of the 70 records of the copy is accounted: 54 copies of shown records and 16 of
    # records the resume superseded (steps 25-40 of the first attempt).
    assert "54 duplicate, 16 superseded" in summary, summary


def test_live_info_and_worker_logs_with_a_resume_are_written_once(live: LiveEnv) -> None:
    mirror = Mirrored(live.output, 0)
    mirror.step(20)
    sidecar = live.sidecar().start()
    wait_until(lambda: all_written(live.out, [mirror.log]), 10, "the first steps")
    mirror.log.go_back(12)
    mirror.log.clock -= timedelta(minutes=5)
    mirror.step(20)
    live.finish(sidecar, [mirror.log])
    assert raw_run(live.out / "rank_0").starts.count(12) == 1


def attempts(root: Path) -> tuple[dict[int, float], list[Path]]:
    """``attempt_9`` runs steps 1-1000; ``attempt_10`` resumes from its step-800 checkpoint and
    runs 801-1500 on a host whose clock is a day behind. Returns what TensorBoard must show."""
    first = RankLog(root / "attempt_9/output/log/rank_0/info.log", 0, start=datetime(2026, 11, 20, 8, 0))
    first.step(1000)
    second = RankLog(root / "attempt_10/output/log/rank_0/info.log", 0, start=datetime(2026, 11, 19, 8, 0))
    second.segment = 1
    second.next_step = 801
    second.step(700)
    want = {s: v for s, v in first.expected.items() if s <= 800} | second.expected
    return want, [root / "attempt_9", root / "attempt_10"]


@pytest.mark.parametrize("order", ["by age", "by name"])
def test_replay_of_attempt_directories_in_either_order(tmp_path: Path, order: str) -> None:
    want, dirs = attempts(tmp_path / "jobs")
    paths = dirs if order == "by age" else sorted(dirs)  # "attempt_10" < "attempt_9"
    summary = replay(paths, tmp_path / "tb")
    assert dict(tb_points(tmp_path / "tb/rank_0")) == want
    assert "by reason" not in summary, summary  # attempt_9's 801-1000 were written, then superseded


def test_live_start_on_attempt_directories_named_against_their_age(live: LiveEnv) -> None:
    want, _ = attempts(live.output / "jobs")
    sidecar = live.sidecar().start()
    wait_until(lambda: dict(tb_points(live.out / "rank_0")) == want, 20, "both attempts")
    rc, _ = sidecar.stop()
    assert rc == 0


def test_replay_of_two_fresh_starts_orders_them_by_their_first_timestamp(tmp_path: Path) -> None:
    """Two runs from step 1 (a job restarted from scratch): nothing in the steps says which came
    later, so the first timestamps do; ``run_a`` sorts first by name but started a day later."""
    later = RankLog(tmp_path / "run_a/output/log/rank_0/info.log", 0, start=datetime(2026, 11, 21, 8, 0))
    later.segment = 1
    later.step(30)
    earlier = RankLog(tmp_path / "run_b/output/log/rank_0/info.log", 0, start=datetime(2026, 11, 20, 8, 0))
    earlier.step(50)
    replay([tmp_path / "run_a", tmp_path / "run_b"], tmp_path / "tb")
    assert dict(tb_points(tmp_path / "tb/rank_0")) == later.expected


def test_replay_counts_an_unfinished_last_line(tmp_path: Path) -> None:
    """A trainer killed mid-line leaves a cut record: it is not parsed (its loss may be cut
    short), but it is counted, never silently skipped."""
    log = RankLog(tmp_path / "output/log/rank_0/info.log", 0)
    log.step(5)
    record = log.record(6)
    log.write(record[: record.index(b"loss: ") + 9])
    del log.expected[6]
    out = replay([tmp_path / "output"], tmp_path / "tb")
    assert dict(tb_points(tmp_path / "tb/rank_0")) == log.expected
    assert "1 malformed" in out and "ends in an unfinished line" in out, out
