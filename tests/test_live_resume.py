"""Live daemon: training resumed from an earlier checkpoint (a rank's step goes backwards).

TensorBoard must show one curve without overlap or zig-zag: the points from the resume step on
are the new segment's, the older ones before it stay, and the resume is marked by a text event
(``events/resume``) at the resume step. Checked live, across a SIGKILL right after
the resume, with the resume happening while the sidecar is down, and for a new job that
truncates ``worker_N.log`` and starts again at step 1.
"""

from __future__ import annotations

import json
import os
import signal
from datetime import timedelta

import pytest

from live_helpers import (
    RESUME_TEXT_TAG,
    LiveEnv,
    RankLog,
    all_written,
    assert_exactly_once,
    raw_run,
    tb_text_steps,
    wait_until,
)

pytest_plugins = ["live_helpers"]


def _check(live: LiveEnv, logs: list[RankLog], resumes: dict[int, list[int]]) -> None:
    """Exactly-once view; one resume text per resume still visible (a later resume to an
    earlier step purges the marks after it); a raw START marker at each resume step."""
    assert_exactly_once(live.out, logs)
    for log in logs:
        run_dir = live.out / f"rank_{log.rank}"
        want = resumes.get(log.rank, [])
        visible = [s for i, s in enumerate(want) if all(s < later for later in want[i + 1 :])]
        shown = tb_text_steps(run_dir, RESUME_TEXT_TAG)
        assert shown == sorted(visible), f"rank {log.rank}: resume marks at {shown}, want {visible}"
        starts = raw_run(run_dir).starts
        assert set(want) <= set(starts), f"rank {log.rank}: START markers {starts}, want {want}"


def test_resume_live(live: LiveEnv) -> None:
    logs = [live.info_log(0), live.info_log(1)]
    for log in logs:
        log.step(40)
    sidecar = live.sidecar().start()
    wait_until(lambda: all_written(live.out, logs), 10, "the first segment")
    logs[0].go_back(25)
    logs[0].step(35)
    logs[1].step(20)
    live.finish(sidecar, logs)
    _check(live, logs, {0: [25]})


def test_resume_then_sigkill_then_a_second_resume(live: LiveEnv) -> None:
    log = live.info_log(0)
    log.step(50)
    sidecar = live.sidecar().start()
    wait_until(lambda: all_written(live.out, [log]), 10, "the first segment")
    log.go_back(30)
    log.step(5)
    wait_until(lambda: all_written(live.out, [log]), 10, "the resumed steps")  # probably not checkpointed yet
    sidecar.kill()
    log.step(20)
    sidecar.start()
    wait_until(lambda: all_written(live.out, [log]), 10, "the second segment")
    log.go_back(10)
    log.step(50)
    live.finish(sidecar, [log])
    _check(live, [log], {0: [30, 10]})


def test_resume_while_the_sidecar_is_down(live: LiveEnv) -> None:
    log = live.info_log(0)
    log.step(40)
    sidecar = live.sidecar().start()
    wait_until(lambda: all_written(live.out, [log]), 10, "the first segment")
    rc, _ = sidecar.stop()
    assert rc == 0
    log.go_back(20)
    log.step(30)
    sidecar.start()
    live.finish(sidecar, [log])
    _check(live, [log], {0: [20]})


def test_new_job_truncates_the_worker_log_and_starts_over(live: LiveEnv) -> None:
    """msrun reuses --log_dir: worker_0.log is truncated and steps restart at 1."""
    log = live.worker_log(0)
    log.step(40)
    sidecar = live.sidecar().start()
    wait_until(lambda: all_written(live.out, [log]), 10, "the first job")
    log.truncate()
    log.go_back(1)
    log.step(15)
    live.finish(sidecar, [log])
    _check(live, [log], {0: [1]})


def test_sigkill_after_a_resume_that_no_checkpoint_saw(live: LiveEnv) -> None:
    """With a 10-minute checkpoint interval the kill lands far after the last checkpoint: the
    restart re-reads the old segment's tail and the resume. Those lines must not be written
    again (the run already holds them), and the old tail must not come back as new points."""
    log = live.info_log(0)
    log.step(10)
    sidecar = live.sidecar("--checkpoint-interval", "600").start()
    wait_until(lambda: all_written(live.out, [log]), 10, "the first steps")
    log.step(30)
    log.go_back(25)
    log.step(20)
    wait_until(lambda: all_written(live.out, [log]), 10, "the resumed segment")
    sidecar.kill()
    log.step(5)
    sidecar.start()
    live.finish(sidecar, [log])
    _check(live, [log], {0: [25]})


# Lines a job prints before its first step, alike in every launch (no date, no step): with them
# the first kilobyte of two jobs' logs is the same.
BANNER = "".join(f"  {key:<24} | {'-' * 40} | value of {key}\n" for key in
                 [f"parallel_config.option_{i}" for i in range(16)]).encode()


def _checkpointed(live: LiveEnv, path: os.PathLike[str]) -> bool:
    """Does the checkpoint say ``path`` was read to its end?"""
    try:
        files = json.loads(live.state_file().read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    return any(f["path"] == str(path) and f["offset"] == os.stat(path).st_size for f in files)


def _job_then_stop(live: LiveEnv, stop: signal.Signals, steps: int) -> tuple[RankLog, object]:
    """A job's banner and ``steps`` steps, read and checkpointed, then the sidecar stopped."""
    log = live.worker_log(0)
    log.write(BANNER)
    log.step(steps)
    sidecar = live.sidecar("--checkpoint-interval", "0.2").start()
    wait_until(lambda: all_written(live.out, [log]) and _checkpointed(live, log.path), 15, "job 1, checkpointed")
    sidecar.stop(stop)
    return log, sidecar


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_log_rewritten_in_place_while_down_is_a_new_job(live: LiveEnv, stop: signal.Signals) -> None:
    """``python train.py > train.log`` relaunched while the sidecar is down: the same inode, the
    same banner, records of the same width, more bytes than the checkpointed offset, and the
    bytes just before that offset (the end of a progress-bar line) the same in both jobs. The
    sidecar must see a new job, not continue inside it: job 2's values at every step, a warning."""
    log, sidecar = _job_then_stop(live, stop, 40)
    inode, old_size = os.stat(log.path).st_ino, os.stat(log.path).st_size
    os.close(log.fd)
    log.fd = os.open(log.path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)  # the shell's '>': same inode
    log.write(BANNER)
    log.go_back(1)
    log.jump_clock(timedelta(hours=1))  # job 2 starts later, with losses of the same width
    log.step(55)
    assert os.stat(log.path).st_ino == inode and os.stat(log.path).st_size > old_size
    sidecar.start()
    log.step(5)
    live.finish(sidecar, [log])
    _check(live, [log], {0: [1]})
    assert "was rewritten while the sidecar was not running" in sidecar.stderr(), sidecar.stderr()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_log_that_only_grew_while_down_goes_on_from_its_offset(live: LiveEnv, stop: signal.Signals) -> None:
    """The same job went on while the sidecar was down: nothing is read twice (no duplicate
    counted), and nothing is said about a rewrite."""
    log, sidecar = _job_then_stop(live, stop, 40)
    log.step(20)
    sidecar.start()
    log.step(5)
    live.finish(sidecar, [log])
    err = sidecar.stderr()
    assert "rewritten" not in err and "not written" not in err, err
