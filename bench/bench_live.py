"""Live footprint of ``mstb-sidecar --watch``, today's tree against a baseline, side by side.

Why it exists: a sidecar runs next to training for days; its CPU per line read, how soon a
line reaches TensorBoard, what it costs when nothing happens and how fast it starts are what a
user pays for it. It measures; it asserts nothing (it is not a test).

What it does, in one invocation, for each contender (the current tree and ``--baseline``, a git
revision exported to a temp dir, or a source directory), alternating which goes first (and
for the current tree with ``--min-read-interval 0``, which reads every burst as it comes,
step 1 only: what batching the reads buys and what it costs in latency):

1. live: ``--ranks`` ranks each append one mindformers v1.9 step (the two-line record of
   :mod:`bench_replay` plus ``--noise`` INFO lines, one ``write`` per line as a logger does)
   ``--rate`` times a second for ``--seconds``; the daemon's CPU (the run time of all its
   threads, in nanoseconds from ``/proc/<pid>/task/*/schedstat``: ``/proc/<pid>/stat`` counts
   10 ms ticks, which is +-7% of a 20 s rep and rounds a one-second smoke run to 0) per 1,000
   lines appended, and the latency from the ``write`` of a step's last line to the moment rank
   0's event file holds its ``loss`` (a reader woken by inotify when the daemon writes there;
   TensorBoard reads the same bytes);
2. idle: ``--idle-files`` logs that do not grow, followed with inotify and with ``--poll``; the
   daemon's CPU over ``--idle-seconds``, ``--idle-after`` seconds after it has read them, as a
   share of one core;
3. startup: wall time of ``replay --help`` and of a replay of an empty directory (median).

Every daemon runs as ``python -m sidecar.cli`` with ``PYTHONPATH`` pointing at its source tree,
so both contenders use the same interpreter and libraries.

    .venv/bin/python bench/bench_live.py                  # ~4 min
    .venv/bin/python bench/bench_live.py --smoke          # a few seconds, figures meaningless
    .venv/bin/python bench/bench_live.py --baseline none  # the current tree only
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (requires-python): the same parser, which the test extra installs there
    import tomli as tomllib  # type: ignore[no-redef]

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
from bench_replay import BAR_CHAR, BT, CB, NOISE, _Clock, machine, table  # noqa: E402

BASELINE = "1fe7bd1"  # the last revision before issue 13's live changes


# -- contenders --------------------------------------------------------------------------------


@dataclass
class Contender:
    name: str
    src: Path  # the directory holding sidecar/ and parsers/
    deps: Path | None = None  # libraries it needs that this venv no longer has (see baseline_deps)
    args: tuple[str, ...] = ()  # options for every daemon of this contender

    def cmd(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "sidecar.cli", *args]

    def run_kw(self) -> dict[str, object]:
        """How to start it: ``-m`` puts the working directory first on ``sys.path``, so it is ``src`` too."""
        path = os.pathsep.join(str(p) for p in (self.src, self.deps) if p is not None)
        return {"env": {**os.environ, "PYTHONPATH": path}, "cwd": self.src}


def baseline_tree(spec: str, into: Path) -> Path | None:
    """The baseline's source tree: a directory as given, or ``git archive`` of a revision;
    ``None`` (with a note) when there is none or the revision is not in this clone."""
    if spec == "none":
        return None
    if Path(spec).is_dir():
        return Path(spec).resolve()
    archive = into / "baseline.tar"
    done = subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), spec], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"note: no baseline (git archive {spec}: {done.stderr.strip() or done.returncode})")
        return None
    target = into / "baseline"
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    return target


def _requirements(pyproject: Path) -> dict[str, str]:
    """Project name -> requirement, of a ``pyproject.toml``'s dependencies."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return {re.match(r"[A-Za-z0-9._-]+", req).group().lower(): req for req in deps}


def baseline_deps(base: Path, into: Path) -> Path | None:
    """The dependencies of the baseline that the current project dropped (1fe7bd1 used watchdog),
    installed with pip into a directory of their own; ``None`` when there are none."""
    ours = _requirements(REPO / "pyproject.toml")
    missing = [req for name, req in _requirements(base / "pyproject.toml").items() if name not in ours]
    if not missing:
        return None
    target = into / "baseline-deps"
    print(f"installing the baseline's own dependencies into {target}: {', '.join(missing)}", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target), *missing], check=True)
    return target


# -- the daemon --------------------------------------------------------------------------------


class Daemon:
    """``--watch root --out out`` as a subprocess: CPU from ``/proc``, ready when it says so."""

    def __init__(self, who: Contender, root: Path, out: Path, *extra: str) -> None:
        self.err = out.with_name(out.name + ".stderr")
        with open(self.err, "wb") as fh:
            self.proc = subprocess.Popen(who.cmd("--watch", str(root), "--out", str(out), *who.args, *extra),
                                         stdout=subprocess.DEVNULL, stderr=fh, **who.run_kw())

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while b"watching " not in self.err.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the daemon did not start:\n{self.err.read_text(errors='replace')[-2000:]}")
            time.sleep(0.02)

    def cpu(self) -> float:
        """CPU seconds of every live thread so far (the daemon's threads live as long as it does;
        one that has ended by now is skipped, not an error)."""
        total = 0
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except FileNotFoundError:
                continue
        return total / 1e9

    def settle(self, window: float = 1.0, timeout: float = 120.0) -> None:
        """Wait until the start-up reading is done: a ``window`` with no CPU to speak of, or two in a
        row that used about the same, under half a core (a polling daemon never gets to zero)."""
        deadline = time.monotonic() + timeout
        last = float("inf")
        while time.monotonic() < deadline:
            before = self.cpu()
            time.sleep(window)
            used = self.cpu() - before
            if used <= 0.02 or (used < 0.5 * window and abs(used - last) <= 0.25 * last + 0.02):
                return
            last = used

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.returncode != 0:
            sys.exit(f"the daemon exited {self.proc.returncode}:\n{self.err.read_text(errors='replace')[-2000:]}")


# -- the logs ----------------------------------------------------------------------------------


class RankLog:
    """One rank's ``info.log``, appended a line per ``write`` (as the logging module does)."""

    HEADER = ((1077, "training_process", ".........Model Compiling, Please Wait a Moment..........."),
              (1081, "training_process", ".........Starting Training Model.........."))

    def __init__(self, path: Path, rank: int, noise: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        self.clock = _Clock(1795946400.0 + 0.05 * rank)
        self.noise = noise
        self.step = 0
        self.lines = 0
        for ln, fn, msg in self.HEADER:
            self._line(BT, ln, fn, msg)

    def _line(self, src: str, ln: int, fn: str, msg: str) -> None:
        os.write(self.fd, f"[INFO] {self.clock.mf()} [{src}:{ln}] {fn}: {msg}\n".encode())
        self.lines += 1

    def next(self) -> float:
        """Append the next step (head, bar, then the noise lines); returns when its record was complete."""
        self.step += 1
        g = self.step
        self.clock.t += 0.05
        lr = 3e-5 * min(1.0, g / 200)
        self._line(CB, 733, "print_output_info",
                   f"{{ Epoch:[  1/  1], step:[{g:5d}/99999], loss: {4.2 - g * 1e-5:.6f}, per_step_time: 50ms, "
                   f"lr: {lr:.7g}, overflow cond: False, loss_scale: 1.0, global_norm: [1.2345678], "
                   f"train_throughput_per_npu: 195.000T")
        pct = g / 999.99
        self._line(CB, 753, "print_output_info",
                   f"  {pct:4.1f}% |{BAR_CHAR * int(pct / 2):<50}| 0.86000 samples/s/p  1:23:45 }}")
        written = time.monotonic()
        for j in range(self.noise):
            src, ln, fn, msg = NOISE[j % len(NOISE)]
            self._line(src, ln, fn, msg.format(lr=lr, half=lr / 2, g=g))
        return written

    def close(self) -> None:
        os.close(self.fd)


class LossWatcher(threading.Thread):
    """Notes when each step's ``loss`` first shows in a run's event files (read with the
    product's TFRecord reader; the daemon's own tests check the content independently).

    Woken by inotify when the daemon writes there, not by polling: a reader that looked every
    3 ms woke 333 times a second and used about 4% of a core, as much as the daemon it measures,
    on the same two cores (its CPU was not counted, but it took cores and caches from the
    daemon). It notices a write within the scheduler's wake-up time.
    """

    def __init__(self, run_dir: Path) -> None:
        super().__init__(daemon=True)
        from inotify_simple import INotify, flags
        from tensorboard.compat.proto import event_pb2

        from sidecar.output.tfrecord import iter_records

        self._event, self._records = event_pb2.Event, iter_records
        self.run_dir = run_dir
        self.seen: dict[int, float] = {}
        self._offsets: dict[Path, int] = {}
        self._halt = threading.Event()
        self._inotify = INotify()
        # The run directory appears with the daemon's first step: its parent is watched for it.
        self._inotify.add_watch(run_dir.parent, flags.CREATE | flags.MOVED_TO | flags.ONLYDIR)
        self._mask = flags.MODIFY | flags.CREATE | flags.MOVED_TO
        self._watching = False

    def run(self) -> None:
        while not self._halt.is_set():
            if not self._watching and self.run_dir.is_dir():
                self._inotify.add_watch(self.run_dir, self._mask)
                self._watching = True
            if self._watching:
                for path in sorted(self.run_dir.glob("events.out.tfevents.*")):
                    self._read(path)
            self._inotify.read(timeout=100)  # ms: the halt flag is looked at this often

    def _read(self, path: Path) -> None:
        with open(path, "rb") as fh:
            for record in self._records(fh, self._offsets.get(path, 0)):
                event = self._event.FromString(record.payload)
                if any(v.tag == "loss" for v in event.summary.value):
                    self.seen.setdefault(event.step, time.monotonic())
                self._offsets[path] = record.end

    def halt(self) -> None:
        self._halt.set()
        self.join(5)
        self._inotify.close()


# -- the measurements --------------------------------------------------------------------------


@dataclass
class Figures:
    cpu_per_1k: list[float] = field(default_factory=list)  # ms of CPU per 1,000 lines
    p50: list[float] = field(default_factory=list)  # ms
    p99: list[float] = field(default_factory=list)
    idle_inotify: list[float] = field(default_factory=list)  # % of a core
    idle_poll: list[float] = field(default_factory=list)
    help_s: list[float] = field(default_factory=list)
    empty_s: list[float] = field(default_factory=list)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def live(who: Contender, work: Path, a: argparse.Namespace) -> tuple[float, float, float]:
    """(ms CPU per 1,000 lines, p50 ms, p99 ms) at ``a.ranks`` x ``a.rate`` steps/s."""
    root, out = work / "live-in" / "output" / "log", work / "live-out"
    logs = [RankLog(root / f"rank_{r}" / "info.log", r, a.noise) for r in range(a.ranks)]
    daemon = Daemon(who, root, out)
    try:
        daemon.wait_ready()
        daemon.settle(a.settle)
        watcher = LossWatcher(out / "rank_0")
        watcher.start()
        written: dict[int, float] = {}
        lines0 = sum(log.lines for log in logs)
        cpu0 = daemon.cpu()
        period, next_at = 1.0 / a.rate, time.monotonic()
        end = next_at + a.seconds
        while next_at < end:
            for log in logs:
                at = log.next()
                if log is logs[0]:
                    written[log.step] = at
            next_at += period
            time.sleep(max(0.0, next_at - time.monotonic()))
        last = logs[0].step
        deadline = time.monotonic() + 30
        while last not in watcher.seen and time.monotonic() < deadline:
            time.sleep(0.01)
        cpu = daemon.cpu() - cpu0
        lines = sum(log.lines for log in logs) - lines0
        watcher.halt()
    finally:
        daemon.stop()
        for log in logs:
            log.close()
    lat = [watcher.seen[s] - t for s, t in written.items() if s in watcher.seen]
    if len(lat) < len(written):
        print(f"  WARNING: {who.name}: {len(written) - len(lat)} of {len(written)} steps never reached rank_0's events")
    shutil.rmtree(work / "live-in")
    shutil.rmtree(out)
    return cpu / lines * 1e6, pct(lat, 0.5) * 1000, pct(lat, 0.99) * 1000


def idle_tree(base: Path, files: int) -> Path:
    """``files`` rank logs holding a few steps each, not growing."""
    root = base / "output" / "log"
    for r in range(files):
        log = RankLog(root / f"rank_{r}" / "info.log", r, 0)
        for _ in range(3):
            log.next()
        log.close()
    return root


def idle(who: Contender, root: Path, work: Path, a: argparse.Namespace, *extra: str) -> float:
    """Share of one core (%) the daemon uses following ``root`` once it has read it."""
    out = work / "idle-out"
    daemon = Daemon(who, root, out, *extra)
    seconds = a.idle_seconds
    try:
        daemon.wait_ready()
        daemon.settle(a.settle)
        time.sleep(a.idle_after)  # idle means nothing happened for a while (polling backs off after 10 s)
        cpu0, t0 = daemon.cpu(), time.monotonic()
        time.sleep(seconds)
        share = (daemon.cpu() - cpu0) / (time.monotonic() - t0) * 100
    finally:
        daemon.stop()
    shutil.rmtree(out)
    return share


def startup(who: Contender, work: Path) -> tuple[float, float]:
    """Wall seconds of ``replay --help`` and of a replay of an empty directory."""
    empty = work / "empty"
    empty.mkdir(exist_ok=True)
    times = []
    for args in (("replay", "--help"), ("replay", str(empty), "--out", str(work / "empty-out"), "--quiet")):
        started = time.perf_counter()
        subprocess.run(who.cmd(*args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, **who.run_kw())
        times.append(time.perf_counter() - started)
    shutil.rmtree(work / "empty-out", ignore_errors=True)
    return times[0], times[1]


def measure(contenders: list[Contender], work: Path, a: argparse.Namespace) -> dict[str, Figures]:
    """Every figure of every contender; a contender with ``args`` (a variant of another) only live."""
    figures = {c.name: Figures() for c in contenders}
    t0 = time.perf_counter()
    idle_root = idle_tree(work / "idle-in", a.idle_files)
    print(f"idle input: {a.idle_files} logs (made in {time.perf_counter() - t0:.1f} s)", flush=True)
    for rep in range(a.reps):
        order = contenders if rep % 2 == 0 else contenders[::-1]
        for who in order:
            f = figures[who.name]
            cpu, p50, p99 = live(who, work, a)
            f.cpu_per_1k.append(cpu)
            f.p50.append(p50)
            f.p99.append(p99)
            print(f"  rep {rep + 1}/{a.reps} {who.name}: {cpu:.1f} ms CPU/1k lines, p50 {p50:.0f} ms, p99 {p99:.0f} ms",
                  flush=True)
            if who.args:
                continue
            f.idle_inotify.append(idle(who, idle_root, work, a))
            f.idle_poll.append(idle(who, idle_root, work, a, "--poll"))
            for _ in range(a.startups):
                h, e = startup(who, work)
                f.help_s.append(h)
                f.empty_s.append(e)
            print(f"  rep {rep + 1}/{a.reps} {who.name}: idle {f.idle_inotify[-1]:.2f}% (inotify) "
                  f"{f.idle_poll[-1]:.2f}% (poll)", flush=True)
    return figures


ROWS = (
    ("live CPU ms / 1,000 lines", "cpu_per_1k", "{:.1f}"),
    ("live latency p50 ms", "p50", "{:.0f}"),
    ("live latency p99 ms", "p99", "{:.0f}"),
    ("idle % core, inotify", "idle_inotify", "{:.2f}"),
    ("idle % core, --poll", "idle_poll", "{:.2f}"),
    ("startup s, replay --help", "help_s", "{:.3f}"),
    ("startup s, replay of empty dir", "empty_s", "{:.3f}"),
)


def report(figures: dict[str, Figures]) -> list[tuple[str, ...]]:
    """The table rows: median per contender ("-" where not measured), and each one / the baseline
    when there is a baseline."""
    names = list(figures)
    others = [n for n in names if n != "baseline"] if "baseline" in figures else []
    rows = [("live (median over reps)", *names, *(f"{n}/baseline" for n in others))]
    for label, attr, fmt in ROWS:
        med = {n: statistics.median(v) if (v := getattr(figures[n], attr)) else None for n in names}
        cells = ["-" if med[n] is None else fmt.format(med[n]) for n in names]
        base = med.get("baseline")
        cells += ["-" if med[n] is None or not base else f"{med[n] / base:.2f}" for n in others]
        rows.append((label, *cells))
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Benchmark the live daemon's footprint against a baseline revision.")
    p.add_argument("--baseline", default=BASELINE,
                   help=f"git revision or source directory to compare with (default {BASELINE}); 'none' to skip")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--rate", type=float, default=20.0, help="steps per second per rank")
    p.add_argument("--noise", type=int, default=4, help="non-metric lines per step")
    p.add_argument("--seconds", type=float, default=30.0, help="how long the ranks write")
    p.add_argument("--idle-files", type=int, default=1024)
    p.add_argument("--idle-seconds", type=float, default=10.0)
    p.add_argument("--idle-after", type=float, default=15.0,
                   help="seconds to wait, once a daemon has read the idle files, before measuring")
    p.add_argument("--startups", type=int, default=3, help="startup timings per contender and rep")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="tiny run that only checks the benchmark works")
    p.add_argument("--tmp", type=Path, help="where to put the temp dir (default: system temp)")
    a = p.parse_args(argv)
    a.settle = 1.0  # seconds per look while waiting for a daemon's start-up reading to end
    if a.smoke:
        a.ranks, a.seconds, a.idle_files, a.idle_seconds, a.idle_after, a.startups, a.reps, a.settle = \
            2, 1.0, 8, 0.3, 0.0, 1, 1, 0.2
    return a


def run(a: argparse.Namespace) -> list[tuple[str, ...]]:
    """Measure and print; returns the table's rows (for :mod:`run_all`)."""
    work = Path(tempfile.mkdtemp(prefix="mstb-bench-live-", dir=a.tmp))
    try:
        contenders = [Contender("current", REPO), Contender("every burst", REPO, args=("--min-read-interval", "0"))]
        base = baseline_tree(a.baseline, work)
        if base is not None:
            contenders.append(Contender("baseline", base, baseline_deps(base, work)))
        print(f"live: {a.ranks} ranks x {a.rate:g} steps/s x {a.seconds:g} s, {a.noise} noise lines/step; "
              f"baseline: {base or 'none'}", flush=True)
        rows = report(measure(contenders, work, a))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(rows))
    print(machine())
    return rows


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
