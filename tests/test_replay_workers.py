"""Replay in worker processes (``--jobs``, :mod:`sidecar.service.replay_workers`) writes exactly what
one process writes: every event of every run (read back with TensorBoard's ``EventAccumulator``),
the alerts and their ``--on-alert`` JSON, the summary, the exit status and the checkpoint, so that
a second replay adds nothing. Wall times that come from the clock (the layout, an alert judged at
the end) are the only thing allowed to differ.

The tree is built to make the workers disagree if anything is shared wrongly: four ranks of
different lengths and clocks, a rotation and a training resume on one rank, a clock stepped back
an hour on another, a NaN and a loss spike, losses that diverge across ranks, plain lines between
the steps, and, for the fallback, a line of one rank labelled inside another rank's file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from live_helpers import BIN, RankLog, wait_until
from tb_read import all_events, same_float32


def _loss(rank: int, nan_at: int | None = None, spike_at: int | None = None) -> Callable[[int], float]:
    def loss(step: int) -> float:
        if step == nan_at:
            return math.nan
        if step == spike_at:
            return 50.0 + rank
        return 2.0 + rank + 1.0 / step  # ranks apart: a divergence alert
    return loss


def build(base: Path, labelled: bool = False) -> list[RankLog]:
    """``base/output/log/rank_{0..3}/info.log`` (see the module docstring); the logs know what
    TensorBoard should show (:attr:`RankLog.expected`)."""
    logs = base / "output" / "log"
    ranks = [RankLog(logs / f"rank_{r}" / "info.log", r) for r in range(4)]
    for log in ranks:
        loss = _loss(log.rank, nan_at=120 if log.rank == 2 else None, spike_at=160 if log.rank == 1 else None)
        log.loss_of = lambda step, loss=loss, log=log: loss(step) + 0.25 * log.segment  # a resume changes it
    noise = b"[INFO] 2026-11-29 10:00:00,000 [mindformers/dataset/dataloader.py:211] __getitem__: fetched a batch\n"
    for step in range(1, 301):
        for log in ranks:
            if log.rank == 3 and step > 250:
                continue  # rank 3 stops early: the aggregate's last steps are written without it
            if log.rank == 0 and step == 150:
                log.rotate()
            if log.rank == 0 and step == 250:
                log.go_back(200)  # a checkpoint reload: steps 200-249 are written again, newer
            if log.rank == 1 and step == 100:
                log.jump_clock(timedelta(hours=-1))
            log.step()
            log.write(noise)
    if labelled:  # an OpenMPI-labelled line of rank 1 in rank 0's file
        ranks[0].write(f"[1,1]<stdout>:{ranks[1].record(301).decode()}".encode())
    for log in ranks:
        log.close()
    return ranks


def replay(tree: Path, out: Path, jobs: int, *extra: str) -> subprocess.CompletedProcess[str]:
    """:func:`replay_with` ``--jobs`` and the alerts appended to ``out``'s sibling ``.alerts``."""
    alerts = out.with_name(out.name + ".alerts")
    return replay_with(tree, out, "--jobs", str(jobs), "--on-alert", f"tee -a {alerts}", *extra)


def replay_with(tree: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN), "replay", str(tree), "--out", str(out), "--no-progress", *extra],
                          capture_output=True, text=True, timeout=120)


def checkpoint(out: Path) -> tuple[set[tuple[str, int]], dict[str, dict[str, int]], dict]:
    """What the state file says: file offsets, each run's watermarks, the aggregate's waiting state."""
    (path,) = (out / ".mstb-sidecar").glob("state-*.json")
    state = json.loads(path.read_text())
    return ({(f["path"], f["offset"]) for f in state["files"]},
            {key: run["watermarks"] for key, run in state["runs"].items()},
            state["aggregate"])


def summary(result: subprocess.CompletedProcess[str], out: Path) -> list[str]:
    """The printed summary, its time ("in N s") left out and ``--out`` as OUT."""
    return [re.sub(r" in [\d.]+ s ", " ", line).replace(str(out), "OUT") for line in result.stdout.splitlines()]


def alert_lines(out: Path) -> list[str]:
    """The ``--on-alert`` JSON objects (one per command run, appended by ``tee``), in a fixed order."""
    text, found, decoder = out.with_name(out.name + ".alerts").read_text(), [], json.JSONDecoder()
    while text.strip():
        alert, end = decoder.raw_decode(text.strip())
        found.append(json.dumps(alert, sort_keys=True))
        text = text.strip()[end:]
    return sorted(found)


def test_workers_write_what_one_process_writes(tmp_path: Path) -> None:
    build(tmp_path / "logs")
    tree = tmp_path / "logs" / "output"
    started = time.time()
    one = replay(tree, tmp_path / "one", 1, "--fail-on", "nan")
    runs = {jobs: replay(tree, tmp_path / f"jobs{jobs}", jobs, "--fail-on", "nan") for jobs in (2, 3)}
    clock = (started, time.time())
    assert one.returncode == 5, one.stderr  # --fail-on nan: rank 2's NaN
    want = all_events(tmp_path / "one", clock)
    assert {"rank_0", "rank_1", "rank_2", "rank_3"} <= want.keys() and any(r.startswith("aggregate/") for r in want)
    assert any(tag == "alerts/divergence" for run in want.values() for tag, *_ in run)
    alerts = alert_lines(tmp_path / "one")
    assert any('"nan-loss"' in a for a in alerts) and any('"loss-spike"' in a for a in alerts), alerts
    for jobs, result in runs.items():
        out = tmp_path / f"jobs{jobs}"
        assert result.returncode == 5, result.stderr
        assert "replaying in one process" not in result.stderr
        assert all_events(out, clock) == want, f"--jobs {jobs}"
        assert summary(result, out) == summary(one, tmp_path / "one")
        assert alert_lines(out) == alerts
        assert checkpoint(out) == checkpoint(tmp_path / "one")


def test_a_second_parallel_replay_adds_nothing(tmp_path: Path) -> None:
    build(tmp_path / "logs")
    tree = tmp_path / "logs" / "output"
    out = tmp_path / "out"
    assert replay(tree, out, 2).returncode == 0
    sizes = {p: p.stat().st_size for p in out.rglob("*tfevents*")}
    again = replay(tree, out, 2)
    assert again.returncode == 0, again.stderr
    assert "nothing new since the last run" in again.stdout
    assert {p: p.stat().st_size for p in out.rglob("*tfevents*")} == sizes


def test_a_line_of_a_rank_in_another_ranks_file_makes_it_one_process(tmp_path: Path) -> None:
    """A worker must not write a rank another worker owns: it stops before, and the replay starts
    over in one process, with the same result as if it had from the start."""
    build(tmp_path / "logs", labelled=True)
    tree = tmp_path / "logs" / "output"
    started = time.time()
    one = replay(tree, tmp_path / "one", 1)
    two = replay(tree, tmp_path / "two", 2)
    clock = (started, time.time())
    assert two.returncode == 0, two.stderr
    assert "a line of rank 1 is in a file of another rank; replaying in one process instead" in two.stderr
    assert all_events(tmp_path / "two", clock) == all_events(tmp_path / "one", clock)
    assert summary(two, tmp_path / "two") == summary(one, tmp_path / "one")
    assert checkpoint(tmp_path / "two") == checkpoint(tmp_path / "one")


def test_the_progress_bar_ends_at_100_percent_after_a_fallback_to_one_process(tmp_path: Path) -> None:
    """On a terminal, the bar counts the bytes of the files (not the lines processed too, which
    took it past 100%); after a fallback, from 0 again (here the workers stop before they report any)."""
    build(tmp_path / "logs", labelled=True)
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # tqdm draws nothing 0 wide
    proc = subprocess.Popen([str(BIN), "replay", str(tmp_path / "logs" / "output"), "--out", str(tmp_path / "out"),
                             "--jobs", "2"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=terminal)
    os.close(terminal)
    shown, deadline = b"", time.monotonic() + 120
    while select.select([controller], [], [], max(0.0, deadline - time.monotonic()))[0]:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # EIO: the replay closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(controller)
    assert proc.wait(timeout=120) == 0
    text = shown.decode(errors="replace")
    assert "replaying in one process instead" in text
    percents = [int(p) for p in re.findall(r"replay:\s*(\d+)%", text)]
    assert percents and percents[-1] == 100 and max(percents) == 100, text


def long_tree(base: Path, nan_at: int | None = None, foreign: bool = False) -> Path:
    """Two ranks of 8,000 steps, 3.5 MB each: four reads of a megabyte (replay.READ_BUDGET). With
    ``nan_at``, rank 1's loss is NaN there; with ``foreign``, rank 0's file ends in an OpenMPI-labelled
    step of rank 2, which has no file of its own (see :func:`build`)."""
    logs = base / "output" / "log"
    ranks = [RankLog(logs / f"rank_{r}" / "info.log", r,
                     loss_of=lambda step, r=r: math.nan if r == 1 and step == nan_at else 2.0 + 1.0 / step)
             for r in range(2)]
    for _ in range(8000):
        for log in ranks:
            log.step()
    if foreign:
        rank2 = RankLog(base / "rank_2.scratch", 2)  # only its lines: the file is outside the tree
        ranks[0].write(f"[1,2]<stdout>:{rank2.record(8000).decode()}".encode())
        rank2.close()
    for log in ranks:
        log.close()
    return base / "output"


def as_shown(events: dict[str, list]) -> dict[str, list]:
    """What a replay that went on from a checkpoint must show as one replay does: every point but
    the alerts (detectors start afresh after a restart) and, of the layout, the newest (TensorBoard
    shows that one; a checkpoint written before the aggregate's first step had to update it)."""
    return {run: [(e[0], e[2]) for e in points[-1:]] if run.startswith("layout/")  # its newest, at any step
            else [e for e in points if not e[0].startswith("alerts/")] for run, points in events.items()}


class Long(NamedTuple):
    """A :func:`long_tree` and what one uninterrupted replay of it shows (:func:`as_shown`)."""

    tree: Path
    shown: dict[str, list]


def _long(base: Path, nan_at: int | None = None) -> Long:
    tree = long_tree(base / "logs", nan_at=nan_at)
    started = time.time()
    assert replay_with(tree, base / "reference", "--jobs", "1").returncode == 0
    return Long(tree, as_shown(all_events(base / "reference", (started, time.time()))))


# Built and replayed once per module (per xdist worker): the tests only read the trees.
@pytest.fixture(scope="module")
def steady(tmp_path_factory: pytest.TempPathFactory) -> Long:
    return _long(tmp_path_factory.mktemp("steady"))


@pytest.fixture(scope="module")
def nan_midway(tmp_path_factory: pytest.TempPathFactory) -> Long:
    """Rank 1's loss is NaN at step 4,000, in the second read."""
    return _long(tmp_path_factory.mktemp("nan"), nan_at=4000)


def goes_on(long: Long, out: Path, jobs: str, started: float) -> None:
    """``out``, checkpointed partway through ``long.tree`` since ``started``: the same replay goes
    on from there, and its runs then show what one uninterrupted replay's do (:func:`as_shown`)."""
    offsets, _, _ = checkpoint(out)
    assert 0 < sum(offset for _, offset in offsets) < sum(p.stat().st_size for p in long.tree.rglob("info.log"))
    again = replay_with(long.tree, out, "--jobs", jobs)
    assert again.returncode == 0, again.stderr
    assert "does not match" not in again.stderr
    assert as_shown(all_events(out, (started, time.time()))) == long.shown


@pytest.mark.parametrize("jobs", ["1", "2"], ids=["one-process", "two-workers"])
def test_an_interrupted_replay_checkpoints_what_it_wrote_and_the_next_one_goes_on_from_there(
        tmp_path: Path, jobs: str, nan_midway: Long) -> None:
    """Ctrl-C mid-replay (sent by ``--on-alert`` at rank 1's NaN, step 4,000, in the second read,
    once the aggregate has written steps and while it holds others), in one process or while the
    workers run: exit 130 with a checkpoint of what was written (the default interval saves none
    before), from which the next replay goes on."""
    tree = nan_midway.tree
    started = time.time()
    # A worker may be up to ten relayed batches (2,560 steps) ahead of the parent: the 4,000 steps
    # after the NaN leave time for the --on-alert command's Ctrl-C to land before the workers finish.
    once = tmp_path / "interrupted"  # the NaN's "resolved" must not press Ctrl-C again
    first = replay_with(tree, tmp_path / "out", "--jobs", jobs,
                        "--on-alert", f'sh -c "test -e {once} || {{ touch {once}; kill -INT $PPID; }}"')
    assert first.returncode == 130, first.stderr
    assert "interrupted: what was written is checkpointed" in first.stderr and "Traceback" not in first.stderr
    goes_on(nan_midway, tmp_path / "out", jobs, started)


@pytest.mark.parametrize("jobs", ["1", "2"], ids=["one-process", "two-workers"])
def test_a_killed_replay_goes_on_from_the_checkpoint_saved_on_the_way(tmp_path: Path, jobs: str,
                                                                      steady: Long) -> None:
    """SIGKILL once a checkpoint was saved on the way (every 0.05 s here, ``--checkpoint-interval``),
    in one process or while the workers run: the next replay goes on from the last one."""
    tree = steady.tree
    out = tmp_path / "out"
    started = time.time()
    proc = subprocess.Popen([str(BIN), "replay", str(tree), "--out", str(out), "--jobs", jobs,
                             "--checkpoint-interval", "0.05", "--quiet"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(lambda: list(out.glob(".mstb-sidecar/state-*.json")) or proc.poll() is not None, 60,
               "a checkpoint saved on the way", every=0.002)  # kill before the replay ends
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL, "the replay ended before its first checkpoint"
    goes_on(steady, out, jobs, started)


def test_a_fallback_to_one_process_goes_on_from_the_checkpoint_saved_on_the_way(tmp_path: Path) -> None:
    """Once the workers saved a checkpoint, a worker that meets a line of a rank it does not own
    (rank 2's, at the end of rank 0's file) makes the replay go on in one process from that
    checkpoint, keeping the workers' runs as after a crash: every rank's run then shows what one
    replay's does. (Not the aggregate: rank 2 joins it when its line is read, which depends on the
    order of the reads.)"""
    tree = long_tree(tmp_path / "logs", foreign=True)
    started = time.time()
    two = replay_with(tree, tmp_path / "two", "--jobs", "2", "--checkpoint-interval", "0.05")
    one = replay_with(tree, tmp_path / "one", "--jobs", "1")
    clock = (started, time.time())
    assert two.returncode == 0 and one.returncode == 0, two.stderr + one.stderr
    assert ("a line of rank 2 is in a file of another rank; replaying in one process instead, from the "
            "checkpoint saved on the way") in two.stderr
    assert "does not match" not in two.stderr
    shown = {name: as_shown(all_events(tmp_path / name, clock)) for name in ("two", "one")}
    ranks = {name: {run: points for run, points in runs.items() if run.startswith("rank_")}
             for name, runs in shown.items()}
    assert sorted(ranks["one"]) == ["rank_0", "rank_1", "rank_2"]
    assert ranks["two"] == ranks["one"]


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _alive(pid: int) -> bool:
    """Running or stopped, not a zombie waiting for whoever adopted it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_workers_end_with_a_killed_replay(tmp_path: Path, steady: Long) -> None:
    """A replay killed outright takes its workers with it, even ones that would not notice for a
    while (stopped here): otherwise they would go on writing its runs and hold the lock on --out
    they inherited, and the same command could not be run again."""
    tree = steady.tree
    proc = subprocess.Popen([str(BIN), "replay", str(tree), "--out", str(tmp_path / "out"), "--jobs", "2", "--quiet"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        def writing() -> bool:  # each worker wrote an event file (its name carries the pid): it is set up
            names = " ".join(p.name for p in (tmp_path / "out").rglob("*tfevents*"))
            return len(workers) == 2 and all(f".{pid}." in names for pid in workers)

        def started() -> bool:
            workers[:] = _children(proc.pid)
            return writing() or proc.poll() is not None

        wait_until(started, 30, "the replay's workers to start writing", every=0.005)  # stop them before they end
        assert writing(), f"the replay's workers did not start writing: {workers}, exit {proc.poll()}"
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        proc.kill()
        proc.wait(timeout=30)
        wait_until(lambda: not any(map(_alive, workers)), 10, "the workers to end with their replay")
        again = replay_with(tree, tmp_path / "out", "--jobs", "2")
        assert again.returncode == 0, again.stderr
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_every_rank_shows_what_its_log_says(tmp_path: Path) -> None:
    """Not just what one process writes: right. Rank 0 shows steps 1-250 once, the resumed values
    from step 200 on; rank 3 ends at 250; rank 2's NaN is there."""
    logs = build(tmp_path / "logs")
    out = tmp_path / "out"
    assert replay(tmp_path / "logs" / "output", out, 2).returncode == 0
    for log in logs:
        acc = EventAccumulator(str(out / f"rank_{log.rank}"), size_guidance={"scalars": 0})
        acc.Reload()
        shown = {e.step: e.value for e in acc.Scalars("loss")}
        assert sorted(shown) == sorted(log.expected), log.rank
        assert all(same_float32(shown[s], float(f"{v:f}")) for s, v in log.expected.items()), log.rank  # as printed
    assert sorted(logs[0].expected) == list(range(1, 251)) and max(logs[3].expected) == 250


def test_files_without_a_step_record_are_named_in_parallel_too(tmp_path: Path) -> None:
    """The warning for logs that are not mindformers' names the files the workers read."""
    for rank in (0, 1):
        log = tmp_path / "output" / "log" / f"rank_{rank}" / "info.log"
        log.parent.mkdir(parents=True)
        log.write_text("".join(f"hello world line {n}\n" for n in range(2000)))
    result = replay(tmp_path / "output", tmp_path / "out", 2)
    assert result.returncode == 0, result.stderr
    assert ("no mindformers step record was recognised in the 4000 line(s) read from "
            f"{tmp_path}/output/log/rank_0/info.log, {tmp_path}/output/log/rank_1/info.log;") in result.stderr
