"""``--watch -``: a stream on standard input (``kubectl logs -f POD | mstb-sidecar --watch - ...``).

The oracle is a ``replay`` of the same bytes as a file: a real msrun job's two worker logs,
interleaved as ``tail -f`` shows them (its ``==> worker_N.log <==`` headers label the ranks), piped
in at a trainer's pace, must give the same runs (every rank's every tag at every step, the
aggregate, the metadata); the end of the stream ends the run with status 0; a restart after
SIGKILL fed the whole stream again (as ``kubectl logs -f`` does) writes nothing twice and loses
nothing.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from live_helpers import paced, wait_until
from outputs import compare
from tb_read import raw_points, scalars

WORKERS = Path(__file__).parent / "fixtures" / "real" / "mf1.9-dp2" / "output" / "msrun_log"
STATE = ".mstb-sidecar"


def tail_f_stream() -> bytes:
    """Both worker logs merged as ``tail -f output/msrun_log/worker_*.log`` prints them while the
    job runs: each rank's lines in order, the two advancing together, a header at each switch."""
    logs = {rank: (WORKERS / f"worker_{rank}.log").read_bytes().splitlines(keepends=True) for rank in (0, 1)}
    at = {rank: 0 for rank in logs}
    out, last = [], None
    while any(at[r] < len(logs[r]) for r in logs):
        rank = min((r for r in logs if at[r] < len(logs[r])), key=lambda r: (at[r] / len(logs[r]), r))
        if rank != last:
            out.append(b"\n==> output/msrun_log/worker_%d.log <==\n" % rank)
            last = rank
        take = logs[rank][at[rank]: at[rank] + 7]
        at[rank] += len(take)
        out += take
    return b"".join(out)


_started: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_sidecar_left() -> Iterator[None]:
    """A test that failed midway leaves no sidecar behind (the old code waits for ``-`` forever)."""
    yield
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def sidecar(out: Path, *args: str) -> subprocess.Popen:
    _started.append(proc := subprocess.Popen([sys.executable, "-m", "sidecar.cli", "--watch", "-", "--out", str(out),
                                              "--instance", "n", "--status-interval", "0", *args],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return proc


def feed(proc: subprocess.Popen, data: bytes, pieces: int = 40) -> None:
    """``data`` in ``pieces`` writes, cut anywhere (mid-line too), as a trainer's output comes; a
    sidecar that does not read its standard input fails this rather than hanging the test."""
    assert proc.stdin is not None
    fd = proc.stdin.fileno()
    os.set_blocking(fd, False)
    size = -(-len(data) // pieces)
    for start in paced(range(0, len(data), size), 0.02):
        piece = memoryview(data)[start: start + size]
        deadline = time.monotonic() + 30
        while piece:
            assert select.select([], [fd], [], max(0.0, deadline - time.monotonic()))[1], "standard input is not read"
            piece = piece[os.write(fd, piece):]


def finish(proc: subprocess.Popen) -> str:
    """Close the stream; the sidecar must end by itself, with status 0. Its stderr."""
    _, err = proc.communicate(timeout=60)  # closes its standard input first
    text = err.decode()
    assert proc.returncode == 0, text
    assert "Traceback" not in text
    return text


def replay(data: bytes, tmp_path: Path, *args: str) -> Path:
    """The oracle: the same bytes as a file, replayed."""
    log, out = tmp_path / "stream.log", tmp_path / "expected"
    log.write_bytes(data)
    done = subprocess.run([sys.executable, "-m", "sidecar.cli", "replay", str(log), "--out", str(out), "--instance", "n",
                           "-q", "--no-progress", *args], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    return out


def test_a_tail_f_stream_gives_the_runs_a_replay_of_the_same_bytes_gives(tmp_path: Path) -> None:
    data = tail_f_stream()
    proc = sidecar(tmp_path / "live")
    feed(proc, data)
    err = finish(proc)
    assert "standard input ended; stopping" in err
    assert "stopped: following 1 file(s), 2 rank(s), last step 200 (rank 0-1)" in err
    expected = replay(data, tmp_path)
    assert compare(expected, tmp_path / "live") == []
    losses = {rank: scalars(tmp_path / "live" / f"rank_{rank}")["loss"] for rank in (0, 1)}
    assert sorted(losses[0]) == sorted(losses[1]) == list(range(1, 201))
    assert losses[0][1] != losses[1][1]  # two ranks, not one rank twice
    assert list((tmp_path / "live" / STATE).glob("state-*.json"))  # checkpoint saved at the end


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_stopped_then_the_whole_stream_again_writes_nothing_twice_and_loses_nothing(stop: int, tmp_path: Path) -> None:
    data = tail_f_stream()
    live = tmp_path / "live"
    proc = sidecar(live, "--checkpoint-interval", "0.1")
    try:
        feed(proc, data[: len(data) // 2], pieces=20)
        # killed once a checkpoint holds the stream's state (its chain: where each rank was)
        wait_until(lambda: len(scalars(live / "rank_1").get("loss", {})) >= 50
                   and list((live / STATE).glob("state-*.json")), 30, "steps written and checkpointed")

        def checkpointed_after_the_steps() -> bool:
            runs = [f.stat().st_mtime_ns for rank in (0, 1) for f in (live / f"rank_{rank}").glob("*tfevents*")]
            return next((live / STATE).glob("state-*.json")).stat().st_mtime_ns >= max(runs)

        wait_until(checkpointed_after_the_steps, 10, "a checkpoint after the steps written")
    finally:
        proc.send_signal(stop)
        proc.communicate(timeout=30)
    assert proc.returncode == (0 if stop == signal.SIGTERM else -signal.SIGKILL)
    before = {rank: len(scalars(live / f"rank_{rank}")["loss"]) for rank in (0, 1)}
    assert 0 < before[1] < 200
    again = sidecar(live)
    feed(again, data)  # kubectl logs -f starts at the pod's first line again
    err = finish(again)
    diffs = compare(replay(data, tmp_path), live)
    if stop == signal.SIGTERM:
        # The stop released the head a rank held for its bar (a stream is not read again): its run
        # gets the bar's throughput when the stream brings it again, the aggregate step written
        # by then does not. That one step's throughput is the only difference allowed.
        diffs = [d for d in diffs if not (d.startswith("aggregate/n ") and "throughput" in d and " at 1 steps" in d)]
    assert diffs == []
    for rank in (0, 1):
        assert max(raw_points(live / f"rank_{rank}").values()) == 1  # no (tag, step) twice in the files
    stop = next(line for line in err.splitlines() if "stopped:" in line)
    duplicates = int(stop.split(" duplicate")[0].rsplit(" ", 1)[1])
    assert duplicates >= sum(before.values()), stop  # every step read again was counted, none written


def test_an_unlabelled_stream_takes_the_rank_option(tmp_path: Path) -> None:
    data = (WORKERS / "worker_1.log").read_bytes()
    proc = sidecar(tmp_path / "live", "--rank", "3")
    feed(proc, data, pieces=10)
    finish(proc)
    assert sorted(p.name for p in (tmp_path / "live").iterdir() if p.name.startswith("rank_")) == ["rank_3"]
    assert compare(replay(data, tmp_path, "--rank", "3"), tmp_path / "live") == []
    assert len(scalars(tmp_path / "live" / "rank_3")["loss"]) == 200


def test_a_partial_last_line_at_the_end_is_counted_malformed(tmp_path: Path) -> None:
    data = (WORKERS / "worker_0.log").read_bytes()
    cut = data.rindex(b"loss:[")  # the last step's line, cut in its loss
    proc = sidecar(tmp_path / "live")
    feed(proc, data[: cut + 8], pieces=5)
    err = finish(proc)
    assert "<stdin> ends in an unfinished line" in err
    stop = next(line for line in err.splitlines() if "stopped:" in line)
    assert "1 malformed" in stop, stop
    losses = scalars(tmp_path / "live" / "rank_0")["loss"]
    assert 199 in losses and 200 not in losses  # a cut number is no value


@pytest.mark.parametrize("garbage", [os.urandom(300_000), b"\x00\x01\x02" * 100_000, b"x" * 3_000_000 + b"\n"],
                         ids=["random", "binary", "one-long-line"])
def test_garbage_on_standard_input_ends_cleanly(garbage: bytes, tmp_path: Path) -> None:
    proc = sidecar(tmp_path / "live")
    feed(proc, garbage, pieces=10)
    err = finish(proc)
    assert "stopped:" in err


@pytest.mark.parametrize("argv", [["--watch", "-", "-"], ["--watch", "-", "logs"], ["replay", "-"], ["check", "-"]],
                         ids=["twice", "with-a-path", "replay", "check"])
def test_misuse_of_standard_input_is_one_line_exit_2(argv: list[str], tmp_path: Path) -> None:
    out = [] if argv[0] == "check" else ["--out", str(tmp_path / "out")]
    done = subprocess.run([sys.executable, "-m", "sidecar.cli", *argv, *out],
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    assert done.returncode == 2
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1 and "standard input" in lines[0], lines
