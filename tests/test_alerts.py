"""Alerts end to end: the console, TensorBoard text events, ``--on-alert`` and ``--fail-on``.

Real ``mstb-sidecar`` processes on real v1.9 logs; what TensorBoard shows is read back with its
own loader. Rank 0 has one NaN loss, rank 1 one loss spike: exactly those two alerts (and their
"resolved") must be raised, each naming rank and step, in replay and live; live, each within a
second of its line being written, and a rank that stops gets a stall alert, then "resolved".
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from live_helpers import BIN, LiveEnv, RankLog, paced, poll, wait_until
from outputs import assert_same_outputs, read_run
from tb_read import scalars, texts

pytest_plugins = ["live_helpers"]

STEPS = 200
NAN_STEP, SPIKE_STEP = 150, 120
HOOK = """import json, sys
alert = json.load(sys.stdin)
with open(sys.argv[1], "a") as fh:
    fh.write(json.dumps(alert) + "\\n")
"""


def loss_of(rank: int):
    """A plausible noisy plateau; rank 0 has a NaN, rank 1 a spike."""
    def loss(step: int) -> float:
        if rank == 0 and step == NAN_STEP:
            return math.nan
        if rank == 1 and step == SPIKE_STEP:
            return 9.5
        return 2.0 + 0.01 * ((step * 7 + rank) % 5)
    return loss


def alert_lines(stderr: str) -> list[str]:
    return re.findall(r"(?:ALERT|RESOLVED) [^\n]*", stderr)


def test_replay_raises_exactly_the_nan_and_the_spike(tmp_path: Path) -> None:
    logs = [RankLog(tmp_path / "output" / "log" / f"rank_{r}" / "info.log", r, loss_of=loss_of(r)) for r in (0, 1)]
    for log in logs:
        log.step(STEPS)
    hook, sent = tmp_path / "hook.py", tmp_path / "sent.jsonl"
    hook.write_text(HOOK)
    out = tmp_path / "tb"
    cmd = [str(BIN), "replay", str(tmp_path / "output"), "--out", str(out), "--on-alert",
           f"{sys.executable} {hook} {sent}", "--fail-on", "nan"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 5, done.stderr
    assert "failing as --fail-on asks: nan" in done.stderr
    raised = sorted(line for line in alert_lines(done.stderr) if line.startswith("ALERT"))  # ranks read in any order
    assert len(raised) == 2, done.stderr
    assert raised[0].startswith(f"ALERT loss-spike: rank 1, step {SPIKE_STEP}: loss = 9.5 (threshold ")
    assert raised[1].startswith(f"ALERT nan-loss: rank 0, step {NAN_STEP}: loss = nan")
    resolved = sorted(line for line in alert_lines(done.stderr) if line.startswith("RESOLVED"))
    assert [line.split(":")[0:2] for line in resolved] == [
        ["RESOLVED loss-spike", f" rank 1, step {SPIKE_STEP + 5}"], ["RESOLVED nan-loss", f" rank 0, step {NAN_STEP + 1}"]]

    shown = {rank: texts(out / f"rank_{rank}") for rank in (0, 1)}
    assert sorted(shown[0]["alerts/nan-loss"]) == [NAN_STEP, NAN_STEP + 1]
    assert shown[0]["alerts/nan-loss"][NAN_STEP].startswith(f"ALERT nan-loss: rank 0, step {NAN_STEP}")
    assert sorted(shown[1]["alerts/loss-spike"]) == [SPIKE_STEP, SPIKE_STEP + 5]
    assert not [tag for rank in (0, 1) for tag in shown[rank] if tag.startswith("alerts/")
                and tag not in ("alerts/nan-loss", "alerts/loss-spike")]

    received = sorted((json.loads(line) for line in sent.read_text().splitlines()), key=lambda a: (a["alert"], a["step"]))
    assert [(a["alert"], a["state"], a["rank"], a["step"]) for a in received] == [
        ("loss-spike", "firing", 1, SPIKE_STEP), ("loss-spike", "resolved", 1, SPIKE_STEP + 5),
        ("nan-loss", "firing", 0, NAN_STEP), ("nan-loss", "resolved", 0, NAN_STEP + 1)]
    spike = received[0]  # numbers as JSON numbers, the threshold the line shows
    assert spike["value"] == 9.5 and isinstance(spike["threshold"], float) and spike["unit"] is None
    assert f"(threshold {spike['threshold']:.6g})" in spike["message"]
    assert (received[2]["value"], received[2]["value_text"]) == (None, "nan")

    again = subprocess.run([str(BIN), "replay", str(tmp_path / "output"), "--out", str(out), "--fail-on", "spike,behind"],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "ALERT" not in again.stderr, again.stderr  # it reads only what is new
    clean = subprocess.run([str(BIN), "replay", str(tmp_path / "output"), "--out", str(tmp_path / "tb1"),
                            "--fail-on", "spike,behind"], capture_output=True, text=True, timeout=60)
    assert clean.returncode == 5, clean.stderr
    clean = subprocess.run([str(BIN), "replay", str(tmp_path / "output"), "--out", str(tmp_path / "tb2"),
                            "--fail-on", "stall,throughput"], capture_output=True, text=True, timeout=60)
    assert clean.returncode == 0, clean.stderr


def documented_schema() -> tuple[dict[str, set[type]], dict]:
    """docs/alerts.md's ``--on-alert`` table (field -> the JSON types it allows) and its example."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "alerts.md").read_text()
    section = text[text.index("### The `--on-alert` JSON"):text.index("## Thresholds")]
    kinds = {"string": {str}, "integer": {int}, "number": {int, float}, "null": {type(None)}}
    fields = {name: set().union(*(kinds[k] for k in kind.split(" or ")))
              for name, kind in re.findall(r"^\| `(\w+)` \| ([a-z ]+) \|", section, re.M)}
    example = json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))
    return fields, example


def test_on_alert_json_is_the_documented_schema_and_example(tmp_path: Path) -> None:
    """A replay of the genuine diverging run hands ``--on-alert`` exactly docs/alerts.md's example,
    and every payload has the table's fields, in its order, with its types."""
    hook, sent = tmp_path / "hook.py", tmp_path / "sent.jsonl"
    hook.write_text(HOOK)
    fixture = Path(__file__).parent / "fixtures" / "real" / "mf1.9-diverge" / "output"
    done = subprocess.run([str(BIN), "replay", str(fixture), "--out", str(tmp_path / "tb"), "-q",
                           "--on-alert", f"{sys.executable} {hook} {sent}"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    fields, example = documented_schema()
    payloads = [json.loads(line) for line in sent.read_text().splitlines()]
    assert [p["alert"] for p in payloads] == ["nan-grad-norm", "overflow"]
    assert payloads[0] == example
    assert len(fields) == 12
    for payload in payloads:
        assert list(payload) == list(fields)
        assert [name for name, value in payload.items() if type(value) not in fields[name]] == [], payload


def test_bad_fail_on_and_on_alert_are_one_line_errors(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    for extra, said in ((["--fail-on", "nan,spikes"], "unknown alert 'spikes'; choose from nan, spike"),
                        (["--on-alert", "no-such-command-xyz --flag"], "'no-such-command-xyz' is not an executable")):
        done = subprocess.run([str(BIN), "replay", str(tmp_path / "in"), "--out", str(tmp_path / "tb"), *extra],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 2 and said in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("wake_mode", ["inotify"])
def test_live_alerts_within_a_second_and_a_stall_that_resolves(live: LiveEnv, tmp_path: Path) -> None:
    config = tmp_path / "alerts.yaml"
    config.write_text("alerts:\n  stall: {factor: 2, min-seconds: 1.5}\n  rank-behind: {steps: 1000}\n")
    logs = [RankLog(live.output / "log" / f"rank_{r}" / "info.log", r, loss_of=loss_of(r)) for r in (0, 1)]
    sidecar = live.sidecar("--config", str(config)).start()

    def write_both_until(step: int) -> None:
        for _ in paced(range(logs[0].next_step, step + 1), 0.002):
            for log in logs:
                log.step()

    write_both_until(SPIKE_STEP - 1)
    for name, log, step in (("loss-spike", logs[1], SPIKE_STEP), ("nan-loss", logs[0], NAN_STEP)):
        write_both_until(step - 1)
        log.step()
        written = time.monotonic()
        wait_until(lambda: f"ALERT {name}: rank {log.rank}, step {step}" in sidecar.stderr(), 5, f"the {name} alert")
        assert time.monotonic() - written < 1.0, f"{name} took {time.monotonic() - written:.2f} s"
        logs[1 - log.rank].step()

    write_both_until(STEPS)
    stopped = time.monotonic()

    def rank_0_goes_on() -> bool:  # a step every 0.2 s while rank 1 hangs, until the stall is paged
        logs[0].step()
        return "ALERT stall: rank 1" in sidecar.stderr()

    poll(rank_0_goes_on, bool, 4, every=0.2)
    assert "ALERT stall: rank 1" in sidecar.stderr(), sidecar.stderr()
    assert 1.5 <= time.monotonic() - stopped < 3.5
    assert "ALERT stall: rank 0" not in sidecar.stderr()
    logs[1].step()
    wait_until(lambda: "RESOLVED stall: rank 1" in sidecar.stderr(), 5, "the stall to resolve")
    rc, _ = sidecar.stop()
    assert rc == 0 and "Traceback" not in sidecar.stderr()
    raised = sorted(line.split(",")[0] for line in alert_lines(sidecar.stderr()) if line.startswith("ALERT"))
    assert raised == ["ALERT loss-spike: rank 1", "ALERT nan-loss: rank 0", "ALERT stall: rank 1"], sidecar.stderr()
    assert STEPS in texts(live.out / "rank_1")["alerts/stall"]


def test_alerts_across_ranks_are_also_in_the_aggregate_run(tmp_path: Path) -> None:
    logs = [RankLog(tmp_path / "output" / "log" / f"rank_{r}" / "info.log", r, loss_of=loss_of(-1)) for r in (0, 1)]
    logs[0].step(260)
    logs[1].step(120)  # rank 1 died at step 120
    out = tmp_path / "tb"
    done = subprocess.run([str(BIN), "replay", str(tmp_path / "output"), "--out", str(out), "--instance", "n1",
                           "--fail-on", "behind"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 5, done.stderr
    assert [line for line in alert_lines(done.stderr)] == [
        "ALERT rank-behind: rank 1, step 120: step = 140 (threshold 100); 140 steps behind the furthest rank (step 260)"]
    for run in (out / "rank_1", out / "aggregate" / "n1"):
        assert list(texts(run)["alerts/rank-behind"]) == [120], run
    assert "alerts/rank-behind" not in texts(out / "rank_0")


def test_a_hung_on_alert_command_is_killed_and_never_holds_up_reading(tmp_path: Path) -> None:
    logs = [RankLog(tmp_path / "output" / "log" / f"rank_{r}" / "info.log", r, loss_of=loss_of(r)) for r in (0, 1)]
    for log in logs:
        log.step(STEPS)
    started = time.monotonic()
    done = subprocess.run([str(BIN), "replay", str(tmp_path / "output"), "--out", str(tmp_path / "tb"),
                           "--on-alert", "sleep 60", "--on-alert-timeout", "0.3"], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert "--on-alert sleep failed for loss-spike (killed after 0.3 s)" in done.stderr
    assert took < 8, f"{took:.1f} s: four alerts at 0.3 s each, not four minutes"  # 4 alerts (2 resolved)
    assert len(scalars(tmp_path / "tb" / "rank_1")["loss"]) == STEPS


# -- baselines across restarts (issue 26) ------------------------------------------------------------
def spiky(spikes: set[int]):
    """A noisy plateau with a spike at each step of ``spikes`` (the same on both ranks)."""
    return lambda step: 9.5 if step in spikes else 2.0 + 0.01 * (step % 5)


def alert_texts(out: Path) -> dict[int, dict[str, dict[int, str]]]:
    return {r: {t: v for t, v in texts(out / f"rank_{r}").items() if t.startswith("alerts/")} for r in (0, 1)}


def replay(logs: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(BIN), "replay", str(logs), "--out", str(out), *extra], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done


def test_a_spike_after_a_restart_is_judged_against_the_baseline_before_it(tmp_path: Path) -> None:
    """Twenty steps replayed, then five more and a spike: the second replay judges step 25 against
    the first twenty (their baseline is in the checkpoint), as one replay of all of them does."""
    logs = [RankLog(tmp_path / "output" / "log" / f"rank_{r}" / "info.log", r, loss_of=spiky({25})) for r in (0, 1)]
    for log in logs:
        log.step(20)
    out = tmp_path / "tb"
    assert "ALERT" not in replay(tmp_path / "output", out).stderr
    for log in logs:
        log.step(20)
    raised = alert_lines(replay(tmp_path / "output", out).stderr)
    assert sorted(line.split(":")[:2] for line in raised) == [
        ["ALERT loss-spike", f" rank {r}, step 25"] for r in (0, 1)] + [
        ["RESOLVED loss-spike", f" rank {r}, step 30"] for r in (0, 1)], raised
    replay(tmp_path / "output", tmp_path / "whole")
    assert alert_texts(out) == alert_texts(tmp_path / "whole")


@pytest.mark.parametrize("wake_mode", ["inotify"])
def test_a_spike_after_a_sigkill_is_raised_once_as_in_one_run(live: LiveEnv, tmp_path: Path) -> None:
    """Steps 21-30 (a spike at 25, resolved at 30) are written and paged after the last checkpoint;
    SIGKILL; the restart reads them again: judged again, paged no second time, so the spike at 40
    is judged against the same baseline as in one run, and raised."""
    hook, sent = tmp_path / "hook.py", tmp_path / "sent.jsonl"
    hook.write_text(HOOK)
    logs = [RankLog(live.output / "log" / f"rank_{r}" / "info.log", r, loss_of=spiky({25, 40})) for r in (0, 1)]
    for log in logs:
        log.step(20)
    sidecar = live.sidecar("--checkpoint-interval", "600", "--on-alert", f"{sys.executable} {hook} {sent}")
    sidecar.start()  # the first checkpoint comes at once, the next not in this test

    def checkpointed() -> bool:
        try:
            runs = json.loads(live.state_file().read_text())["runs"]
            return all(runs[r]["alerts"]["last_step"] == 20 for r in "01")
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def hooked() -> list[tuple[str, str, int, int]]:
        lines = sent.read_text().splitlines() if sent.exists() else []
        return sorted((a["alert"], a["state"], a["rank"], a["step"]) for a in map(json.loads, lines))

    wait_until(checkpointed, 15, "the first checkpoint")
    for log in logs:
        log.step(10)
    wait_until(lambda: len(hooked()) == 4 and all(max(scalars(live.out / f"rank_{r}")["loss"]) == 30 for r in (0, 1)),
               15, "the spike paged and resolved, and step 30 written")
    sidecar.kill()
    sidecar.start()
    for log in logs:
        log.step(15)
    wait_until(lambda: len(hooked()) == 8, 15, "the second spike paged and resolved")
    sidecar.stop()
    assert hooked() == sorted((name, state, r, s) for r in (0, 1) for name, state, s in (
        ("loss-spike", "firing", 25), ("loss-spike", "resolved", 30), ("loss-spike", "firing", 40),
        ("loss-spike", "resolved", 45)))
    assert "ALERT loss-spike: rank 0, step 25" not in sidecar.stderr()  # the restarted one's log
    replay(live.output, tmp_path / "whole")
    assert alert_texts(live.out) == alert_texts(tmp_path / "whole")


@pytest.mark.parametrize("wake_mode", ["inotify"])
def test_an_alert_superseded_before_a_sigkill_is_not_written_again(live: LiveEnv, tmp_path: Path) -> None:
    """After the last checkpoint, steps 21-30 page a NaN loss at 25, and training goes back to
    step 22 (its START purges the alert); SIGKILL. The restart reads steps 21-30 again, now
    superseded, and judges them again so its baselines are an uninterrupted run's: their alerts
    are neither paged again nor written to the run, which shows what one replay shows (before, the
    NaN alert at 25 came back in the run; found by the model-based test's long search)."""
    hook, sent = tmp_path / "hook.py", tmp_path / "sent.jsonl"
    hook.write_text(HOOK)
    log = RankLog(live.output / "log" / "rank_0" / "info.log", 0,
                  loss_of=lambda step: math.nan if step == 25 else 2.0 + 0.01 * (step % 5))
    log.step(20)
    sidecar = live.sidecar("--checkpoint-interval", "600", "--on-alert", f"{sys.executable} {hook} {sent}")
    sidecar.start()  # the first checkpoint comes at once, the next not in this test

    def checkpointed() -> bool:
        try:
            return json.loads(live.state_file().read_text())["runs"]["0"]["alerts"]["last_step"] == 20
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def paged() -> list[tuple[str, str, int]]:
        lines = sent.read_text().splitlines() if sent.exists() else []
        return [(a["alert"], a["state"], a["step"]) for a in map(json.loads, lines)]

    wait_until(checkpointed, 15, "the first checkpoint")
    log.step(10)
    wait_until(lambda: len(paged()) == 2, 15, "the NaN paged and resolved")
    log.loss_of = lambda step: 1.5 + 0.01 * (step % 5)
    log.go_back(22)
    log.step(5)
    wait_until(lambda: sorted(scalars(live.out / "rank_0")["loss"]) == list(range(1, 27)), 15, "the resumed steps")
    assert "alerts/nan-loss" not in read_run(live.out / "rank_0").texts  # the resume's START purged it
    sidecar.kill()
    sidecar.start()
    log.step(2)
    wait_until(lambda: max(scalars(live.out / "rank_0")["loss"]) == 28, 15, "steps after the restart")
    assert sidecar.stop()[0] == 0
    assert paged() == [("nan-loss", "firing", 25), ("nan-loss", "resolved", 26)]
    assert "alerts/nan-loss" not in read_run(live.out / "rank_0").texts
    replay(live.output, tmp_path / "whole", "--instance", "test")
    assert_same_outputs(tmp_path / "whole", live.out)
