"""``--every N`` on a long replay: exactly the promised points, read back with TensorBoard's loader."""

from __future__ import annotations

import math
import time
from pathlib import Path

from sidecar.cli import main
from tb_read import scalars

STEPS = 9995  # the last step is not a multiple of 10
NAN_LOSS, INF_NORM = 4321, 777  # alerts raised here, and resolved at the next step
PREFIX = "[INFO] {ts} [mindformers/core/callback/callback.py:{line}] print_output_info: "
HEAD = ("{{ Epoch:[  1/  1], step:[{step:5d}/{steps:5d}], loss:[{loss}/{loss}], per_step_time: 69ms, lr: {lr}, "
        "overflow cond: False, loss_scale: 1.0, global_norm: [{norm}], train_throughput_per_npu: 0.001T")
BAR = "  {pct:4.1f}% |                                                  | {thr:.5f} samples/s/p  0:00:13 }}"
GBS_LINE = ("[INFO] 2026-11-29 15:53:07,709 [mindformers/trainer/base_trainer.py:285] "
            "_check_global_batch_size_for_auto_parallel: global_batch_size = batch_size_per_card * device_num "
            "* gradient_accumulation_steps = 4 = 2 * 2 * 1")


def _log(path: Path, steps: int = STEPS) -> None:
    base = time.mktime((2026, 11, 29, 15, 0, 0, 0, 0, -1))
    lines = [GBS_LINE]
    for step in range(1, steps + 1):
        ts = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(base + step)) + ",000"
        loss = "nan" if step == NAN_LOSS else f"{6 - step / 5000:.6f}"
        norm = "inf" if step == INF_NORM else f"{1 + step % 7 / 10:.4f}"
        lines.append(PREFIX.format(ts=ts, line=747) + HEAD.format(step=step, steps=steps, loss=loss,
                                                                  lr=f"{1e-3 * (1 - step / steps):.6g}", norm=norm))
        lines.append(PREFIX.format(ts=ts, line=764) + BAR.format(pct=100 * step / STEPS, thr=20 + step % 13))
    path.parent.mkdir(parents=True)
    path.write_text("\n".join(lines) + "\n")


def test_every_10_keeps_exactly_the_promised_points(tmp_path: Path) -> None:
    _log(tmp_path / "output" / "log" / "rank_0" / "info.log")
    out = tmp_path / "summary"
    assert main(["replay", str(tmp_path / "output"), "--out", str(out), "--quiet", "--no-aggregate",
                 "--every", "10", "--max-event-file-mb", "0.02"]) == 0
    run = out / "rank_0"
    shown = scalars(run)
    alerts = {NAN_LOSS, NAN_LOSS + 1, INF_NORM, INF_NORM + 1}  # each alert's step and its resolution's
    promised = {s for s in range(1, STEPS + 1) if s % 10 == 0} | {1, STEPS} | alerts
    for tag in ("loss", "learning-rate", "grad-norm", "loss-scale", "iteration-time", "throughput", "batch-size"):
        assert set(shown[tag]) == promised, tag
    assert math.isnan(shown["loss"][NAN_LOSS]) and math.isinf(shown["grad-norm"][INF_NORM])
    assert shown["loss"][5000] == 5.0
    twins = scalars(run / "vs_samples")
    assert set(twins["loss_vs_samples"]) == {4 * s for s in promised}
    files = sorted(run.glob("*tfevents*"))
    assert len(files) > 1 and all(f.stat().st_size < 0.02 * (1 << 20) + 1024 for f in files)  # rolled at the limit


def test_a_held_last_point_of_a_superseded_segment_is_not_written(tmp_path: Path) -> None:
    log = tmp_path / "output" / "log" / "rank_0" / "info.log"
    _log(log, 120)
    lines = log.read_text().splitlines()
    head = lines[: 1 + 2 * 118]  # start-up line, steps 1-118
    again = [line.replace("2026-11-29", "2026-11-30") for line in lines[1 + 2 * 49: 1 + 2 * 105]]  # resumed: 50-105
    log.write_text("\n".join(head + again) + "\n")
    out = tmp_path / "summary"
    assert main(["replay", str(tmp_path / "output"), "--out", str(out), "--quiet", "--no-aggregate", "--every", "10"]) == 0
    assert sorted(scalars(out / "rank_0")["loss"]) == [1, *range(10, 101, 10), 105]  # not 118 of the old segment
