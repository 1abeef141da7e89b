"""``batch-size``, ``B-samples-per-day`` and the ``*_vs_samples`` twins across a training resume,
read back with TensorBoard's loader (the values against mindformers' own are in test_real_logs)."""

from __future__ import annotations

from pathlib import Path

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
