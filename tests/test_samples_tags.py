"""``batch-size``, ``B-samples-per-day`` and the ``*_vs_samples`` twins across a training resume,
read back with TensorBoard's loader (the values against mindformers' own are in test_real_logs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from outputs import assert_same_outputs
from sidecar.cli import main
from tb_read import scalars

INFO = Path(__file__).parent / "fixtures" / "real" / "mf1.9-dp2" / "output" / "log" / "rank_0" / "info.log"
GBS = 4


def _replay(lines: list[str], tmp_path: Path) -> Path:
    log = tmp_path / "output" / "log" / "rank_0" / "info.log"
    log.parent.mkdir(parents=True)
    log.write_text("\n".join(lines) + "\n")
    out = tmp_path / "summary"
    assert main(["replay", str(tmp_path / "output"), "--out", str(out), "--quiet", "--no-aggregate"]) == 0
    return out / "rank_0"


def test_twins_survive_a_resume_that_purges_the_rank_run_from_the_resume_step(tmp_path: Path) -> None:
    lines = INFO.read_text().splitlines()
    at = {step: i for i, line in enumerate(lines) for step in (50, 120)
          if f"step:[{step - 100 * (step > 100):5d}/  100]" in line and f"Epoch:[{1 + (step > 100):3d}/" in line}
    # trained to step 120, then resumed from the checkpoint of step 49 (a day later)
    again = [line.replace("2026-11-29", "2026-11-30") for line in lines[at[50]:]]
    run = _replay(lines[: at[120] + 2] + again, tmp_path)

    shown = scalars(run)
    twins = scalars(run / "vs_samples")
    loss = shown["loss"]
    assert sorted(loss) == list(range(1, 201))
    # every twin is there, at step x GBS, with the value of its step in the current segment; in the
    # rank's run the resume marker at step 50 would have dropped the twins of steps 13..49
    assert twins["loss_vs_samples"] == {step * GBS: value for step, value in loss.items()}
    assert twins["learning-rate_vs_samples"] == {s * GBS: v for s, v in shown["learning-rate"].items()}
    assert twins["batch-size_vs_samples"] == {s * GBS: float(GBS) for s in range(1, 201)}
    assert shown["batch-size"] == {s: float(GBS) for s in range(1, 201)}
    world = 2
    assert shown["B-samples-per-day"].keys() == shown["throughput"].keys()
    for step, value in shown["B-samples-per-day"].items():
        assert abs(value - shown["throughput"][step] * world * 86400 / 1e9) <= 1e-6 * value


def test_without_a_global_batch_size_in_the_log_there_are_no_batch_tags(tmp_path: Path) -> None:
    lines = [line for line in INFO.read_text().splitlines() if "global_batch_size = " not in line]
    run = _replay(lines, tmp_path)
    shown = scalars(run)
    assert len(shown["loss"]) == 200
    assert "batch-size" not in shown and "B-samples-per-day" not in shown
    assert not (run / "vs_samples").exists()


def test_a_restart_with_the_start_up_lines_gone_keeps_writing_them(tmp_path: Path) -> None:
    lines = INFO.read_text().splitlines()
    half = next(i for i, line in enumerate(lines) if "step:[  100/  100]" in line) + 2
    log = tmp_path / "output" / "log" / "rank_0" / "info.log"
    log.parent.mkdir(parents=True)
    log.write_text("\n".join(lines[:half]) + "\n")
    out = tmp_path / "summary"
    args = ["replay", str(tmp_path / "output"), "--out", str(out), "--quiet", "--no-aggregate"]
    assert main(args) == 0
    log.unlink()  # the job went on, its log rotated and the backup with the start-up lines deleted
    log.write_text("\n".join(lines[half:]) + "\n")
    assert main(args) == 0
    shown = scalars(out / "rank_0")
    assert shown["batch-size"] == {s: float(GBS) for s in range(1, 201)}
    assert sorted(scalars(out / "rank_0" / "vs_samples")["loss_vs_samples"]) == [GBS * s for s in range(1, 201)]


KILLED_AFTER_THE_RESUMED_RANK_RUN = """\
import os, sys
from sidecar.output import event_file
from sidecar.cli import main

flush = event_file.EventFileWriter.flush

def flush_then_die(self):
    # SIGKILL right after the rank run's file that holds the resume reached the kernel: whatever
    # another run still buffers is lost, as when a kill lands between two writers' flushes.
    flush(self)
    if self.path.parent.name == "rank_0" and len(event_file.event_files(self.path.parent)) > 1:
        os._exit(9)

event_file.EventFileWriter.flush = flush_then_die
sys.exit(main(sys.argv[1:]))
"""


def test_a_kill_after_the_rank_run_reached_the_disk_leaves_its_twins_whole(tmp_path: Path) -> None:
    """Trained to step 120, resumed from step 49. The sidecar dies (``os._exit``) right after the
    rank run's file that holds the resume was handed to the kernel; the restart reads the log again
    and must show, in the twins' run too, what one uninterrupted replay shows. Before, the twins'
    run flushed after the rank run: the kill left it without the resume's START and the resumed
    twins, and the restart, reading the resumed steps as ones the rank run shows, never wrote them
    (found by the model-based test in CI: loss_vs_samples kept the superseded values)."""
    lines = INFO.read_text().splitlines()
    at = {step: i for i, line in enumerate(lines) for step in (50, 120)
          if f"step:[{step - 100 * (step > 100):5d}/  100]" in line and f"Epoch:[{1 + (step > 100):3d}/" in line}
    log = tmp_path / "output" / "log" / "rank_0" / "info.log"
    log.parent.mkdir(parents=True)
    log.write_text("\n".join(lines[: at[120] + 2] + [x.replace("2026-11-29", "2026-11-30") for x in lines[at[50]:]]) + "\n")
    out, whole = tmp_path / "summary", tmp_path / "whole"
    replay = ["replay", str(tmp_path / "output"), "--quiet", "--no-aggregate", "--instance", "test"]
    killed = subprocess.run([sys.executable, "-c", KILLED_AFTER_THE_RESUMED_RANK_RUN, *replay, "--out", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == 9, killed.stderr
    assert len(list((out / "rank_0").glob("events.out.tfevents.*"))) > 1  # the resumed file is on disk
    assert main([*replay, "--out", str(out)]) == 0
    assert main([*replay, "--out", str(whole)]) == 0
    assert_same_outputs(whole, out)
