"""Sinks besides TensorBoard (:mod:`sidecar.output.sink`, :mod:`sidecar.output.tensorboard`): a sink
that keeps what it is handed only through the checkpoint (:mod:`recording_sink`) shows every point of
every tag of the event files, as TensorBoard reads them back (:func:`outputs.read_out`), exactly
once: through a replay, a second replay, and a live sidecar stopped, restarted with a long
checkpoint interval and killed after a training resume it had not checkpointed. Its health
reaches the status line, the summary and the metrics through the engine's snapshot."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

from prometheus_client.exposition import generate_latest

from live_helpers import tb_points, wait_until
from outputs import read_out, same_value
from recording_sink import RecordingSink
from sidecar.cli import main
from sidecar.engine import Engine, Settings
from sidecar.service.metrics import TrainingGauges, registry_for
from sidecar.service.report import summary
from sidecar.service.status import status_line

REAL = Path(__file__).parent / "fixtures" / "real" / "mf1.9-dp2" / "output" / "log"
DRIVER = Path(__file__).with_name("recording_sink.py")


def _shown(out: Path) -> dict[str, dict[str, dict[int, object]]]:
    """Every point of every run under ``out`` as TensorBoard shows it: run -> tag -> step -> value."""
    found: dict[str, dict[str, dict[int, object]]] = {}
    for run, output in read_out(out).items():
        tags = {tag: steps for tag, steps in {**output.scalars, **output.texts}.items() if steps}  # a START purged the others
        if tags:
            found[run] = tags
    return found


def _kept(points: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict[int, object]]]:
    """A sink's points, steps as numbers, without what a resume emptied."""
    kept = {run: {tag: {int(s): v for s, v in steps.items()} for tag, steps in tags.items() if steps}
            for run, tags in points.items()}
    return {run: tags for run, tags in kept.items() if tags}


def _f32(value: object) -> float:
    """As an event file stores it: a sink is handed the value read, TensorBoard shows its float32."""
    return struct.unpack("<f", struct.pack("<f", value))[0] if isinstance(value, float) else value  # type: ignore[return-value]


def _assert_same(shown: dict, sink: dict) -> None:
    assert sorted(sink) == sorted(shown)
    for run, tags in shown.items():
        assert sorted(sink[run]) == sorted(tags), run
        for tag, steps in tags.items():
            got = sink[run][tag]
            assert sorted(got) == sorted(steps), (run, tag)
            wrong = [s for s, v in steps.items()
                     if not (same_value(v, _f32(got[s])) if isinstance(v, float) else v == got[s])]
            assert not wrong, (run, tag, wrong[:5])


def test_a_replay_hands_a_sink_every_point_once_and_the_settings_of_each_run(tmp_path: Path) -> None:
    """``--jobs 2``: with a sink, the replay runs in one process (forked workers would each feed a
    copy of it), and what it is handed is what the runs show; a second replay restores it from the
    checkpoint and hands it nothing twice."""
    out = tmp_path / "tb"
    sink = RecordingSink()
    assert main(["replay", str(REAL), "--out", str(out), "--quiet", "--jobs", "2"], sinks=[sink]) == 0
    shown = _shown(out)
    assert {"rank_0", "rank_1"} <= set(shown) and any(run.startswith("aggregate") for run in shown)
    _assert_same(shown, _kept(sink.points))
    assert sink.twice == [] and sink.again == 0
    for run in ("rank_0", "rank_1"):
        assert sink.metas[run] == json.loads((out / run / "run.json").read_text())["settings"]
    again = RecordingSink()
    assert main(["replay", str(REAL), "--out", str(out), "--quiet"], sinks=[again]) == 0
    assert again.restored == [False, True] and again.twice == []  # the first replay started afresh
    _assert_same(shown, _kept(again.points))


def _start(logs: Path, out: Path, stderr: Path, *extra: str) -> subprocess.Popen[bytes]:
    with open(stderr, "ab") as err:
        proc = subprocess.Popen([sys.executable, str(DRIVER), "--watch", str(logs), "--out", str(out),
                                 "--instance", "test", "--poll", "--poll-interval", "0.05", *extra],
                                stdin=subprocess.DEVNULL, stdout=err, stderr=err)
    wait_until(lambda: "watching" in stderr.read_text(errors="replace") or proc.poll() is not None, 30,
               "the sidecar to start")
    assert proc.poll() is None, stderr.read_text(errors="replace")
    return proc


def _held(out: Path) -> int:
    """How far the checkpoint says rank 0's log was read (-1 before there is one)."""
    try:
        files = json.loads((out / ".mstb-sidecar" / "state-test.json").read_text())["files"]
    except (OSError, ValueError, KeyError):
        return -1
    return next((f["offset"] for f in files if f["path"].endswith("rank_0/info.log")), -1)


def test_a_live_sidecar_killed_after_a_resume_hands_the_sink_what_it_lost_again(tmp_path: Path) -> None:
    """Start, stop; restart with a checkpoint 600 s away, which is saved at the first read (steps
    11-20) and not after the resume that follows; SIGKILL; restart. The sink lost the resume and
    its steps with the kill, the runs did not: they are handed to it again (``again``), and it ends
    with what the runs show, each point once, with the resume and both runs' settings."""
    logs, out, stderr = tmp_path / "output" / "log", tmp_path / "tb", tmp_path / "sidecar.stderr"
    lines = (REAL / "rank_0" / "info.log").read_bytes().splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if b"print_output_info: { Epoch" in line)
    rank0 = logs / "rank_0" / "info.log"
    rank0.parent.mkdir(parents=True)
    rank0.write_bytes(b"".join(lines[:first + 20]))  # start-up lines and steps 1-10
    (logs / "rank_1").mkdir()
    (logs / "rank_1" / "info.log").write_bytes((REAL / "rank_1" / "info.log").read_bytes())
    run = out / "rank_0"

    proc = _start(logs, out, stderr, "--checkpoint-interval", "0.2")
    wait_until(lambda: len(tb_points(run)) == 10, 30, "steps 1-10")
    proc.terminate()
    assert proc.wait(30) == 0

    proc = _start(logs, out, stderr, "--checkpoint-interval", "600")
    with open(rank0, "ab") as fh:
        fh.write(b"".join(lines[first + 20:first + 40]))  # steps 11-20: read and checkpointed at once
    wait_until(lambda: _held(out) == rank0.stat().st_size, 30, "steps 11-20 checkpointed")
    with open(rank0, "ab") as fh:  # training went back to step 1 (a checkpoint reload), a day later
        fh.write(b"".join(lines[first:first + 10]).replace(b"2026-11-29", b"2026-11-30"))
    wait_until(lambda: [s for s, _ in tb_points(run)] == [1, 2, 3, 4, 5], 30, "the resumed steps on disk")
    proc.kill()
    proc.wait(30)

    proc = _start(logs, out, stderr)
    with open(rank0, "ab") as fh:
        fh.write(b"".join(lines[first + 10:first + 14]).replace(b"2026-11-29", b"2026-11-30"))
    wait_until(lambda: [s for s, _ in tb_points(run)] == [1, 2, 3, 4, 5, 6, 7], 30, "steps 6-7 after the restart")
    proc.terminate()
    assert proc.wait(30) == 0
    assert "Traceback" not in stderr.read_text(errors="replace")

    sink = json.loads((out / ".mstb-sidecar" / "state-test.json").read_text())["sinks"]["recording"]
    _assert_same(_shown(out), _kept(sink["points"]))
    assert sink["twice"] == []
    assert sink["restored"] == [False, True, True]
    assert sink["again"] > 0  # the resume's points, which the kill took from it
    assert ["rank_0", 1] in sink["resumes"]
    for name in ("rank_0", "rank_1"):
        assert sink["metas"][name] == json.loads((out / name / "run.json").read_text())["settings"]


def test_the_snapshot_reports_each_sink_in_the_status_line_the_summary_and_the_metrics(tmp_path: Path) -> None:
    """``Engine.progress()`` is what the service layer reads: a sink's health (here: the points it
    holds) is in the status line, the replay summary and ``mstb_sidecar_sink_health``, with the same count."""
    sink = RecordingSink()
    engine = Engine(Settings(out=tmp_path / "tb", roots=[REAL], sinks=[sink]))
    engine.scan()
    while engine.pump(1 << 20, 0.0):
        pass
    engine.end_of_input()
    engine.checkpoint()
    progress = engine.progress()
    held = sum(len(steps) for tags in sink.points.values() for steps in tags.values())
    assert held > 0 and progress.sinks["recording"] == {"points": held}
    runs = [writer.points_written for writer in engine.tensorboard.writers.values()]  # ranks, samples, aggregate
    assert progress.sinks["tensorboard"] == {"written": sum(runs)} and len(runs) > 2
    assert progress.written_here == {0, 1} and progress.ranks[1].last_step == 200
    assert status_line(progress, []).endswith(f", recording: {held} points")
    assert f"recording: {held} points" in summary(progress, 1.0)
    scraped = generate_latest(registry_for(engine, "job", TrainingGauges())[1]).decode()
    assert f'mstb_sidecar_sink_health{{reason="points",sink="recording",training_job="job"}} {float(held)}' in scraped
    engine.close()
