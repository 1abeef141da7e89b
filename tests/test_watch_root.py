"""Live daemon: the watched directory itself is deleted and re-created (a new job in the same place).

``rm -rf output/log && mkdir -p output/log/rank_0`` and a new ``info.log`` (or the same with the
watched directory's parent): the new job's steps must reach TensorBoard within 2 s, not at the
next 60 s rescan. With inotify the watch dies with its directory; the sidecar watches the
nearest existing ancestor meanwhile, so the re-creation is itself an event. The new job starts
again at step 1, which supersedes the old job's points (a resume): TensorBoard shows the new
job's values only.
"""

from __future__ import annotations

import shutil
import time
from datetime import timedelta

import pytest

from live_helpers import LiveEnv, RankLog, Sidecar, all_written, raw_run, tb_points, wait_until

pytest_plugins = ["live_helpers"]


@pytest.mark.parametrize(("removed", "seen"), [("log", True), ("output", False)])
def test_watched_directory_deleted_and_recreated_by_a_new_job(live: LiveEnv, removed: str, seen: bool) -> None:
    watched = live.output / "log"
    sidecar = Sidecar([watched], live.out, live.mode, live.root)
    live.sidecars.append(sidecar)
    old = live.info_log(0)
    old.step(30)
    sidecar.start()
    wait_until(lambda: all_written(live.out, [old]), 10, "the old job's steps")
    old.close()
    shutil.rmtree(watched if removed == "log" else live.output)
    if seen:  # the sidecar has seen the directory go; else it is re-created at once
        sidecar.caught_up()
    new = RankLog(watched / "rank_0" / "info.log", 0, start=old.clock + timedelta(hours=1))
    new.segment = 1  # other values than the old job's at the same steps
    new.step(5)
    written = time.monotonic()
    run = live.out / "rank_0"
    wait_until(lambda: (1, new.expected[1]) in raw_run(run).points, 10, "the new job's first step")
    latency = time.monotonic() - written
    print(f"{live.mode}, {removed} re-created: new steps in the event file after {latency * 1000:.0f} ms")
    assert latency < 2.0
    new.step(15)
    wait_until(lambda: all_written(live.out, [new]), 10, "the new job's steps")
    assert tb_points(run) == sorted(new.expected.items())  # the old job's points are superseded
    rc, _ = sidecar.stop()
    assert rc == 0, sidecar.stderr()
    assert "Traceback" not in sidecar.stderr()
