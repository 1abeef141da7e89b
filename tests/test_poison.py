"""Poison lines: numbers that do not fit must never end the sidecar.

A step or epoch beyond int64 (TensorBoard's step type), a 5000-digit step and a head whose
global step overflows sit between good steps; each is skipped as malformed, and every good step
before and after it is in TensorBoard, in replay, live, and after restarts that read through
the poison again. A loss of ``1e400`` is ``+inf`` at its step (a real non-finite value).
"""

from __future__ import annotations

import math
import subprocess

import pytest

from live_helpers import BIN, LiveEnv, RankLog, all_written, assert_exactly_once, wait_until

pytest_plugins = ["live_helpers"]

_CALLBACK = "[mindformers/core/callback/callback.py:318] print_output_info:"
_BAR = "  5.2% |██                                                | 0.86313 samples/s/p  2:26:41 }"
POISON_HEADS = [
    "{ Epoch:[  1/  1], step:[99999999999999999999999/100000], loss: 1.0, per_step_time: 512ms",
    "{ Epoch:[99999999999999999999999/  1], step:[    5/100000], loss: 1.0, per_step_time: 512ms",
    "{ Epoch:[  1/  1], step:[" + "9" * 5000 + "/100000], loss: 1.0, per_step_time: 512ms",
    f"{{ Epoch:[{1 << 62}/  2], step:[    1/    4], loss: 1.0, per_step_time: 512ms",
]


def _line(log: RankLog, text: str) -> bytes:
    return f"[INFO] {log._stamp()} {_CALLBACK} {text}\n".encode()


def write_poison(log: RankLog) -> None:
    """Every poison head, each with its progress bar, as mindformers would print them."""
    log.write(b"".join(_line(log, head) + _line(log, _BAR) for head in POISON_HEADS))


def write_infinite_step(log: RankLog) -> None:
    """The next step with a loss of 1e400: Python reads it as +inf, and so must TensorBoard."""
    step = log.next_step
    log.write(_line(log, f"{{ Epoch:[  1/  1], step:[{step:5d}/100000], loss: 1e400, per_step_time: 512ms")
              + _line(log, _BAR))
    log.expected[step] = math.inf
    log.history.append(step)
    log.next_step += 1


def poisoned_log(live: LiveEnv) -> RankLog:
    log = live.info_log(0)
    log.step(10)
    write_poison(log)
    write_infinite_step(log)
    log.step(9)
    return log


def replay(live: LiveEnv) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN), "replay", str(live.output), "--out", str(live.out), "--instance", "test"],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("wake_mode", ["poll"])
def test_replay_skips_poison_lines_and_keeps_every_good_step(live: LiveEnv) -> None:
    log = poisoned_log(live)
    for _ in range(2):  # the second replay reads through the same lines again (nothing new)
        done = replay(live)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
        assert_exactly_once(live.out, [log])
    live.state_file().unlink()  # a start from scratch re-reads the poison: still nothing twice
    assert replay(live).returncode == 0
    assert_exactly_once(live.out, [log])


@pytest.mark.parametrize("wake_mode", ["inotify"])
def test_live_sidecar_goes_past_poison_lines_and_restarts_past_them(live: LiveEnv) -> None:
    log = live.info_log(0)
    sidecar = live.sidecar().start()
    log.step(10)
    write_poison(log)
    write_infinite_step(log)
    log.step(9)
    wait_until(lambda: all_written(live.out, [log]), 15, "the steps after the poison lines")
    assert sidecar.running()
    sidecar.kill()  # wherever the last checkpoint is, the restart may read the poison again
    log.step(10)
    sidecar.start()
    wait_until(lambda: all_written(live.out, [log]), 15, "the steps written while it was down")
    assert sidecar.stop()[0] == 0
    live.state_file().unlink()  # from scratch: reads through every poison line again
    write_poison(log)
    log.step(5)
    live.finish(sidecar.start(), [log])
