"""A torn line before a resume: the relaunched job's first record is read, the torn one counted.

stdout is block-buffered: a job killed mid-write leaves half a line, and the job relaunched from
the checkpoint of step 40 appends right after it, so the torn head of step 51 and the head of
step 41 share one line. Step 41 must show the resumed job's value, the resume must be seen at
step 41 (not 42), and the torn head must be the one malformed line of the summary: in
``info.log`` (file prefix), ``worker_N.log`` (stdout prefix) and a combined stream labelled by
OpenMPI or srun, in replay and live, on the fast path and on the full one (``--rank-pattern``
sends every line there). A message that quotes a log line or a timestamp is not split.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from live_helpers import BIN, LiveEnv, raw_run, tb_points, wait_until
from parsers.torn import tears

pytest_plugins = ["live_helpers"]

_FILE = "[INFO] {ts} [mindformers/core/callback/callback.py:318] print_output_info: "
_STDOUT = "{ts} - mindformers[mindformers/core/callback/callback.py:318] - INFO - "
_HEAD = "{{ Epoch:[  1/  1], step:[{step:5d}/  100], loss: {loss:.6f}, per_step_time: 512ms, lr: 1e-05"
_BAR = "  5.2% |██                   | 0.86313 samples/s/p  2:26:41 }"
FORMATS = {  # name: (file under output/, prefix, label of rank 0, --rank-pattern or None)
    "info.log": ("log/rank_0/info.log", _FILE, "", None),
    "worker.log": ("msrun_log/worker_0.log", _STDOUT, "", None),
    "mpi": ("train.log", _STDOUT, "[1,0]<stdout>:", None),
    "srun": ("train.log", _STDOUT, "0: ", None),
    "full-path": ("train.log", _STDOUT, "R0| ", r"R(?P<rank>\d+)\| "),
}


def loss(step: int, attempt: int) -> float:
    return step + 0.5 * attempt


def _record(prefix: str, label: str, step: int, attempt: int, second: int) -> str:
    ts = f"2026-11-29 10:{second // 60 % 60:02d}:{second % 60:02d},{attempt:03d}"
    head = label + prefix.format(ts=ts) + _HEAD.format(step=step, loss=loss(step, attempt))
    return f"{head}\n{label}{prefix.format(ts=ts)}{_BAR}\n"


def torn_log(name: str) -> tuple[bytes, bytes]:
    """(steps 1-50 and the torn head of step 51, the resumed job's steps 41-60)."""
    _, prefix, label, _ = FORMATS[name]
    first = "".join(_record(prefix, label, step, 0, step) for step in range(1, 51))
    torn = _record(prefix, label, 51, 0, 51).split("loss:")[0] + "loss: 3.1"  # cut inside the head
    resumed = "".join(_record(prefix, label, step, 1, 100 + step) for step in range(41, 61))
    return (first + torn).encode(), resumed.encode()


def expected() -> dict[int, float]:
    return {step: loss(step, 0 if step <= 40 else 1) for step in range(1, 61)}


def _extra(name: str) -> list[str]:
    pattern = FORMATS[name][3]
    return ["--rank-pattern", pattern] if pattern else []


def _assert_resumed(out: Path) -> None:
    run = out / "rank_0"
    assert dict(tb_points(run)) == expected()
    assert [s for s in raw_run(run).starts if s] == [41], "the resume is seen at step 41 (0: the run's start)"


@pytest.mark.parametrize("name", FORMATS)
def test_replay_splits_a_torn_line_and_reads_the_resumed_step(tmp_path: Path, name: str) -> None:
    path = tmp_path / "output" / FORMATS[name][0]
    path.parent.mkdir(parents=True)
    before, after = torn_log(name)
    path.write_bytes(before + after)
    done = subprocess.run([str(BIN), "replay", str(path), "--out", str(tmp_path / "tb"), *_extra(name)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    _assert_resumed(tmp_path / "tb")
    assert re.search(r"\b1 malformed", done.stdout), done.stdout


@pytest.mark.parametrize("wake_mode", ["poll"])
@pytest.mark.parametrize("name", ["worker.log", "mpi", "full-path"])
def test_live_sidecar_splits_a_torn_line_written_by_a_relaunched_job(live: LiveEnv, name: str) -> None:
    path = live.output / FORMATS[name][0]
    path.parent.mkdir(parents=True, exist_ok=True)
    before, after = torn_log(name)
    sidecar = live.sidecar(*_extra(name))
    sidecar.watch = [path] if name in ("mpi", "full-path") else [live.output]
    path.write_bytes(before)  # the first job, killed mid-line
    sidecar.start()
    wait_until(lambda: 50 in dict(tb_points(live.out / "rank_0")), 15, "the first job's steps")
    with open(path, "ab") as fh:
        fh.write(after)  # the relaunched job, resumed from step 40
    wait_until(lambda: (60, loss(60, 1)) in tb_points(live.out / "rank_0"), 15, "the resumed job's steps")
    rc, _ = sidecar.stop()
    assert rc == 0 and "Traceback" not in sidecar.stderr(), sidecar.stderr()
    _assert_resumed(live.out)
    assert re.search(r"\b1 malformed", sidecar.stderr()), sidecar.stderr()


_TS = "2024-06-18 02:41:09,377"
_OWN = _FILE.format(ts=_TS)


@pytest.mark.parametrize("line", [
    _OWN + "{ Epoch:[  1/  1], step:[   41/  100], loss: 2.5",  # one whole line
    _OWN + f"resuming from the checkpoint written at {_TS}",  # a quoted timestamp alone
    _OWN + f"last line read: '{_OWN}{{ Epoch:[  1/  1]'",  # a quoted log line
    _OWN + f'the log ended with "{_STDOUT.format(ts=_TS)}Training Over!"',
    "[1,3]<stdout>:" + _STDOUT.format(ts=_TS) + "{ Epoch:[  1/  1]",  # a label before the line's own prefix
    " 3: " + _STDOUT.format(ts=_TS) + "{ Epoch:[  1/  1]",
])
def test_a_whole_line_is_not_torn(line: str) -> None:
    assert tears(line.encode()) == []


@pytest.mark.parametrize("torn, at", [
    (_OWN + "{ Epoch:[  1/  1], step:[   51/  1" + _OWN + "{ Epoch:", len(_OWN + "{ Epoch:[  1/  1], step:[   51/  1")),
    ("  5.2% |██   | 0.86" + _OWN + "{ Epoch:", len("  5.2% |██   | 0.86".encode())),  # a torn bar
    ("[1,0]<stdout>:" + _STDOUT.format(ts=_TS) + "{ Ep" + "[1,1]<stdout>:" + _STDOUT.format(ts=_TS),
     len("[1,0]<stdout>:" + _STDOUT.format(ts=_TS) + "{ Ep")),  # split before the next line's label
])
def test_a_torn_line_is_split_where_the_next_line_starts(torn: str, at: int) -> None:
    assert tears(torn.encode()) == [at]


@pytest.mark.parametrize("wake_mode", ["poll"])
def test_a_sidecar_killed_while_the_resumed_head_waits_for_its_bar_reads_it_once(live: LiveEnv) -> None:
    """The sidecar is SIGKILLed just after reading the torn line, whose rest is a head held for its
    bar (for the companion wait): wherever its last checkpoint is, the restart reads the torn
    line again from its first byte (a checkpoint never points inside a line) and step 41 is the
    resumed job's, with one resume."""
    name = "worker.log"
    path = live.output / FORMATS[name][0]
    path.parent.mkdir(parents=True, exist_ok=True)
    before, after = torn_log(name)
    head_41, rest = after.split(b"\n", 1)
    sidecar = live.sidecar("--checkpoint-interval", "0.05")
    path.write_bytes(before)
    sidecar.start()
    wait_until(lambda: 50 in dict(tb_points(live.out / "rank_0")), 15, "the first job's steps")
    with open(path, "ab") as fh:
        fh.write(head_41 + b"\n")  # its bar is not there yet
    wait_until(lambda: "holds the start of another" in sidecar.stderr(), 15, "the torn line to be read")
    sidecar.kill()
    with open(path, "ab") as fh:
        fh.write(rest)
    sidecar.start()
    wait_until(lambda: (60, loss(60, 1)) in tb_points(live.out / "rank_0"), 15, "the resumed job's steps")
    rc, _ = sidecar.stop()
    assert rc == 0 and "Traceback" not in sidecar.stderr(all_runs=True), sidecar.stderr(all_runs=True)
    _assert_resumed(live.out)
