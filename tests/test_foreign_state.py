"""A checkpoint must prove it belongs to these logs and these runs (issue 9, item 10).

A state file copied from another job's ``--out``, or an ``--out`` reused for a new job, used to
make every new step be dropped: the checkpoint claimed steps the runs did not hold. Now a
state whose runs are not on disk is re-derived with a warning, and a reused ``--out`` shows the
new job (it supersedes the old one's points from its first step on, as a new job in the same
place does).
"""

from __future__ import annotations

import shutil
from datetime import datetime
from pathlib import Path

from live_helpers import LiveEnv, RankLog, all_written, tb_points, wait_until
from test_clock_and_order import replay

pytest_plugins = ["live_helpers"]

STATE = Path(".mstb-sidecar/state-test.json")


def job(root: Path, steps: int, segment: int, start: datetime) -> RankLog:
    log = RankLog(root / "output/log/rank_0/info.log", 0, start=start)
    log.segment = segment  # a different job: different values
    log.step(steps)
    return log


def test_replay_with_a_state_file_copied_from_another_job(tmp_path: Path) -> None:
    old = job(tmp_path / "a", 500, 0, datetime(2026, 11, 1))
    replay([tmp_path / "a/output"], tmp_path / "a/tb")
    assert len(tb_points(tmp_path / "a/tb/rank_0")) == 500
    new = job(tmp_path / "b", 200, 1, datetime(2026, 10, 1))  # an earlier clock, fewer steps
    (tmp_path / "b/tb" / STATE).parent.mkdir(parents=True)
    shutil.copy(tmp_path / "a/tb" / STATE, tmp_path / "b/tb" / STATE)
    out = replay([tmp_path / "b/output"], tmp_path / "b/tb")
    assert dict(tb_points(tmp_path / "b/tb/rank_0")) == new.expected
    assert "the checkpoint does not match the runs" in out
    assert old.expected != new.expected


def test_replay_into_an_out_reused_for_a_new_job(tmp_path: Path) -> None:
    job(tmp_path / "a", 500, 0, datetime(2026, 11, 1))
    replay([tmp_path / "a/output"], tmp_path / "tb")
    new = job(tmp_path / "b", 200, 1, datetime(2026, 10, 1))
    replay([tmp_path / "b/output"], tmp_path / "tb")
    assert dict(tb_points(tmp_path / "tb/rank_0")) == new.expected


def test_live_with_a_state_file_copied_from_another_job(live: LiveEnv, tmp_path: Path) -> None:
    job(tmp_path / "a", 300, 0, datetime(2026, 11, 1))
    replay([tmp_path / "a/output"], tmp_path / "a/tb")
    live.state_file().parent.mkdir(parents=True)
    shutil.copy(tmp_path / "a/tb" / STATE, live.state_file())
    log = RankLog(live.output / "log/rank_0/info.log", 0, start=datetime(2026, 10, 1))  # an earlier clock
    log.step(20)
    sidecar = live.sidecar().start()
    wait_until(lambda: all_written(live.out, [log]), 10, "the first steps")
    log.step(20)
    live.finish(sidecar, [log])
