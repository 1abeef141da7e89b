"""Model-based randomized test of the live daemon and replay, in the spirit of Vector's file-source tests.

A Hypothesis state machine drives REAL files and a REAL ``mstb-sidecar`` process and compares what
TensorBoard shows with an in-memory oracle.

The system: two ranks, each a mindformers v1.9 ``output/log/rank_N/info.log`` written by
:class:`live_helpers.RankLog` (two-line step records, one ``write`` per record), and one
``--out`` directory that a live sidecar (``--watch output``, inotify or ``--poll``, short
intervals) or a ``replay`` run writes, one at a time, with the same instance name and so the same
checkpoint.

Rules (any order, any rank):

- ``append``: the rank logs ``count`` more steps;
- ``rotate_by_rename``: ``RotatingFileHandler.doRollover`` (``.4`` -> ``.5`` ... ``info.log`` -> ``.1``,
  reopen); ``rotate_by_copytruncate``: logrotate's ``copytruncate`` (shift, copy to ``.1``,
  truncate in place, with no write in between because the test is the writer);
- ``resume``: training goes back to an earlier step (a checkpoint reload) and logs on from there;
  the resumed values differ from the superseded ones (the loss encodes the segment);
- ``clock_jump``: the host's clock is set back 2 minutes (NTP) or an hour (end of summer
  time), or forward an hour. The position in the file is the order: the daemon must not care;
- ``start`` (live, inotify or poll), ``sigterm`` (must exit 0), ``sigkill``, ``pause`` (lets
  the sidecar get part way, so signals land at random moments), ``replay`` (reads everything
  once; checked at once);
- ``check``: waits for quiescence, then checks the invariant. Teardown checks it once more with a
  live sidecar, then stops it with SIGTERM.

Oracle: per rank, the records in the order they were written (the order of positions along the
rank's rotation chain), folded: a record whose step is not above the last one is a resume and
drops every point at or after its step; then every record sets its point. Timestamps play no part.

Invariant, at quiescence (the points match the oracle and the event files have stopped growing;
or they stopped growing without matching; or a timeout):

- TensorBoard's ``EventAccumulator`` shows, for ``loss`` in ``rank_0`` and ``rank_1``, exactly the
  oracle's steps with its values, and every other scalar tag at exactly those steps;
- the raw records (decoded one by one, TensorBoard's START purge applied) never hold a (tag, step)
  while an earlier point at that step or later is still visible: nothing twice, nothing out of order;
- ``--out`` holds no run other than the two ranks, the aggregate and the layout; no run ever prints
  a traceback.

Not modelled here (covered by ``test_live_*``): partial lines and a rotation between a head and its
bar, msrun's ``worker_N.log`` next to ``info.log``, in-place truncation by a new job, delete and
re-create, SIGHUP, the aggregate run's values and the ``events/resume`` texts. At most
``BACKUPS`` rotations of a rank happen between two passed checks: one more could push a file the
sidecar never read out of the chain, a loss that is the trainer's, not the sidecar's. Timing is
not controlled: a failure that depends on when the sidecar looked may not replay, and Hypothesis
then reports it as flaky.

Bounded for CI: the test runs 6 programs of up to 20 steps (about half a minute on two cores;
``MSTB_MODEL_EXAMPLES`` and ``MSTB_MODEL_STEPS`` search longer), with a fixed seed
(``derandomize``) and no example database, so every run tries the same programs. A failure prints its program, which also runs by
hand as printed (``LogsAndSidecar()`` works without a base directory). A run costs seconds, so
Hypothesis stops shrinking after five minutes and the printed program may keep useless steps;
the minimal programs found so far are in :data:`FOUND`, replayed on every run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, currently_in_test_context, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

from live_helpers import BIN, LOSS, RankLog, Sidecar, event_files, loss_value
from tb_read import scalars

RANKS = (0, 1)
BACKUPS = 5
INSTANCE = "test"  # the one Sidecar passes: live and replay share the checkpoint
SIDECAR_ARGS = ("--poll-interval", "0.05", "--rescan-interval", "0.1", "--checkpoint-interval", "0.2")
QUIET = 0.3  # s of unchanged event files that, with a matching view, make quiescence
STALLED = 5.0  # s of unchanged event files after which a mismatch is final (generous: a loaded CI host)
TIMEOUT = 20.0
RUNS = {"rank_0", "rank_1", "aggregate", "layout", ".mstb-sidecar"}

Points = dict[int, float]


def fold(records: list[tuple[int, float]]) -> Points:
    """What TensorBoard must show for one rank: its records in position order, a step that does
    not go up superseding every point from it on."""
    points: Points = {}
    for step, loss in records:
        if points and step <= max(points):
            points = {s: v for s, v in points.items() if s < step}
        points[step] = loss
    return points


def describe(want: Points, got: Points) -> str:
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    wrong = sorted(s for s in set(want) & set(got) if want[s] != got[s])
    return (f"missing steps {missing[:20]} ({len(missing)}), extra steps {extra[:20]} ({len(extra)}), "
            f"wrong values at {[(s, got[s], want[s]) for s in wrong[:10]]} ({len(wrong)}) [(step, shown, want)]")


def written_twice_or_out_of_order(run_dir: Path) -> list[tuple[str, int]]:
    """(tag, step) of each raw scalar record written while a point of that tag at that step or a
    later one was still visible, replaying the files as TensorBoard does: in name order, a
    ``SessionLog.START`` at step s dropping every point at or after s."""
    visible: dict[str, set[int]] = {}
    bad = []
    for path in event_files(run_dir):
        for event in LegacyEventFileLoader(str(path)).Load():
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                visible = {tag: {s for s in steps if s < event.step} for tag, steps in visible.items()}
            for value in event.summary.value:
                if not value.HasField("simple_value"):
                    continue
                steps = visible.setdefault(value.tag, set())
                if steps and event.step <= max(steps):
                    bad.append((value.tag, event.step))
                steps.add(event.step)
    return bad


class LogsAndSidecar(RuleBasedStateMachine):
    """Two ranks' logs, one sidecar, one oracle; see the module docstring."""

    def __init__(self, base: Path | None = None) -> None:
        """``base`` holds one directory per example; without it (replaying a printed failing
        program by hand) the system's temporary directory does."""
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="mstb-model-", dir=base))
        if currently_in_test_context():
            note(f"example directory: {self.root}")
        self.output = self.root / "output"
        self.out = self.root / "tb"
        self.logs = [RankLog(self.output / "log" / f"rank_{r}" / "info.log", r) for r in RANKS]
        self.records: dict[int, list[tuple[int, float]]] = {r: [] for r in RANKS}
        self.rotations_since_check = dict.fromkeys(RANKS, 0)
        self.sidecar = Sidecar([self.output], self.out, "inotify", self.root, *SIDECAR_ARGS)
        self.up = False

    # -- the trainer -----------------------------------------------------------------------------
    @rule(rank=st.sampled_from(RANKS), count=st.integers(1, 30))
    def append(self, rank: int, count: int) -> None:
        self.log_steps(rank, count)

    def log_steps(self, rank: int, count: int) -> None:
        """The rank logs its next ``count`` steps; the oracle notes each record as written."""
        log = self.logs[rank]
        for _ in range(count):
            self.records[rank].append((log.next_step, loss_value(rank, log.next_step, log.segment)))
            log.step()

    @precondition(lambda self: max(self.rotations_since_check.values()) < BACKUPS)
    @rule(rank=st.sampled_from(RANKS))
    def rotate_by_rename(self, rank: int) -> None:
        self.logs[rank].rotate(BACKUPS)
        self.rotations_since_check[rank] += 1

    @precondition(lambda self: max(self.rotations_since_check.values()) < BACKUPS)
    @rule(rank=st.sampled_from(RANKS))
    def rotate_by_copytruncate(self, rank: int) -> None:
        self.logs[rank].copytruncate(BACKUPS)
        self.rotations_since_check[rank] += 1

    @rule(rank=st.sampled_from(RANKS), back=st.integers(1, 40), count=st.integers(1, 30))
    def resume(self, rank: int, back: int, count: int) -> None:
        """Training reloads a checkpoint ``back`` steps ago and logs ``count`` steps from there."""
        log = self.logs[rank]
        log.go_back(max(1, log.next_step - back))
        self.log_steps(rank, count)

    @rule(rank=st.sampled_from(RANKS), minutes=st.sampled_from([-2, -60, 60]), count=st.integers(1, 30))
    def clock_jump(self, rank: int, minutes: int, count: int) -> None:
        """The host's clock is set while the rank trains; its next ``count`` steps carry the new time."""
        self.logs[rank].jump_clock(timedelta(minutes=minutes))
        self.log_steps(rank, count)

    # -- the sidecar -------------------------------------------------------------------------------
    @precondition(lambda self: not self.up)
    @rule(poll=st.booleans())
    def start(self, poll: bool) -> None:
        self.sidecar.mode = "poll" if poll else "inotify"
        self.sidecar.start()
        self.up = True

    @precondition(lambda self: self.up)
    @rule()
    def sigterm(self) -> None:
        self.assert_alive()
        rc, _ = self.sidecar.stop()
        self.up = False
        assert rc == 0, f"SIGTERM: exit {rc}: {self.sidecar.stderr()}"

    @precondition(lambda self: self.up)
    @rule()
    def sigkill(self) -> None:
        self.assert_alive()
        self.sidecar.kill()
        self.up = False

    @precondition(lambda self: self.up)
    @rule(seconds=st.sampled_from([0.02, 0.1, 0.3]))
    def pause(self, seconds: float) -> None:
        time.sleep(seconds)
        self.assert_alive()

    @precondition(lambda self: not self.up)
    @rule()
    def replay(self) -> None:
        cmd = [str(BIN), "replay", str(self.output), "--out", str(self.out), "--instance", INSTANCE,
               "--no-progress", "-q"]
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "Traceback" not in done.stderr, f"replay: exit {done.returncode}: {done.stderr}"
        self.verify()

    @precondition(lambda self: self.up)
    @rule()
    def check(self) -> None:
        self.wait_for_quiescence()
        self.assert_alive()
        self.verify()

    def assert_alive(self) -> None:
        assert self.sidecar.running(), f"the sidecar died: {self.sidecar.stderr()}"

    def teardown(self) -> None:
        """The last check, with a live sidecar, unless a rule already failed (not to mask its
        error). A failed example keeps its directory (logs, runs, sidecar stderr) for a post-mortem."""
        in_flight = sys.exc_info()[1]  # a rule's failure, or Hypothesis cutting the example short
        failed = isinstance(in_flight, Exception)
        try:
            if in_flight is None:
                if not self.up:
                    self.start(poll=False)
                self.check()
                self.sigterm()
                assert "Traceback" not in self.sidecar.stderr(all_runs=True), self.sidecar.stderr(all_runs=True)
        except Exception:
            failed = True
            raise
        finally:
            self.sidecar.cleanup()
            for log in self.logs:
                log.close()
            if not failed:
                shutil.rmtree(self.root, ignore_errors=True)

    # -- the invariant ------------------------------------------------------------------------------
    def oracle(self) -> dict[int, Points]:
        return {rank: fold(self.records[rank]) for rank in RANKS}

    def shown(self, rank: int) -> dict[str, Points]:
        run_dir = self.out / f"rank_{rank}"
        return scalars(run_dir) if event_files(run_dir) else {}

    def files_signature(self) -> tuple[tuple[str, int], ...]:
        return tuple((p.name, p.stat().st_size) for r in RANKS for p in event_files(self.out / f"rank_{r}"))

    def matches(self, want: dict[int, Points]) -> bool:
        try:
            return all(self.shown(rank).get(LOSS, {}) == want[rank] for rank in RANKS)
        except (AssertionError, FileNotFoundError):
            return False  # a step shown twice, or a file replaced while read: verify() says which

    def wait_for_quiescence(self) -> None:
        """Until the view matches the oracle and the files rest for QUIET s, or the files rest for
        STALLED s without a match (the sidecar has given up on something), or TIMEOUT."""
        want = self.oracle()
        deadline = time.monotonic() + TIMEOUT
        signature, since, matching = None, time.monotonic(), False
        while time.monotonic() < deadline:
            now_signature = self.files_signature()
            if now_signature != signature:
                signature, since, matching = now_signature, time.monotonic(), self.matches(want)
            rest = time.monotonic() - since
            if (matching and rest >= QUIET) or rest >= STALLED:
                return
            time.sleep(0.03)

    def verify(self) -> None:
        want = self.oracle()
        for rank in RANKS:
            shown = self.shown(rank)
            loss = shown.get(LOSS, {})
            assert loss == want[rank], f"rank {rank} loss as TensorBoard shows it: {describe(want[rank], loss)}"
            for tag, points in shown.items():
                assert set(points) == set(want[rank]), f"rank {rank} {tag}: {describe(want[rank], points)}"
            bad = written_twice_or_out_of_order(self.out / f"rank_{rank}")
            assert not bad, f"rank {rank}: raw records written twice or out of order: {bad[:20]} ({len(bad)})"
        runs = {p.name for p in self.out.iterdir()} if self.out.exists() else set()
        assert runs <= RUNS, f"unexpected runs in --out: {sorted(runs - RUNS)}"
        self.rotations_since_check = dict.fromkeys(RANKS, 0)


def _settings(examples: int, steps: int) -> settings:
    """Reproducible in CI: a fixed seed (derandomize), no example database. No "explain" phase:
    each run costs seconds, and the shrunk steps say more than the lines they ran."""
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=True,
                    database=None, phases=[Phase.explicit, Phase.generate, Phase.shrink],
                    suppress_health_check=[HealthCheck.too_slow])


# Minimal programs the machine found failing, shrunk by hand from Hypothesis' partly shrunk output
# (a run costs seconds, so its shrinker stops after five minutes). Replayed as they are in the
# default suite, since random generation may take long to meet them again. The clock ones failed
# before the sequencer stopped using timestamps as an order. Of the copytruncate ones, the first
# has no race (the pause lets the sidecar read everything); the other two need the copy to be made
# before the sidecar has read the tail, which they achieve nearly always (every run here).
Program = list[tuple[str, dict[str, object]]]
FOUND: dict[str, Program] = {
    "clock-back-2min-then-a-step-replay": [
        ("append", {"rank": 0, "count": 2}), ("clock_jump", {"rank": 0, "minutes": -2, "count": 1}), ("replay", {})],
    "clock-back-2min-then-a-step-live": [
        ("start", {"poll": False}), ("append", {"rank": 0, "count": 2}), ("check", {}),
        ("clock_jump", {"rank": 0, "minutes": -2, "count": 1}), ("check", {})],
    "clock-back-1h-then-a-resume": [
        ("append", {"rank": 0, "count": 5}), ("clock_jump", {"rank": 0, "minutes": -60, "count": 1}),
        ("resume", {"rank": 0, "back": 3, "count": 1}), ("replay", {})],
    "copytruncate-after-a-restart-nothing-unread-poll": [
        ("append", {"rank": 0, "count": 2}), ("replay", {}), ("start", {"poll": True}), ("pause", {"seconds": 0.3}),
        ("rotate_by_copytruncate", {"rank": 0}), ("append", {"rank": 0, "count": 1}), ("check", {})],
    "copytruncate-of-a-tail-unread-since-a-restart-inotify": [
        ("append", {"rank": 0, "count": 2}), ("replay", {}), ("append", {"rank": 0, "count": 2}),
        ("start", {"poll": False}), ("rotate_by_copytruncate", {"rank": 0}), ("append", {"rank": 0, "count": 1}),
        ("check", {})],
    "copytruncate-of-an-unread-tail-poll": [
        ("start", {"poll": True}), ("append", {"rank": 0, "count": 2}), ("rotate_by_copytruncate", {"rank": 0}),
        ("append", {"rank": 0, "count": 1}), ("check", {})],
}


@pytest.mark.parametrize("program", FOUND.values(), ids=FOUND.keys())
def test_programs_found_earlier(tmp_path: Path, program: Program) -> None:
    machine = LogsAndSidecar(tmp_path)
    try:
        for name, args in program:
            getattr(machine, name)(**args)
    finally:
        machine.teardown()


# The default suite runs 6 histories of up to 20 steps (about half a minute; the programs found
# earlier run too); a longer search, e.g. MSTB_MODEL_EXAMPLES=60 MSTB_MODEL_STEPS=40 (about ten
# minutes), runs the same test.
EXAMPLES = int(os.environ.get("MSTB_MODEL_EXAMPLES", "6"))
STEPS = int(os.environ.get("MSTB_MODEL_STEPS", "20"))


def test_random_histories_show_exactly_the_oracle(tmp_path: Path) -> None:
    run_state_machine_as_test(lambda: LogsAndSidecar(tmp_path), settings=_settings(examples=EXAMPLES, steps=STEPS))
