"""Shared tools for the live-daemon reliability tests (``tests/test_live_*.py``).

- :class:`RankLog` writes real mindformers v1.9 two-line step records (head + progress bar) for
  one rank, with strictly increasing timestamps (unless the test jumps the clock) and a loss that
  encodes rank and step exactly (``rank * 100000 + step + 0.25 * segment``, exact in float32), and
  can rotate like ``RotatingFileHandler`` or logrotate's ``copytruncate``, rename under a writer
  that keeps its fd, truncate, delete and recreate.
- :func:`raw_run` decodes a run's event files with TensorBoard's own record loader (raw: every
  record, duplicates and START markers included); :func:`tb_points` reads the run with
  TensorBoard's ``EventAccumulator``, which applies the START-marker purge, i.e. what a user sees.
  :func:`assert_exactly_once` compares both with what was written.
- :class:`Sidecar` runs ``mstb-sidecar --watch ... --out ...`` as a subprocess and stops it with
  SIGTERM (timed) or SIGKILL; :class:`DiskWatcher` timestamps when each step reaches the disk.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import TypeVar

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

LOSS = "loss"
RESUME_TEXT_TAG = "events/resume"
MODES = ["inotify", "poll"]
_CALLBACK = "[mindformers/core/callback/callback.py:318] print_output_info:"
_BAR = "  5.2% |██                                                | 0.86313 samples/s/p  2:26:41 }"
BIN = Path(sys.executable).with_name("mstb-sidecar")


T = TypeVar("T")
_POLL_FIRST, _POLL_MOST = 0.005, 0.2  # the first pause between two looks, and the longest (doubling between)


def poll(look: Callable[[], T], done: Callable[[T], object], timeout: float,
         errors: tuple[type[BaseException], ...] = (), every: float | None = None) -> tuple[bool, T | None]:
    """``look()`` until ``done`` of what it returns, for at most ``timeout`` seconds, the pause
    between looks doubling from 5 ms to 0.2 s (quick when the condition comes soon, cheap when it
    takes long), or ``every`` seconds when a moment must not be missed. ``errors`` raised by
    ``look`` count as not yet. Returns (done?, the last look)."""
    deadline, pause = time.monotonic() + timeout, every or _POLL_FIRST
    value: T | None = None
    while True:
        try:
            value = look()
            if done(value):
                return True, value
        except errors:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            return False, value
        time.sleep(min(pause, left))
        pause = pause if every else min(2 * pause, _POLL_MOST)


def wait_until(cond: Callable[[], object], timeout: float, what: str, every: float | None = None) -> object:
    """Until ``cond()`` is truthy (returned); else fail after ``timeout`` seconds, naming ``what``
    and the last answer. ``every``: as for :func:`poll`."""
    ok, value = poll(cond, bool, timeout, every=every)
    if not ok:
        raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what} (last: {_short(value)})")
    return value


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 300 else text[:300] + "..."


def fetch(url: str, timeout: float = 5) -> tuple[int, str]:
    """GET ``url``: (status, body), an HTTP error status included; a refused connection raises OSError."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def fetch_until(url: str, done: Callable[[tuple[int, str]], object], timeout: float, what: str) -> tuple[int, str]:
    """GET ``url`` until ``done((status, body))`` (a server not answering yet is not done); fail
    after ``timeout`` seconds, naming ``what`` and the last answer."""
    ok, answer = poll(lambda: fetch(url), done, timeout, (OSError,))
    if not ok:
        raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what} from {url} (last: {_short(answer)})")
    assert answer is not None
    return answer


def paced(items: Iterable[T], every: float) -> Iterator[T]:
    """``items``, ``every`` seconds apart: a writer's pace (pieces of a line, steps of a trainer),
    where the pace is the behaviour under test. Not a way to wait for the sidecar."""
    for i, item in enumerate(items):
        if i:
            time.sleep(every)
        yield item


def loss_value(rank: int, step: int, segment: int = 0) -> float:
    return rank * 100000 + step + 0.25 * segment


# -- writing logs -------------------------------------------------------------------------------
class RankLog:
    """Appends mindformers v1.9 step records for one rank to ``path`` (an ``O_APPEND`` fd)."""

    def __init__(self, path: Path, rank: int, start: datetime | None = None,
                 loss_of: Callable[[int], float] | None = None) -> None:
        self.path = path
        self.rank = rank
        self.loss_of = loss_of  # step -> loss, instead of the rank-and-step code
        self.clock = start or datetime(2026, 11, 29, 10, 0, 0) + timedelta(minutes=rank)
        self.segment = 0
        self.next_step = 1
        self.expected: dict[int, float] = {}  # step -> loss TensorBoard should show
        self.written_at: dict[int, float] = {}  # step -> time.monotonic() after its write
        self.history: list[int] = []  # every step written, superseded segments included
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = self._open()

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)

    def _stamp(self) -> str:
        self.clock += timedelta(milliseconds=3)  # strictly increasing per rank, but for jump_clock
        return self.clock.strftime("%Y-%m-%d %H:%M:%S,") + f"{self.clock.microsecond // 1000:03d}"

    def record(self, step: int) -> bytes:
        """Head + bar lines of one step (the head is held by the sidecar until its bar)."""
        ts = self._stamp()
        loss = self.loss_of(step) if self.loss_of else loss_value(self.rank, step, self.segment)
        head = (
            f"[INFO] {ts} {_CALLBACK} {{ Epoch:[  1/  1], step:[{step:5d}/100000], loss: {loss:f}, "
            f"per_step_time: 512ms, lr: 1e-05, overflow cond: False, loss_scale: 1.0, global_norm: [0.5]\n"
        )
        bar = f"[INFO] {ts} {_CALLBACK} {_BAR}\n"
        self.expected[step] = loss
        self.history.append(step)
        return (head + bar).encode()

    def step(self, count: int = 1) -> None:
        """Write the next ``count`` steps (one write per step, like the logger)."""
        for _ in range(count):
            step = self.next_step
            self.write(self.take())
            self.written_at[step] = time.monotonic()

    def take(self) -> bytes:
        """The next step's bytes, counted as written; the caller writes them (e.g. in pieces)."""
        data = self.record(self.next_step)
        self.next_step += 1
        return data

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def say(self, message: str, level: str = "INFO", where: str = "[mindformers/trainer/base_trainer.py:1601] training_process:") -> None:
        """One more logger line (a lifecycle marker, an error) in the file handler's format."""
        self.write(f"[{level}] {self._stamp()} {where} {message}\n".encode())

    def go_back(self, step: int) -> None:
        """Training resumed from a checkpoint: the next step is ``step`` again, newer values."""
        self.segment += 1
        for s in [s for s in self.expected if s >= step]:
            del self.expected[s]
        self.next_step = step

    def jump_clock(self, delta: timedelta) -> None:
        """The host's wall clock is set by ``delta`` (NTP step, end of summer time): later
        lines carry timestamps that may be earlier than those before them."""
        self.clock += delta

    # -- file operations -------------------------------------------------------------------
    def rotate(self, backups: int = 5) -> None:
        """``RotatingFileHandler.doRollover``: shift ``.N`` backups, rename, open a new file."""
        self.shift(backups)
        self.reopen()

    def shift(self, backups: int = 5) -> None:
        """Rename the chain (``.4`` -> ``.5`` ... live -> ``.1``) but keep writing to the old fd."""
        self._shift_backups(backups)
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))

    def copytruncate(self, backups: int = 5) -> None:
        """logrotate's ``copytruncate``: shift the backups, copy the live file to ``.1``, truncate
        it in place; the writer keeps its ``O_APPEND`` fd. Nothing is written between the copy
        and the truncation (the caller is the only writer), so no line falls in that window."""
        self._shift_backups(backups)
        shutil.copyfile(self.path, self.path.with_name(f"{self.path.name}.1"))
        os.truncate(self.path, 0)

    def _shift_backups(self, backups: int) -> None:
        for i in range(backups - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))

    def reopen(self) -> None:
        os.close(self.fd)
        self.fd = self._open()

    def truncate(self) -> None:
        """In-place truncation (msrun reusing a log dir); the O_APPEND writer goes on at 0."""
        os.truncate(self.path, 0)

    def delete_and_recreate(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)
        self.fd = self._open()

    def close(self) -> None:
        os.close(self.fd)


class SteadyWriter:
    """A thread writing one step to every log ``rate`` times a second, optionally rotating the
    first log by rename every ``rotate_every`` seconds (with a short write to the renamed file)."""

    def __init__(self, logs: list[RankLog], rate: float, rotate_every: float | None = None) -> None:
        self.logs = logs
        self.rate = rate
        self.rotate_every = rotate_every
        self.rotations = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "SteadyWriter":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def write(self, rounds: int) -> None:
        """``rounds`` steps to every log at the writer's rate, in the calling thread."""
        self._run(rounds)

    def _run(self, rounds: float = float("inf")) -> None:
        period = 1.0 / self.rate
        next_at = time.monotonic()
        next_rotation = next_at + (self.rotate_every or float("inf"))
        while not self._stop.is_set() and rounds > 0:
            rounds -= 1
            for log in self.logs:
                log.step()
            if time.monotonic() >= next_rotation:
                self.logs[0].shift()
                self.logs[0].step()  # the trainer's last line before it reopens
                self.logs[0].reopen()
                self.rotations += 1
                next_rotation += self.rotate_every or float("inf")
            next_at += period
            self._stop.wait(max(0.0, next_at - time.monotonic()))


# -- reading event files ------------------------------------------------------------------------
@dataclass
class RawRun:
    """Every record of one run directory, in TensorBoard's file order (undecoded protos, so
    ``simple_value`` is as written, not migrated to tensors)."""

    points: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    starts: list[int] = field(default_factory=list)  # SessionLog.START steps


def event_files(run_dir: Path) -> list[Path]:
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.iterdir() if "tfevents" in p.name)


def raw_run(run_dir: Path, tag: str = LOSS) -> RawRun:
    run = RawRun()
    for path in event_files(run_dir):
        for event in LegacyEventFileLoader(str(path)).Load():
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                run.starts.append(event.step)
            for value in event.summary.value:
                if value.tag == tag:
                    run.points.append((event.step, value.simple_value))
    return run


def tb_points(run_dir: Path, tag: str = LOSS) -> list[tuple[int, float]]:
    """(step, value) as TensorBoard's Python loader shows them, after START-marker purges."""
    if not event_files(run_dir):
        return []
    acc = event_accumulator.EventAccumulator(str(run_dir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    if tag not in acc.Tags()[event_accumulator.SCALARS]:
        return []
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def tb_text_steps(run_dir: Path, tag: str) -> list[int]:
    """Steps of a text tag as TensorBoard's text plugin shows them. The legacy
    ``EventAccumulator`` never purges tensors on a START marker; the plugin accumulator that
    TensorBoard's Python loader really uses does (as the Rust loader's preemption does)."""
    if not event_files(run_dir):
        return []
    acc = plugin_event_accumulator.EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    if tag not in acc.Tags()["tensors"]:
        return []
    return [e.step for e in acc.Tensors(tag)]


def _diff(want: dict[int, float], got: list[tuple[int, float]]) -> str:
    got_steps = Counter(s for s, _ in got)
    missing = sorted(set(want) - set(got_steps))
    extra = sorted(set(got_steps) - set(want))
    twice = sorted(s for s, n in got_steps.items() if n > 1)
    wrong = sorted(s for s, v in got if s in want and v != want[s])
    return f"missing {missing[:20]} ({len(missing)}), extra {extra[:20]} ({len(extra)}), " \
           f"repeated {twice[:20]} ({len(twice)}), wrong values {wrong[:20]} ({len(wrong)})"


def assert_exactly_once(out: Path, logs: Iterable[RankLog]) -> None:
    """Every written step of every rank is in TensorBoard's view exactly once with its value,
    in increasing step order; and the raw event records hold each written line's step exactly
    once (a step is in them twice only when training really ran it twice, i.e. resumed)."""
    for log in logs:
        run_dir = out / f"rank_{log.rank}"
        view = tb_points(run_dir)
        steps = [s for s, _ in view]
        ok = dict(view) == log.expected and len(steps) == len(log.expected) and steps == sorted(steps)
        assert ok, f"rank {log.rank} TensorBoard view: {_diff(log.expected, view)}"
        raw = Counter(s for s, _ in raw_run(run_dir).points)
        want = Counter(log.history)
        assert raw == want, f"rank {log.rank} raw records: extra {sorted((raw - want).items())[:20]}, " \
                            f"missing {sorted((want - raw).items())[:20]}"


def all_written(out: Path, logs: Iterable[RankLog]) -> bool:
    """Has every expected (step, value) of every log reached its run's event files (raw)?
    Values matter: after a resume the old segment already holds the same steps."""
    for log in logs:
        got = set(raw_run(out / f"rank_{log.rank}").points)
        if not set(log.expected.items()) <= got:
            return False
    return True


def checkpointed(state: Path, paths: Iterable[Path]) -> bool:
    """Does the checkpoint ``state`` hold every file of ``paths`` read to its end (by identity,
    as the sidecar follows them), i.e. is nothing read left unsaved?"""
    try:
        held = {(f["dev"], f["ino"]): f["offset"] for f in json.loads(state.read_bytes())["files"]}
    except (OSError, ValueError, KeyError, TypeError):
        return False  # none yet
    for path in paths:
        st = path.stat()
        if held.get((st.st_dev, st.st_ino)) != st.st_size:
            return False
    return True


class DiskWatcher:
    """Background thread noting when each (rank, step) first appears in an event file.

    A tiny incremental TFRecord reader (length header, payload, CRC) per file, so polling every
    few ms stays cheap; it does not check CRCs, the oracle above does the real decoding.
    """

    def __init__(self, out: Path, ranks: Iterable[int], interval: float = 0.01) -> None:
        from tensorboard.compat.proto import event_pb2

        self._event = event_pb2.Event
        self.out = out
        self.ranks = list(ranks)
        self.interval = interval
        self.seen: dict[tuple[int, int], float] = {}
        self._offsets: dict[Path, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "DiskWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            for rank in self.ranks:
                for path in event_files(self.out / f"rank_{rank}"):
                    self._read(rank, path)
            self._stop.wait(self.interval)

    def _read(self, rank: int, path: Path) -> None:
        offset = self._offsets.get(path, 0)
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read()
        except FileNotFoundError:
            return
        now = time.monotonic()
        pos = 0
        while len(data) - pos >= 12:
            (length,) = struct.unpack_from("<Q", data, pos)
            end = pos + 12 + length + 4
            if end > len(data):
                break
            event = self._event.FromString(data[pos + 12 : pos + 12 + length])
            if any(v.tag == LOSS for v in event.summary.value):
                self.seen.setdefault((rank, event.step), now)
            pos = end
        self._offsets[path] = offset + pos

    def wait_all(self, logs: Iterable[RankLog], timeout: float) -> None:
        """Wait until every step written so far has been seen on disk."""
        logs = list(logs)
        wait_until(lambda: all((log.rank, s) in self.seen for log in logs for s in log.expected), timeout,
                   "every written step to reach the event files")

    def latencies(self, logs: Iterable[RankLog], since: float = 0.0, until: float = float("inf")) -> list[float]:
        """Append-to-disk delay of the steps written in [since, until]; unseen ones count as inf."""
        out = []
        for log in logs:
            for step, written in log.written_at.items():
                if since <= written <= until:
                    out.append(self.seen.get((log.rank, step), float("inf")) - written)
        return sorted(out)


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


# -- the daemon ---------------------------------------------------------------------------------
class Sidecar:
    """``mstb-sidecar --watch PATHS --out OUT`` as a subprocess, one stderr file per start."""

    def __init__(self, watch: list[Path], out: Path, mode: str, logs_dir: Path, *extra: str) -> None:
        self.watch = watch
        self.out = out
        self.mode = mode
        self.extra = list(extra)
        self.logs_dir = logs_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.started_at = 0.0
        self._stderr_path: Path | None = None

    @property
    def cmd(self) -> list[str]:
        cmd = [str(BIN), "--watch", *map(str, self.watch), "--out", str(self.out), "--instance", "test"]
        return cmd + (["--poll"] if self.mode == "poll" else []) + self.extra

    def start(self, wait_ready: bool = True) -> "Sidecar":
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        self._stderr_path = self.logs_dir / f"sidecar-{self.starts}.stderr"
        with open(self._stderr_path, "wb") as err:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        self.started_at = time.monotonic()
        if wait_ready:
            wait_until(lambda: "watching" in self.stderr() or self.proc.poll() is not None, 20, "the sidecar to start")
            assert self.proc.poll() is None, f"sidecar exited at start: {self.stderr()}"
        return self

    def stderr(self, all_runs: bool = False) -> str:
        if all_runs:
            return "".join(p.read_text(errors="replace") for p in sorted(self.logs_dir.glob("sidecar-*.stderr")))
        return self._stderr_path.read_text(errors="replace") if self._stderr_path else ""

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def caught_up(self, timeout: float = 10) -> None:
        """Until the loop has read what was written before this call. SIGUSR1 makes it log its
        status at the end of the round it lands in; that round may have read before the signal,
        the one after the first status line cannot have, so it takes two."""
        assert self.proc is not None
        for _ in range(2):
            said = self.stderr().count("status: ")
            self.proc.send_signal(signal.SIGUSR1)
            wait_until(lambda: self.stderr().count("status: ") > said or not self.running(), timeout,
                       "the sidecar's status line (a round of its loop)")
            assert self.running(), self.stderr()

    def idle(self, timeout: float = 10) -> None:
        """Until the loop has caught up and waits (its main thread sleeps), e.g. before testing
        that something ends the wait."""
        self.caught_up(timeout)
        assert self.proc is not None
        stat = Path(f"/proc/{self.proc.pid}/stat")
        wait_until(lambda: stat.read_text().rsplit(")", 1)[1].split()[0] == "S", timeout, "the sidecar to wait")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> tuple[int, float]:
        """Send ``sig`` and wait; returns (exit status, seconds it took)."""
        assert self.proc is not None
        started = time.monotonic()
        self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"sidecar did not exit within {timeout}s of signal {sig}") from None
        return rc, time.monotonic() - started

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def cleanup(self) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the sidecar's Prometheus endpoint (``--metrics-port``): (name, sorted labels
    but ``training_job``, which every series has) -> value; empty while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "training_job"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(port: int, name: str, **labels: str) -> float | None:
    """One sample of the endpoint, with exactly ``labels`` besides ``training_job``; or None."""
    return metrics(port).get((name, tuple(sorted(labels.items()))))


def mount(*args: str) -> None:
    """``mount ARGS``; skips the calling test where mounting is not allowed (not root, no
    privilege in a container)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8)")
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mount {' '.join(args)} failed: {done.stderr.strip()}")


def umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


# -- fixtures (a test module uses them with pytest_plugins = ["live_helpers"]) --------------------------------------
class LiveEnv:
    """One test's directories: logs under ``output/``, events in ``tb/``, sidecar stderr files."""

    def __init__(self, root: Path, mode: str) -> None:
        self.root = root
        self.mode = mode
        self.output = root / "output"
        self.out = root / "tb"
        (self.output / "log").mkdir(parents=True)
        self.sidecars: list[Sidecar] = []

    def info_log(self, rank: int) -> RankLog:
        return RankLog(self.output / "log" / f"rank_{rank}" / "info.log", rank)

    def worker_log(self, rank: int) -> RankLog:
        return RankLog(self.output / "msrun_log" / f"worker_{rank}.log", rank)

    def sidecar(self, *extra: str, out: Path | None = None) -> Sidecar:
        sidecar = Sidecar([self.output], out or self.out, self.mode, self.root, *extra)
        self.sidecars.append(sidecar)
        return sidecar

    def state_file(self, out: Path | None = None) -> Path:
        return (out or self.out) / ".mstb-sidecar" / "state-test.json"

    def finish(self, sidecar: Sidecar, logs: list[RankLog], timeout: float = 15) -> float:
        """Wait for every step, SIGTERM (exit 0), check exactly-once; returns the stop time."""
        wait_until(lambda: all_written(self.out, logs), timeout, "every step to be written")
        rc, took = sidecar.stop()
        assert rc == 0, sidecar.stderr()
        assert "Traceback" not in sidecar.stderr(all_runs=True)
        assert_exactly_once(self.out, logs)
        return took


@pytest.fixture(params=MODES)
def wake_mode(request: pytest.FixtureRequest) -> str:
    """inotify wake-ups or ``--poll``; a test that needs only one parametrizes ``wake_mode``."""
    return str(request.param)


@pytest.fixture
def live(tmp_path: Path, wake_mode: str) -> Iterable[LiveEnv]:
    env = LiveEnv(tmp_path, wake_mode)
    yield env
    for sidecar in env.sidecars:
        sidecar.cleanup()
