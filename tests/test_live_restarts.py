"""Live daemon: SIGTERM, SIGKILL loops, corrupt or missing state, SIGHUP.

After any stop the restarted sidecar resumes where it stopped: every step of every rank is in
TensorBoard's view exactly once and no step is in the event files twice (the run writers recover
their watermarks from the event files, so re-reading after a kill writes nothing again).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

from live_helpers import LiveEnv, RankLog, SteadyWriter, all_written, checkpointed, raw_run, wait_until

pytest_plugins = ["live_helpers"]

KILLS = int(os.environ.get("MSTB_LIVE_KILLS", "6"))


def _written(live: LiveEnv, logs: list[RankLog]) -> int:
    return sum(len(raw_run(live.out / f"rank_{log.rank}").points) for log in logs)


def _streaming(live: LiveEnv, logs: list[RankLog], steps: int) -> None:
    """Until the sidecar wrote ``steps`` more steps of every log than now, while they are written."""
    now = _written(live, logs)
    wait_until(lambda: _written(live, logs) >= now + steps * len(logs), 15, f"{steps} more steps of each rank")


def _writes_on(logs: list[RankLog], steps: int) -> None:
    """Until the writer wrote ``steps`` more steps (the sidecar down meanwhile)."""
    now = logs[0].next_step
    wait_until(lambda: logs[0].next_step >= now + steps, 15, f"the writer's next {steps} steps")


def test_sigterm_mid_stream_exits_0_quickly_and_resumes(live: LiveEnv) -> None:
    """SIGTERM, then SIGINT, while three ranks write: exit 0 fast, then resume seamlessly."""
    logs = [live.info_log(r) for r in range(3)]
    sidecar = live.sidecar().start()
    times = []
    with SteadyWriter(logs, rate=50):
        for sig in (signal.SIGTERM, signal.SIGINT):
            _streaming(live, logs, 25)
            rc, took = sidecar.stop(sig)
            assert rc == 0, sidecar.stderr()
            times.append(took)
            _writes_on(logs, 15)
            sidecar.start()
        _streaming(live, logs, 25)
    times.append(live.finish(sidecar, logs))
    print(f"\nSIGTERM exit times ({live.mode}): {', '.join(f'{t:.2f}s' for t in times)}")
    assert max(times) < 5.0


def test_sigkill_loop(live: LiveEnv) -> None:
    """Random SIGKILLs while three ranks write and one rotates: no gap, no duplicate, and the
    state file is whole after every kill (written by rename, never torn)."""
    rng = random.Random(1234)
    logs = [live.info_log(r) for r in range(3)]
    sidecar = live.sidecar()
    with SteadyWriter(logs, rate=40, rotate_every=1.5):
        for _ in range(KILLS):
            sidecar.start()
            _writes_on(logs, rng.randint(4, 48))  # killed 0.1-1.2 s into its run, by the writer's pace
            sidecar.kill()
            if live.state_file().exists():
                json.loads(live.state_file().read_text())
        sidecar.start()
        _streaming(live, logs, 20)
    live.finish(sidecar, logs)
    warned = [line for line in sidecar.stderr(all_runs=True).splitlines() if "WARNING" in line]
    # The loss code (rank * 100000 + step) makes the ranks "diverge": that alert is right; nothing else warns.
    assert all(": ALERT divergence: " in line or ": RESOLVED divergence: " in line for line in warned), warned


def _negate(state: dict) -> dict:
    for entry in state["files"]:
        entry["offset"] = -entry["offset"] - 1
    return state


_CORRUPTIONS = {
    "garbage": lambda text: b"this is {not json",
    "invalid-utf8": lambda text: b"\x8f\xff\xfe\x00\xc3\x28" * 50,
    "torn": lambda text: text[: len(text) // 2].encode(),
    "empty": lambda text: b"",
    "nul-filled": lambda text: b"\x00" * len(text),
    "wrong-schema": lambda text: b'{"version": 1, "files": [{"path": 3}], "ranks": []}',
    "negative-offsets": lambda text: json.dumps(_negate(json.loads(text))).encode(),
    "other-version": lambda text: json.dumps({**json.loads(text), "version": 99}).encode(),
}


@pytest.mark.parametrize("wake_mode", ["poll"])
@pytest.mark.parametrize("corruption", [*_CORRUPTIONS, "missing"])
def test_corrupt_or_missing_state_is_a_warning_and_a_safe_fallback(live: LiveEnv, corruption: str) -> None:
    logs = [live.info_log(0), live.worker_log(1)]
    for log in logs:
        log.step(30)
    sidecar = live.sidecar().start()
    wait_until(lambda: all_written(live.out, logs), 10, "the first steps")
    rc, _ = sidecar.stop()
    assert rc == 0
    state = live.state_file()
    text = state.read_text()
    if corruption == "missing":
        state.unlink()
    else:
        state.write_bytes(_CORRUPTIONS[corruption](text))
    for log in logs:
        log.step(10)
    sidecar.start()
    wait_until(lambda: all_written(live.out, logs), 10, "the steps after the restart")
    assert sidecar.running(), sidecar.stderr()
    if corruption != "missing":
        assert "WARNING" in sidecar.stderr(), sidecar.stderr()
    for log in logs:
        log.step(5)
    live.finish(sidecar, logs)


def test_sighup_rescans_now_and_keeps_following(live: LiveEnv) -> None:
    """With a 10-minute rescan interval only SIGHUP can find a new rank directory; a file
    renamed out of discovery while still written keeps being read through the SIGHUP."""
    log = live.info_log(0)
    log.step(10)
    sidecar = live.sidecar("--rescan-interval", "600").start()
    wait_until(lambda: all_written(live.out, [log]), 10, "the first steps")
    os.replace(log.path, log.path.with_name("info.log.old"))
    log.step(5)
    late = live.info_log(4)
    late.step(10)
    sidecar.caught_up()
    sidecar.proc.send_signal(signal.SIGHUP)
    sent = time.monotonic()
    wait_until(lambda: all_written(live.out, [late]), 5, "the new rank after SIGHUP")
    assert time.monotonic() - sent < 2.0
    log.step(5)  # still into the renamed file
    log.reopen()
    log.step(5)
    late.step(5)
    live.finish(sidecar, [log, late])


def test_sigkill_long_after_the_last_checkpoint(live: LiveEnv) -> None:
    """Everything since the one checkpoint is re-read after the kill; none of it is written
    twice, because the run writers take their watermarks from the event files themselves."""
    logs = [live.info_log(0), live.worker_log(1)]
    sidecar = live.sidecar("--checkpoint-interval", "600").start()
    for _ in range(3):
        for log in logs:
            log.step(40)
        wait_until(lambda: all_written(live.out, logs), 10, "the steps so far")
        sidecar.kill()
        sidecar.start()
    for log in logs:
        log.step(5)
    live.finish(sidecar, logs)


@pytest.mark.parametrize("wake_mode", ["inotify"])
def test_steps_read_soon_after_a_checkpoint_are_checkpointed_when_the_next_is_due(live: LiveEnv) -> None:
    """With file events an idle loop sleeps until an event or the 10 s reconcile. Steps read
    within --checkpoint-interval of the last checkpoint are saved when the next one is due, not
    at the reconcile (before, they waited for it: a SIGKILL meanwhile re-read 10 s of log, and an
    idle sidecar's costliest round, a checkpoint of every run, came 10 s after its last read)."""
    log = live.info_log(0)
    log.step(5)
    sidecar = live.sidecar("--checkpoint-interval", "1").start()
    wait_until(lambda: checkpointed(live.state_file(), [log.path]), 10, "the first checkpoint")
    log.step(5)  # read at once, within the interval
    wait_until(lambda: all_written(live.out, [log]), 5, "the steps after it")
    # due 1 s after the last checkpoint; the reconcile comes 10 s after the read
    wait_until(lambda: checkpointed(live.state_file(), [log.path]), 5, "their checkpoint")
    live.finish(sidecar, [log])


def test_a_storm_of_signals_neither_hangs_nor_kills_it(live: LiveEnv) -> None:
    """Thousands of SIGHUPs a second: the sidecar keeps working and SIGTERM still exits 0.
    (A handler that woke the loop with Event.set() deadlocked on the event's lock, after which
    even SIGTERM was ignored, or recursed until the process died of a SIGHUP.)"""
    log = live.info_log(0)
    log.step(5)
    sidecar = live.sidecar().start()
    rng = random.Random(7)
    until = time.monotonic() + 1.5
    while time.monotonic() < until:
        sidecar.proc.send_signal(signal.SIGHUP)
        time.sleep(rng.uniform(0, 0.002))
    assert sidecar.running(), sidecar.stderr()
    log.step(5)
    live.finish(sidecar, [log], timeout=10)


@pytest.mark.parametrize("wake_mode", ["poll"])
def test_sigterm_cuts_a_long_poll_wait_short(live: LiveEnv) -> None:
    """With a 30 s poll interval the loop sleeps long; SIGTERM must still end it at once."""
    log = live.info_log(0)
    log.step(5)
    sidecar = live.sidecar("--poll-interval", "30").start()
    wait_until(lambda: all_written(live.out, [log]), 10, "the first steps")
    sidecar.idle()  # in its 30 s wait
    rc, took = sidecar.stop()
    assert rc == 0 and took < 2.0, (rc, took, sidecar.stderr())
