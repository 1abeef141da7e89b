"""A finished or crashed job is not a stall; a silent one is; all of it across SIGKILL + restart.

Real ``mstb-sidecar`` processes with a 1 s stall threshold on v1.9 logs of two ranks: rank 0
ends (``Training Over!``, a traceback), rank 1 simply stops writing. Rank 1's stall is the clock
for rank 0's silence: once rank 1 has been alerted and three thresholds have passed, rank 0 has
waited as long, so "no stall for rank 0" is a verdict, not a short wait. What the user sees is
read back: the console, ``--on-alert``'s JSON, ``/metrics`` over HTTP and the text events in
TensorBoard.
"""

from __future__ import annotations

import json
import math
import re
import signal
import sys
from pathlib import Path

import pytest

from live_helpers import LiveEnv, RankLog, free_port, metrics, scrape, wait_until
from tb_read import texts

pytest_plugins = ["live_helpers"]

STEPS = 20
OVER = ".........Training Over!............."
HOOK = """import json, sys
with open(sys.argv[1], "a") as fh:
    fh.write(json.dumps(json.load(sys.stdin)) + "\\n")
"""
TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "run_mindformer.py", line 281, in <module>',
    "    main(config)",
    "RuntimeError: Sync stream failed, device_id: 0",
]


def plateau(step: int) -> float:
    return 2.0 + 0.01 * (step % 5)


class Job:
    """Two ranks' ``info.log``, a sidecar with a 1 s stall threshold, its hook and its metrics."""

    def __init__(self, live: LiveEnv, tmp_path: Path, loss_of=plateau) -> None:
        self.live = live
        self.logs = [RankLog(live.output / "log" / f"rank_{r}" / "info.log", r, loss_of=loss_of) for r in (0, 1)]
        self.config = tmp_path / "alerts.yaml"
        self.config.write_text("alerts:\n  stall: {factor: 2, min-seconds: 1}\n")
        self.hook, self.sent = tmp_path / "hook.py", tmp_path / "sent.jsonl"
        self.hook.write_text(HOOK)
        self.port = free_port()
        self.sidecar = live.sidecar("--config", str(self.config), "--metrics-port", str(self.port), "--on-alert",
                                    f"{sys.executable} {self.hook} {self.sent}", *self.extra())

    def extra(self) -> list[str]:
        return []

    def steps(self, count: int) -> None:
        for log in self.logs:
            log.step(count)

    def hooked(self) -> list[tuple[str, str, int]]:
        lines = self.sent.read_text().splitlines() if self.sent.exists() else []
        return [(a["alert"], a["state"], a["rank"]) for a in map(json.loads, lines)]

    def rank1_stalled_three_thresholds(self) -> None:
        """Rank 1 (silent) is alerted, and three thresholds passed since its last step."""
        wait_until(lambda: "ALERT stall: rank 1" in self.sidecar.stderr(), 15, "rank 1's stall alert")
        wait_until(lambda: (scrape(self.port, "mstb_sidecar_training_seconds_since_step", rank="1") or 0) >= 3, 15,
                   "three thresholds after rank 1's last step")

    def state(self, rank: int) -> dict[str, float]:
        found = metrics(self.port)
        return {dict(labels)["state"]: value for (name, labels), value in found.items()
                if name == "mstb_sidecar_training_state" and dict(labels)["rank"] == str(rank)}

    def stall_active(self, rank: int) -> float:
        return scrape(self.port, "mstb_sidecar_alert_active", rank=str(rank), alert="stall") or 0.0


def _checkpointed(live: LiveEnv, check) -> bool:
    try:
        return bool(check(json.loads(live.state_file().read_text())))
    except (OSError, ValueError, KeyError, TypeError):
        return False


@pytest.mark.parametrize("wake_mode", ["inotify"])
@pytest.mark.parametrize("started", ["before the finish", "on an old finished log"])
def test_a_finished_job_is_not_stalled_and_a_silent_one_is(live: LiveEnv, tmp_path: Path, started: str) -> None:
    job = Job(live, tmp_path)
    if started == "before the finish":
        job.sidecar.start()
    job.steps(STEPS)
    job.logs[0].say(OVER)
    if started != "before the finish":
        job.sidecar.start()
    job.rank1_stalled_three_thresholds()
    err = job.sidecar.stderr()
    assert "ALERT stall: rank 0" not in err, err
    assert f"rank 0: training finished at step {STEPS}: Training Over!" in err
    assert job.hooked() == [("stall", "firing", 1)]
    assert job.stall_active(0) == 0 and job.stall_active(1) == 1
    assert job.state(0) == {"running": 0, "finished": 1, "failed": 0}
    assert job.state(1) == {"running": 1, "finished": 0, "failed": 0}
    job.sidecar.proc.send_signal(signal.SIGUSR1)  # the status line
    wait_until(lambda: re.search(r"status: .*last step 20 \(rank 0-1\), training finished \(rank 0\), lag 0 bytes",
                                 job.sidecar.stderr()), 10, "the status line")
    rc, _ = job.sidecar.stop()
    assert rc == 0 and "Traceback" not in job.sidecar.stderr()
    shown = texts(live.out / "rank_0")
    assert [tag for tag in shown if tag.startswith("events/lifecycle/")] == ["events/lifecycle/finished"]
    assert shown["events/lifecycle/finished"] == {STEPS: f"rank 0: training finished at step {STEPS}: Training Over!"}
    assert "alerts/stall" not in shown and list(texts(live.out / "rank_1")["alerts/stall"]) == [STEPS]


@pytest.mark.parametrize("wake_mode", ["inotify"])
def test_a_job_that_died_is_not_stalled_and_says_so_once(live: LiveEnv, tmp_path: Path) -> None:
    job = Job(live, tmp_path)
    job.sidecar.start()
    job.steps(STEPS)
    job.logs[0].say(TRACEBACK[0], "ERROR", "[mindformers/tools/cloud_adapter/cloud_monitor.py:43] wrapper:")
    job.logs[0].write("".join(line + "\n" for line in TRACEBACK[1:]).encode())
    job.rank1_stalled_three_thresholds()
    err = job.sidecar.stderr()
    assert "ALERT stall: rank 0" not in err, err
    assert len(re.findall(r"ALERT error: rank 0, step 20", err)) == 1, err  # the death is paged as an error
    assert len(re.findall(f"rank 0: training died at step {STEPS}", err)) == 1, err
    assert sorted(job.hooked()) == [("error", "firing", 0), ("stall", "firing", 1)]
    assert job.stall_active(0) == 0
    assert job.state(0) == {"running": 0, "finished": 0, "failed": 1}
    job.sidecar.stop()
    shown = texts(live.out / "rank_0")
    assert [tag for tag in shown if tag.startswith("events/lifecycle/")] == ["events/lifecycle/failed"]
    assert list(shown["events/lifecycle/failed"]) == [STEPS]
    assert shown["events/lifecycle/failed"][STEPS].startswith(f"rank 0: training died at step {STEPS}: Traceback")


@pytest.mark.parametrize("wake_mode", ["inotify"])
def test_a_job_that_runs_again_after_its_finish_can_stall_again(live: LiveEnv, tmp_path: Path) -> None:
    job = Job(live, tmp_path)
    job.sidecar.start()
    job.steps(STEPS)
    job.logs[0].say(OVER)
    job.rank1_stalled_three_thresholds()
    job.logs[0].say(".........Starting Training Model..........")  # a relaunch appends to the same file
    job.logs[0].step(5)
    wait_until(lambda: "ALERT stall: rank 0" in job.sidecar.stderr(), 15, "rank 0's stall once it runs again")
    assert f"rank 0: training is running again at step {STEPS} (it had finished)" in job.sidecar.stderr()
    assert job.state(0) == {"running": 1, "finished": 0, "failed": 0}
    job.sidecar.stop()
    shown = texts(live.out / "rank_0")
    assert list(shown["events/lifecycle/finished"]) == list(shown["events/lifecycle/running"]) == [STEPS]
    assert list(shown["alerts/stall"]) == [STEPS + 5]


# -- across SIGKILL and restart ------------------------------------------------------------------
class QuickCheckpoints(Job):
    def extra(self) -> list[str]:
        return ["--checkpoint-interval", "0.5"]  # the test waits for the one that holds the stall, then kills


@pytest.mark.parametrize("wake_mode", ["inotify"])
def test_a_restart_keeps_the_finish_and_the_open_stall(live: LiveEnv, tmp_path: Path) -> None:
    """Rank 0 finished, rank 1 was alerted as stalled; SIGKILL once that is checkpointed, restart:
    no stall for rank 0, rank 1's stall is not raised again (its wait counts from the restart),
    and its next step resolves it once."""
    job = QuickCheckpoints(live, tmp_path)
    job.sidecar.start()
    job.steps(STEPS)
    job.logs[0].say(OVER)
    job.rank1_stalled_three_thresholds()
    wait_until(lambda: _checkpointed(live, lambda s: s["runs"]["1"]["alerts"]["firing"] == ["stall"]
                                     and s["runs"]["0"]["alerts"]["lifecycle"] == "finished"), 15, "the checkpoint")
    job.sidecar.kill()
    job.sidecar.start()
    wait_until(lambda: (scrape(job.port, "mstb_sidecar_training_seconds_since_step", rank="1") or 0) >= 3, 15,
               "three thresholds after the restart")
    err = job.sidecar.stderr()
    assert "ALERT" not in err, err
    assert job.hooked() == [("stall", "firing", 1)]
    assert job.stall_active(1) == 1 and job.stall_active(0) == 0
    assert job.state(0) == {"running": 0, "finished": 1, "failed": 0}
    job.logs[1].step()
    wait_until(lambda: "RESOLVED stall: rank 1" in job.sidecar.stderr(), 10, "rank 1's stall to resolve")
    job.sidecar.stop()
    assert job.hooked() == [("stall", "firing", 1), ("stall", "resolved", 1)]
    assert "ALERT" not in job.sidecar.stderr()
    assert list(texts(live.out / "rank_1")["alerts/stall"]) == [STEPS, STEPS + 1]


class SlowCheckpoints(Job):
    def extra(self) -> list[str]:
        return ["--checkpoint-interval", "600"]  # the first one comes at once, the next not in this test


@pytest.mark.parametrize("wake_mode", ["inotify"])
def test_an_error_alert_before_a_kill_is_not_raised_again(live: LiveEnv, tmp_path: Path) -> None:
    """The traceback is read and alerted on after the last checkpoint; the restart reads it again
    (its offset was not checkpointed) and knows it died, but pages no second time."""
    job = SlowCheckpoints(live, tmp_path)
    job.steps(STEPS)  # before the start: the first round reads them all, and is checkpointed
    job.sidecar.start()
    wait_until(lambda: _checkpointed(live, lambda s: s["runs"]["0"]["alerts"]["last_step"] == STEPS), 15,
               "the first checkpoint")
    job.logs[0].say(TRACEBACK[0], "ERROR", "[mindformers/tools/cloud_adapter/cloud_monitor.py:43] wrapper:")
    wait_until(lambda: job.hooked() == [("error", "firing", 0)], 10, "the error alert")
    job.sidecar.kill()
    job.sidecar.start()
    wait_until(lambda: job.state(0) == {"running": 0, "finished": 0, "failed": 1}, 10, "the traceback read again")
    assert "ALERT error" not in job.sidecar.stderr() and "training died" not in job.sidecar.stderr()  # told before the kill
    assert job.hooked() == [("error", "firing", 0)]
    job.rank1_stalled_three_thresholds()  # the restarted sidecar watches rank 1 from its start, and not rank 0
    assert "ALERT stall: rank 0" not in job.sidecar.stderr()
    assert job.hooked() == [("error", "firing", 0), ("stall", "firing", 1)]
    assert job.state(0) == {"running": 0, "finished": 0, "failed": 1}
    job.sidecar.stop()


@pytest.mark.parametrize("wake_mode", ["inotify"])
def test_a_nan_episode_open_at_a_kill_is_not_raised_again(live: LiveEnv, tmp_path: Path) -> None:
    job = Job(live, tmp_path, loss_of=lambda step: math.nan if step > 10 else plateau(step))
    job.sidecar.start()
    job.steps(STEPS)
    wait_until(lambda: _checkpointed(live, lambda s: all("nan-loss" in s["runs"][r]["alerts"]["firing"]
                                                         and s["runs"][r]["alerts"]["last_step"] == STEPS
                                                         for r in "01")), 15, "the checkpoint")
    wait_until(lambda: sorted(a for a in job.hooked() if a[0] == "nan-loss") == [("nan-loss", "firing", 0),
                                                                                ("nan-loss", "firing", 1)],
               10, "both ranks' alerts to reach --on-alert")
    job.sidecar.kill()
    job.sidecar.start()
    job.steps(5)
    wait_until(lambda: scrape(job.port, "mstb_sidecar_training_step", rank="1") == STEPS + 5, 10, "the new steps")
    assert "ALERT nan" not in job.sidecar.stderr()
    assert scrape(job.port, "mstb_sidecar_alert_active", rank="0", alert="nan-loss") == 1
    for log in job.logs:
        log.loss_of = plateau
    job.steps(1)
    wait_until(lambda: "RESOLVED nan-loss: rank 1" in job.sidecar.stderr(), 10, "the NaN episode to end")
    job.sidecar.stop()
    nan = sorted(a for a in job.hooked() if a[0] == "nan-loss")
    assert nan == [("nan-loss", "firing", 0), ("nan-loss", "firing", 1),
                   ("nan-loss", "resolved", 0), ("nan-loss", "resolved", 1)]


def test_a_checkpoint_from_before_lifecycles_were_kept_still_loads(tmp_path: Path) -> None:
    """Its runs have no ``alerts`` and it has no ``firing``: it loads as it did (no fresh start),
    with no lifecycle or episode to restore."""
    from sidecar.output.state import StateStore

    store = StateStore(tmp_path, "test")
    store.path.parent.mkdir(parents=True)
    store.path.write_text(json.dumps({"version": 2, "files": [], "chains": {}, "summaries": {}, "aggregate": None,
                                      "runs": {"0": {"name": "rank_0", "file": "", "size": 0,
                                                    "watermarks": {"loss": 20}}}}))
    state = store.load()
    assert state.runs["0"].watermarks == {"loss": 20} and state.runs["0"].alerts is None and state.firing == []
