"""Live daemon: rename rotation, truncation, delete + recreate and late files lose nothing.

Each test writes real mindformers step records while it breaks the file underneath the running
``mstb-sidecar``, then checks every step of every rank is in the run exactly once, both in
TensorBoard's own view (``EventAccumulator``) and raw in the event files. Every test runs with
inotify wake-ups and in polling mode (``--poll``).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from logging.handlers import RotatingFileHandler

import pytest

from pathlib import Path

from live_helpers import LiveEnv, RankLog, Sidecar, all_written, paced, tb_points, wait_until
from outputs import assert_same_outputs, read_run
from sidecar.cli import main

pytest_plugins = ["live_helpers"]

REAL_DP2 = Path(__file__).parent / "fixtures" / "real" / "mf1.9-dp2" / "output"


def test_rename_rotation_while_the_writer_keeps_its_fd(live: LiveEnv) -> None:
    """info.log -> info.log.1 while the trainer still appends to the renamed file for a while."""
    log = live.info_log(0)
    log.step(20)
    sidecar = live.sidecar().start()
    log.step(10)
    log.shift()  # renamed; the writer has not reopened yet
    for _ in paced(range(6), 0.05):
        log.step(5)
    log.reopen()
    log.step(20)
    live.finish(sidecar, [log])


def test_rotated_name_outside_the_glob_is_still_drained(live: LiveEnv) -> None:
    """A file renamed to a name discovery does not match is read to its end through the fd."""
    log = live.info_log(0)
    log.step(10)
    sidecar = live.sidecar().start()
    log.step(10)
    os.replace(log.path, log.path.with_name("info.log.old"))
    log.step(30)  # still into the renamed file
    log.reopen()
    log.step(20)
    live.finish(sidecar, [log])


def test_rapid_rotations_within_one_poll_interval(live: LiveEnv) -> None:
    """Five RotatingFileHandler rollovers in well under 250 ms, steps written in between."""
    logs = [live.info_log(0), live.info_log(1)]
    for log in logs:
        log.step(10)
    sidecar = live.sidecar().start()
    for _ in range(5):
        for log in logs:
            log.step(15)
        logs[0].rotate()
    logs[0].step(15)
    live.finish(sidecar, logs)


def test_rotations_while_the_sidecar_is_down(live: LiveEnv) -> None:
    """Killed, then three rollovers happen before it comes back: the rest of each renamed
    file is read from where it stopped, the rest from the start, nothing twice."""
    log = live.info_log(0)
    log.step(30)
    sidecar = live.sidecar().start()
    wait_until(lambda: all_written(live.out, [log]), 10, "the first steps")
    log.step(5)
    sidecar.kill()
    for _ in range(3):
        log.step(20)
        log.rotate()
    log.step(10)
    sidecar.start()
    live.finish(sidecar, [log])


def test_truncation_in_place(live: LiveEnv) -> None:
    """msrun truncates worker_N.log; the same O_APPEND writer goes on from byte 0."""
    log = live.worker_log(0)
    log.step(30)
    sidecar = live.sidecar().start()
    wait_until(lambda: all_written(live.out, [log]), 10, "the first steps")
    log.truncate()
    log.step(10)
    live.finish(sidecar, [log])


@pytest.mark.parametrize("restarted", [False, True], ids=["running", "restarted"])
def test_truncation_regrown_past_the_offset_before_the_next_look(live: LiveEnv, restarted: bool) -> None:
    """Truncated and refilled beyond the old size while the sidecar is stalled (SIGSTOP):
    size < offset never shows, so only the content check can catch it. Every record has the
    same length, so the bytes just before the old offset are the same as before too. Also
    right after a restart, before the restored offset was ever read from."""
    log = live.worker_log(0)
    log.next_step = 10  # two-digit steps and losses: records of one length
    log.step(20)
    sidecar = live.sidecar().start()
    wait_until(lambda: all_written(live.out, [log]), 10, "the first steps")
    if restarted:
        assert sidecar.stop()[0] == 0
        sidecar.start()
        sidecar.caught_up()  # it has read from the restored offset
    old_size = log.path.stat().st_size
    sidecar.proc.send_signal(signal.SIGSTOP)
    try:
        log.truncate()
        while log.path.stat().st_size <= old_size + 500:
            log.step()
    finally:
        sidecar.proc.send_signal(signal.SIGCONT)
    log.step(5)
    live.finish(sidecar, [log])


def test_truncation_regrown_while_the_sidecar_is_down(live: LiveEnv) -> None:
    """Offline truncate + regrowth past the checkpointed offset (the Promtail blind spot)."""
    log = live.worker_log(0)
    log.step(20)
    sidecar = live.sidecar().start()
    wait_until(lambda: all_written(live.out, [log]), 10, "the first steps")
    size = log.path.stat().st_size
    rc, _ = sidecar.stop()
    assert rc == 0
    log.truncate()
    while log.path.stat().st_size <= size + 500:
        log.step()
    sidecar.start()
    live.finish(sidecar, [log])


def test_delete_and_recreate(live: LiveEnv) -> None:
    """The file is deleted (its unread rest is still drained) and a new one takes its path."""
    log = live.info_log(0)
    log.step(20)
    sidecar = live.sidecar().start()
    log.step(10)
    log.delete_and_recreate()
    log.step(20)
    wait_until(lambda: all_written(live.out, [log]), 10, "the steps after the recreate")
    rc, _ = sidecar.stop()
    assert rc == 0
    log.delete_and_recreate()  # again while down: the inode may be reused
    log.step(10)
    sidecar.start()
    live.finish(sidecar, [log])


def test_late_rank_directories(live: LiveEnv) -> None:
    """Rank directories created after start are found and read from byte 0 within 2 s."""
    sidecar = live.sidecar().start()
    logs = []
    for rank in (1, 2):
        sidecar.idle()  # the directory comes to a loop that waits
        log = live.info_log(rank)
        log.step(10)
        created = time.monotonic()
        wait_until(lambda: all_written(live.out, [log]), 5, f"rank {rank}'s steps")
        assert time.monotonic() - created < 2.0
        logs.append(log)
    logs[0].step(10)
    live.finish(sidecar, logs)


def split_by_rotations(log: RankLog, times: int) -> list[int]:
    """Write ``times`` records whose head and bar a rollover separates; returns their steps."""
    split = []
    for _ in range(times):
        split.append(log.next_step)
        record = log.take()
        head_end = record.index(b"\n") + 1
        log.write(record[:head_end])
        log.rotate()
        log.write(record[head_end:])
        log.step(10)
    return split


def assert_whole_records(run_dir: Path, steps: list[int]) -> None:
    """The records split by a rollover keep their bar's throughput (the chain is one stream)."""
    throughput = dict(tb_points(run_dir, "throughput"))
    assert all(abs(throughput.get(step, 0) - 0.86313) < 1e-6 for step in steps), throughput


def test_rotation_between_a_head_and_its_bar(live: LiveEnv) -> None:
    """The head and the bar are two log records, so a rollover can fall between them; the
    held head in the renamed file must not be judged after the new file's next steps, and
    the bar at the start of the new file completes it."""
    log = live.info_log(0)
    log.step(10)
    sidecar = live.sidecar().start()
    split = split_by_rotations(log, 3)
    live.finish(sidecar, [log])
    assert_whole_records(live.out / "rank_0", split)


def test_replay_of_a_rotation_between_a_head_and_its_bar(tmp_path: Path) -> None:
    log = RankLog(tmp_path / "output/log/rank_0/info.log", 0)
    log.step(10)
    split = split_by_rotations(log, 3)
    assert main(["replay", str(tmp_path / "output"), "--out", str(tmp_path / "tb"), "--quiet"]) == 0
    assert dict(tb_points(tmp_path / "tb/rank_0")) == log.expected
    assert_whole_records(tmp_path / "tb/rank_0", split)


def test_a_deleted_file_ending_in_a_partial_line_does_not_block_the_new_one(live: LiveEnv) -> None:
    """The trainer died mid-line; the directory is cleaned and a new job writes the same path."""
    log = live.info_log(0)
    log.step(10)
    sidecar = live.sidecar().start()
    log.write(b"[INFO] 2026-11-29 10:00:00,000 [x.py:1] f: cut short by a crash")
    wait_until(lambda: all_written(live.out, [log]), 10, "the first steps")
    log.delete_and_recreate()
    log.step(10)
    live.finish(sidecar, [log])


class HandlerLog:
    """A trainer logging through :class:`logging.handlers.RotatingFileHandler` (``backupCount=5``),
    one log record per line, ``log``'s step records; it rolls over when the test says
    (``doRollover``, as ``maxBytes`` would), between a head and its bar if asked."""

    def __init__(self, log: RankLog) -> None:
        log.close()  # the handler opens the file itself
        self.log = log
        self.handler = RotatingFileHandler(log.path, backupCount=5)
        self.handler.setFormatter(logging.Formatter("%(message)s"))
        self.logger = logging.Logger(f"trainer-{log.rank}")  # not the global registry's
        self.logger.addHandler(self.handler)
        self.rollovers = 0
        self.file_of: dict[int, int] = {}  # step -> rollovers before its head was written

    def step(self, count: int = 1) -> None:
        for _ in range(count):
            self._lines(self.log.take().decode().splitlines())

    def step_across_a_rollover(self) -> None:
        """A record whose head goes to the live file before a rollover and its bar after it."""
        head, bar = self.log.take().decode().splitlines()
        self._lines([head])
        self.rollover()
        self._lines([bar])

    def rollover(self) -> None:
        self.handler.doRollover()
        self.rollovers += 1

    def _lines(self, lines: list[str]) -> None:
        for line in lines:
            if "loss:" in line:
                self.file_of[self.log.next_step - 1] = self.rollovers
            self.logger.info(line)

    def lose(self, file: int) -> list[int]:
        """Steps whose head went to the ``file``-th file (deleted unread): not expected any more."""
        steps = [step for step, at in self.file_of.items() if at == file]
        for step in steps:
            del self.log.expected[step]
            self.log.history.remove(step)
        return steps

    def close(self) -> None:
        self.handler.close()


def rollovers_while_stopped(sidecar: Sidecar, log: HandlerLog, rollovers: int) -> int:
    """SIGSTOP the sidecar (caught up), write on and roll over ``rollovers`` times, SIGCONT.
    The live file it followed has an unread rest; one record of each new file is split by the
    next rollover. Returns the rollovers done before the stop."""
    sidecar.proc.send_signal(signal.SIGSTOP)
    before = log.rollovers
    try:
        log.step(7)
        for _ in range(rollovers):
            log.step(12)
            log.step_across_a_rollover()
        log.step(5)
    finally:
        sidecar.proc.send_signal(signal.SIGCONT)
    return before


@pytest.mark.parametrize("rollovers", [1, 3, 5, 6])
def test_rollovers_while_the_sidecar_is_stopped(live: LiveEnv, rollovers: int) -> None:
    """Stopped (SIGSTOP: a busy node, swap) across rollovers of a RotatingFileHandler: the rest
    of the file it followed, then the backups made meanwhile, oldest first, then the live file;
    no resume, nothing counted. Six rollovers delete the followed file itself (as five do when
    the sidecar had not looked since the one before): it is read to its end through the open
    descriptor, before the five files that came after it."""
    log = HandlerLog(live.info_log(0))
    log.step(20)
    sidecar = live.sidecar().start()
    log.rollover()
    log.step(20)
    wait_until(lambda: all_written(live.out, [log.log]), 10, "the first steps")
    rollovers_while_stopped(sidecar, log, rollovers)
    log.step(10)
    live.finish(sidecar, [log.log])
    log.close()
    err = sidecar.stderr()
    assert "went back" not in err and "not written" not in err, err


def test_more_rollovers_while_stopped_than_backups_kept(live: LiveEnv) -> None:
    """Seven rollovers while stopped: the writer deleted the first file made meanwhile before
    anything read it. The sidecar says which steps are lost and counts them; it invents no
    resume, and every other step is there exactly once."""
    log = HandlerLog(live.info_log(0))
    log.step(20)
    sidecar = live.sidecar().start()
    wait_until(lambda: all_written(live.out, [log.log]), 10, "the first steps")
    before = rollovers_while_stopped(sidecar, log, 7)
    lost = log.lose(before + 1)
    log.step(10)
    live.finish(sidecar, [log.log])
    log.close()
    err = sidecar.stderr()
    assert "went back" not in err, err
    assert f"rank 0: steps {lost[0]}-{lost[-1]} are lost" in err, err
    assert f"not written: {len(lost)} deleted-unread" in err, err


def test_a_copytruncate_copy_read_after_a_restart_writes_no_event_again(tmp_path: Path) -> None:
    """A replay reads the genuine log; logrotate's copytruncate copies it to ``info.log.1`` and the
    job logs on into the emptied ``info.log``; a second replay (a restart from the checkpoint)
    finds the copy holding what was read of ``info.log`` and reads it on from there. Read from its
    start, its start-up events (``events/compile``, ``events/training-start``) would come before any
    step of the copy, at the last step the stream read: the output is one replay's of the whole log."""
    genuine = (REAL_DP2 / "log" / "rank_0" / "info.log").read_bytes().splitlines(keepends=True)
    first = next(i for i, line in enumerate(genuine) if b"print_output_info: { Epoch" in line)
    before, after = b"".join(genuine[:first + 10]), b"".join(genuine[first + 10:first + 16])
    log = tmp_path / "output" / "log" / "rank_0" / "info.log"
    log.parent.mkdir(parents=True)
    log.write_bytes(before)
    out = tmp_path / "tb"
    replay = ["replay", str(tmp_path / "output"), "--quiet", "--no-aggregate", "--out"]
    assert main([*replay, str(out)]) == 0
    shutil.copyfile(log, log.with_name("info.log.1"))
    with open(log, "r+b") as fh:
        fh.truncate(0)
        fh.write(after)
    assert main([*replay, str(out)]) == 0
    whole = tmp_path / "whole" / "log" / "rank_0" / "info.log"
    whole.parent.mkdir(parents=True)
    whole.write_bytes(before + after)
    assert main(["replay", str(tmp_path / "whole"), "--quiet", "--no-aggregate", "--out", str(tmp_path / "tb-whole")]) == 0
    shown = read_run(out / "rank_0").texts
    assert list(shown["events/compile"]) == [0] and list(shown["events/training-start"]) == [0]
    assert_same_outputs(tmp_path / "tb-whole", out)
