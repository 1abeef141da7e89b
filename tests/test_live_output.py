"""Live daemon: the output directory fills up or turns read-only.

The sidecar must exit non-zero with one error line and no traceback (never hang, never write a
checkpoint that claims events it failed to write), and once the space is freed or the directory
is writable again, a restart loses nothing and repeats nothing. The full disk is a tiny tmpfs;
the read-only directory is a read-only bind mount (root ignores permission bits). Both need
root and mount(8) and are skipped without them.
"""

from __future__ import annotations

import time

import pytest

from live_helpers import LiveEnv, SteadyWriter, mount, umount, wait_until

pytest_plugins = ["live_helpers"]


def _assert_one_line_failure(sidecar, rc: int) -> None:
    text = sidecar.stderr()
    errors = [line for line in text.splitlines() if "ERROR" in line]
    assert rc == 1, text
    assert "Traceback" not in text, text
    assert len(errors) == 1, text


def test_disk_full_exits_1_and_a_restart_after_freeing_space_loses_nothing(live: LiveEnv) -> None:
    live.out.mkdir()
    mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(live.out))
    try:
        logs = [live.info_log(r) for r in range(3)]
        sidecar = live.sidecar().start()
        with SteadyWriter(logs, rate=100):
            rc = wait_until(lambda: sidecar.proc.poll(), 30, "the sidecar to give up on the full disk")
        _assert_one_line_failure(sidecar, rc)
        assert "disk is full" in sidecar.stderr()
        for log in logs:
            log.step(10)
        mount("-o", "remount,size=8m", str(live.out))
        sidecar.start()
        live.finish(sidecar, logs)
    finally:
        umount(live.out)


def test_read_only_output_exits_1_and_a_restart_after_the_fix_loses_nothing(live: LiveEnv) -> None:
    """rank_1's run directory is read-only; rank_0's is fine: the sidecar stops as a whole."""
    ro = live.out / "rank_1"
    ro.mkdir(parents=True)
    mount("--bind", str(ro), str(ro))
    try:
        mount("-o", "remount,bind,ro", str(ro))
        logs = [live.info_log(0), live.info_log(1)]
        for log in logs:
            log.step(20)
        sidecar = live.sidecar()
        sidecar.start(wait_ready=False)
        rc = sidecar.wait_exit(20)
        _assert_one_line_failure(sidecar, rc)
        assert "read-only" in sidecar.stderr()
        for log in logs:
            log.step(10)
    finally:
        umount(ro)
    sidecar.start()
    live.finish(sidecar, logs)


@pytest.mark.parametrize("wake_mode", ["poll"])
def test_unwritable_out_at_start_is_a_usage_error(live: LiveEnv) -> None:
    live.out.mkdir()
    mount("-t", "tmpfs", "-o", "size=16k,ro", "tmpfs", str(live.out))
    try:
        sidecar = live.sidecar()
        sidecar.start(wait_ready=False)
        started = time.monotonic()
        rc = sidecar.wait_exit(20)
        text = sidecar.stderr()
        assert rc == 2 and "Traceback" not in text and len(text.strip().splitlines()) == 1, text
        assert time.monotonic() - started < 10
    finally:
        umount(live.out)
