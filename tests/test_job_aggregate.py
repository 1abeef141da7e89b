"""One aggregate for the whole job (issue 11, item 4): ``mstb-sidecar aggregate --out DIR`` over the rank
runs that one sidecar per node writes into a shared ``--out``.

Two "nodes" of real mindformers v1.9 logs (:class:`live_helpers.RankLog`, loss ``rank * 100000 + step``),
ranks 0-3 and 4-7, each followed by its own ``mstb-sidecar`` process; ``aggregate/job`` is read back with
TensorBoard's loaders: its ``loss/mean`` is the mean over all eight ranks at every step (ranks 4-7 only
under pipeline parallel, with the world size and stage count the logs state), after a SIGKILL of any of
the three processes too, with no step twice and none missing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from live_helpers import BIN, RankLog, Sidecar, wait_until
from outputs import newest_layout
from sidecar.analysis.job_aggregate import MISSING_TAG
from sidecar.analysis.parallel_layout import LAYOUT_TAG
from sidecar.output.event_file import EventFileWriter, event_files
from sidecar.output.run_follow import RunFollower
from tb_read import raw_points, scalars, texts
from tensorboardX.proto import event_pb2, summary_pb2

NODES = {"node0": range(0, 4), "node1": range(4, 8)}
_PARALLEL = ("[INFO] 2026-11-29 09:59:00,000 [mindformers/core/parallel_config.py:62] build_parallel_config: "
             "initial parallel_config from dict: {'data_parallel': 2, 'model_parallel': 2, 'context_parallel': 1, "
             "'expert_parallel': 1, 'pipeline_stage': 2, 'micro_batch_num': 4, 'use_seq_parallel': False}\n")
_PIPELINE = ("[WARNING] 2026-11-29 10:00:00,000 [mindformers/core/callback/callback.py:531] _fix_loss_for_parallel: "
             "pipeline stages: 2 > 1, the loss on the last card is valid.\n")


class AggregateProcess(Sidecar):
    """``mstb-sidecar aggregate --out OUT`` as a subprocess (stderr files under ``logs_dir``)."""

    @property
    def cmd(self) -> list[str]:
        return [str(BIN), "aggregate", "--out", str(self.out), "--poll-interval", "0.05", *self.extra]

    def start(self, wait_ready: bool = True) -> "AggregateProcess":
        super().start(wait_ready=False)
        wait_until(lambda: "aggregating" in self.stderr() or not self.running(), 20, "the job aggregate to start")
        assert self.running(), self.stderr()
        return self


class Job:
    """Two nodes' logs under ``root/<node>/output``, their sidecars and the job aggregate, one shared ``--out``."""

    def __init__(self, root: Path, header: str = "", before_step: str = "") -> None:
        self.root = root
        self.out = root / "tb"
        self.before_step = before_step
        self.logs = {rank: RankLog(root / node / "output" / "log" / f"rank_{rank}" / "info.log", rank)
                     for node, ranks in NODES.items() for rank in ranks}
        for log in self.logs.values():
            log.write(header.encode())
        self.procs: list[Sidecar] = []

    def steps(self, count: int, ranks: range = range(8)) -> None:
        for _ in range(count):
            for rank in ranks:
                log = self.logs[rank]
                log.write(self.before_step.encode() + log.take())

    def node(self, name: str, *extra: str) -> Sidecar:
        proc = Sidecar([self.root / name / "output"], self.out, "inotify", self._dir(name), "--instance", name, *extra)
        self.procs.append(proc)
        return proc

    def aggregate(self, *extra: str) -> AggregateProcess:
        proc = AggregateProcess([], self.out, "poll", self._dir("job"), *extra)
        self.procs.append(proc)
        return proc

    def replay(self, name: str) -> None:
        done = subprocess.run([str(BIN), "replay", str(self.root / name / "output"), "--out", str(self.out),
                               "--instance", name, "-q"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr

    def _dir(self, name: str) -> Path:
        path = self.root / f"stderr-{name}"
        path.mkdir(exist_ok=True)
        return path

    def mean(self, tag: str = "loss/mean") -> dict[int, float]:
        run = self.out / "aggregate" / "job"
        return scalars(run).get(tag, {}) if run.is_dir() else {}

    def cleanup(self) -> None:
        for proc in self.procs:
            proc.cleanup()


@pytest.fixture
def job(tmp_path: Path):
    made: list[Job] = []

    def make(**kwargs: str) -> Job:
        made.append(Job(tmp_path, **kwargs))
        return made[-1]

    yield make
    for each in made:
        each.cleanup()


def _mean_of_all(steps: range) -> dict[int, float]:
    return {s: sum(r * 100_000 + s for r in range(8)) / 8 for s in steps}


@pytest.mark.parametrize("victim", ["node0", "node1", "job"])
def test_job_mean_over_all_ranks_also_after_a_sigkill(job, victim: str) -> None:
    """Two live node sidecars and the live job aggregate; ``victim`` is SIGKILLed while steps flow and
    restarted: every step of ``aggregate/job`` is the mean over ranks 0-7, once. Each checkpoints
    only at its first read, so the restarted one reads again what it had written after that."""
    j = job()
    j.steps(20)
    rare = ("--checkpoint-interval", "60")
    procs = {"node0": j.node("node0", *rare).start(), "node1": j.node("node1", *rare).start(),
             "job": j.aggregate("--aggregate-timeout", "600", *rare).start()}
    wait_until(lambda: len(j.mean()) == 20, 20, "20 job aggregate steps")
    second = subprocess.run([str(BIN), "aggregate", "--out", str(j.out)], capture_output=True, text=True, timeout=30)
    assert second.returncode == 2 and "already writes" in second.stderr and "instance job" in second.stderr
    j.steps(10)
    procs[victim].kill()
    j.steps(10)
    procs[victim].start()
    j.steps(10)
    wait_until(lambda: len(j.mean()) == 50, 30, "50 job aggregate steps")
    for proc in procs.values():
        rc, _ = proc.stop()
        assert rc == 0, proc.stderr()
    run = j.out / "aggregate" / "job"
    assert scalars(run)["loss/mean"] == _mean_of_all(range(1, 51))
    assert scalars(run)["iteration-time/mean"] == {s: 512.0 for s in range(1, 51)}
    counts = raw_points(run)
    assert {step for tag, step in counts if tag == "loss/mean"} == set(range(1, 51))
    assert max(counts.values()) == 1, "a step was written twice"
    stderr = procs["job"].stderr(all_runs=True)
    assert "Traceback" not in stderr and "without" not in stderr, stderr


def test_pipeline_parallel_job_mean_is_over_the_last_stage_once(job) -> None:
    """World 8 (dp 2 * mp 2 * pp 2, logged), 2 stages: the valid loss is on ranks 4-7, all on node 1.
    Node 0's own aggregate has no loss; the job aggregate (``--once``) averages ranks 4-7 only, and
    every rank for the timing. The layout reached it through the rank runs."""
    j = job(header=_PARALLEL, before_step=_PIPELINE)
    j.steps(12)
    j.replay("node0")
    j.replay("node1")
    assert not [tag for tag in scalars(j.out / "aggregate" / "node0") if tag.startswith("loss/")]
    assert list(texts(j.out / "rank_5")[LAYOUT_TAG]) == [1]  # once per run: the pipeline line repeats every step
    done = subprocess.run([str(BIN), "aggregate", "--out", str(j.out), "--once"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "read" in done.stdout and "8 rank run(s)" in done.stdout
    assert j.mean() == {s: sum(r * 100_000 + s for r in range(4, 8)) / 4 for s in range(1, 13)}
    assert j.mean("iteration-time/mean") == {s: 512.0 for s in range(1, 13)}
    charts = texts(j.out / "layout" / "job")["custom_scalars__config__"]  # the Custom Scalars tab's layout
    assert "loss/mean" in charts[max(charts)] and "iteration-time/mean" in charts[max(charts)]
    j.steps(3)  # more steps, replayed and aggregated again: only the new ones are added
    j.replay("node0")
    j.replay("node1")
    again = subprocess.run([str(BIN), "aggregate", "--out", str(j.out), "--once", "-q"], capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 0 and again.stdout == "", again.stderr
    assert j.mean() == {s: sum(r * 100_000 + s for r in range(4, 8)) / 4 for s in range(1, 16)}
    assert max(raw_points(j.out / "aggregate" / "job").values()) == 1


def test_a_dead_node_is_waited_for_marked_missing_and_picked_up_when_it_comes(job) -> None:
    """Node 1's sidecar has written nothing; the logs state world 8, so the job aggregate expects ranks
    4-7 and, after the timeout, writes each step over ranks 0-3 and names ranks 4-7 as missing in a
    text event. When node 1 comes late, its runs are found, and steps are again over all eight.
    Deleted under the live aggregate, ``aggregate/job`` is written again from the rank runs."""
    j = job(header=_PARALLEL)
    j.steps(10, range(0, 4))
    j.replay("node0")
    agg = j.aggregate("--aggregate-timeout", "2").start()
    wait_until(lambda: len(j.mean()) == 10, 20, "10 steps written without node 1")
    assert j.mean() == {s: sum(r * 100_000 + s for r in range(4)) / 4 for s in range(1, 11)}
    marks = texts(j.out / "aggregate" / "job")[MISSING_TAG]
    assert len(marks) == 1 and "rank(s) 4-7" in next(iter(marks.values())), marks
    assert "written without rank(s) 4-7" in agg.stderr()
    j.steps(5, range(0, 4))
    j.steps(15, range(4, 8))
    late = [subprocess.Popen([str(BIN), "replay", str(j.root / node / "output"), "--out", str(j.out), "--instance",
                              node, "-q"]) for node in NODES]
    assert [p.wait(timeout=120) for p in late] == [0, 0]
    wait_until(lambda: len(j.mean()) == 15, 20, "steps 11-15 over all ranks")
    assert {s: v for s, v in j.mean().items() if s > 10} == _mean_of_all(range(11, 16))
    marks = texts(j.out / "aggregate" / "job")[MISSING_TAG]
    assert len(marks) == 2 and "with every rank again" in marks[max(marks)], marks
    shutil.rmtree(j.out / "aggregate" / "job")  # deleted under it: written again from the rank runs, now complete
    wait_until(lambda: j.mean() == _mean_of_all(range(1, 16)), 20, "aggregate/job written again")
    rc, _ = agg.stop()
    assert rc == 0, agg.stderr()
    assert "aggregate/job was deleted; writing it again" in agg.stderr()
    assert max(raw_points(j.out / "aggregate" / "job").values()) == 1


def test_a_step_due_at_its_timeout_is_written_then_not_at_the_next_look(job) -> None:
    """Node 1 never writes; the job aggregate looks at the runs every 30 s but a step waits only
    1 s for it: the loop wakes when the oldest waiting step is due and writes it, and wakes again
    when the checkpoint that keeps it is due (2 s after the first; the layout gets the aggregate's
    band charts then), while nothing is read."""
    j = job(header=_PARALLEL)
    j.steps(3, range(0, 4))
    j.replay("node0")
    started = time.monotonic()
    agg = j.aggregate("--aggregate-timeout", "1", "--poll-interval", "30", "--checkpoint-interval", "2").start()
    wait_until(lambda: len(j.mean()) == 3, 10, "the steps written at their timeout, not at the next look (30 s)")
    assert time.monotonic() - started < 10
    wait_until(lambda: "loss (mean, min-max band)" in [c.title for cat in newest_layout(j.out / "layout" / "job").category
                                                       for c in cat.chart], 10, "the layout's band, at a checkpoint")
    rc, _ = agg.stop()
    assert rc == 0, agg.stderr()


def _once(j: Job) -> str:
    done = subprocess.run([str(BIN), "aggregate", "--out", str(j.out), "--once", "-q"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    return done.stderr


def test_a_training_resume_in_the_rank_runs_supersedes_the_job_aggregate_once(job) -> None:
    """Every rank goes back from step 10 to step 5 (a resume from a checkpoint, new values): the rank
    runs' START markers reach the job aggregate, which shows the new segment from step 5 on. The same
    resume is not applied again when it is read later: in the runs of a node that comes late, or in a
    run that was deleted and written anew."""
    j = job()
    j.steps(10)
    for log in j.logs.values():
        log.go_back(5)
    j.steps(11)
    j.replay("node0")
    assert _once(j) == ""
    mean = {s: sum(r * 100_000 + s for r in range(4)) / 4 + (0.25 if s >= 5 else 0.0) for s in range(1, 16)}
    assert j.mean() == mean
    j.steps(3)
    j.replay("node0")
    j.replay("node1")  # late: its runs hold the resume at step 5 too
    _once(j)
    assert j.mean() == {**mean, **{s: v + 0.25 for s, v in _mean_of_all(range(16, 19)).items()}}
    shutil.rmtree(j.out / "rank_5")  # deleted: node 1's sidecar writes it anew, resume included
    (j.out / ".mstb-sidecar" / "state-node1.json").unlink()
    j.replay("node1")
    assert "rank_5 was deleted" in _once(j)
    assert j.mean() == {**mean, **{s: v + 0.25 for s, v in _mean_of_all(range(16, 19)).items()}}
    assert list(texts(j.out / "aggregate" / "job")["events/resume"]) == [5]
    assert max(raw_points(j.out / "aggregate" / "job").values()) == 1


def test_a_partial_last_record_waits_for_the_rest(tmp_path: Path) -> None:
    """A record still being written is not an error: it is read whole once its bytes are there."""
    writer = EventFileWriter(tmp_path / "src", 1.0)
    for step in (1, 2):
        writer.write(event_pb2.Event(step=step, wall_time=1.0, summary=summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag="loss", simple_value=float(step))])))
    writer.close()
    data = event_files(tmp_path / "src")[0].read_bytes()
    run = tmp_path / "run"
    run.mkdir()
    target = run / "events.out.tfevents.1.host.1.1.mstb"
    target.write_bytes(data[:-7])
    follower = RunFollower(run, {})
    assert [e.step for e in follower.read(100)] == [0, 1]  # file_version, step 1; step 2 is cut
    with open(target, "ab") as fh:
        fh.write(data[-7:])
    assert [e.step for e in follower.read(100)] == [2]
    assert follower.offsets == {target.name: len(data)}


def test_aggregate_needs_out(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "sidecar.cli", "aggregate", "--once"], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.strip() == "mstb-sidecar aggregate: error: --out DIR: required"
