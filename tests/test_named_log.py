"""A log file named on the command line (``--watch output/log/rank_0/info.log``) and rotated
while the sidecar is down: its backups are found too, so the file it was following is picked up
under its new name (``info.log.1``) and its unread rest is read, then the new ``info.log``."""

from __future__ import annotations

import subprocess

import pytest

from live_helpers import BIN, LiveEnv, all_written, assert_exactly_once, wait_until

pytest_plugins = ["live_helpers"]


@pytest.mark.parametrize("wake_mode", ["inotify"])
def test_watching_a_named_file_rotated_while_down(live: LiveEnv) -> None:
    log = live.info_log(0)
    sidecar = live.sidecar()
    sidecar.watch = [log.path]
    sidecar.start()
    log.step(20)
    wait_until(lambda: all_written(live.out, [log]), 15, "the first 20 steps")
    assert sidecar.stop()[0] == 0
    log.step(5)  # unread when it is renamed away
    log.rotate()
    log.step(25)
    live.finish(sidecar.start(), [log])


@pytest.mark.parametrize("wake_mode", ["poll"])
def test_replaying_a_named_file_after_it_rotated(live: LiveEnv) -> None:
    log = live.info_log(0)
    log.step(20)
    cmd = [str(BIN), "replay", str(log.path), "--out", str(live.out), "--instance", "test"]
    assert subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    log.step(5)
    log.rotate()
    log.step(25)
    assert subprocess.run(cmd, capture_output=True, timeout=60).returncode == 0
    assert_exactly_once(live.out, [log])
