"""One stream carrying 4 interleaved ranks, labelled by srun, OpenMPI or tail -f, split into exact per-rank runs
plus a cross-rank aggregate run; in replay and live."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.cli import main
from live_helpers import paced, wait_until
from tb_read import raw_points, same_float32, scalars, texts

RANKS = 4
STEPS = 30
HEAD = ("2026-11-29 10:{m:02d}:{s:02d},{ms:03d} - mindformers/job/output/log[mindformers/core/callback/callback.py:747]"
        " - INFO - {{ Epoch:[  1/  1], step:[{step:5d}/  100], loss: {loss:.6f}, per_step_time: {ms_step}ms, "
        "lr: 1e-05, overflow cond: False, loss_scale: 1.0, global_norm: [0.5]")
BAR = ("2026-11-29 10:{m:02d}:{s:02d},{ms:03d} - mindformers/job/output/log[mindformers/core/callback/callback.py:764]"
       " - INFO -   10.0% |█████      | {tput:.5f} samples/s/p  0:01:00 }}")


def loss(rank: int, step: int) -> float:
    return round(5.0 - step * 0.01 + rank * 0.25, 6)


def rank_lines(rank: int) -> list[str]:
    lines = []
    for step in range(1, STEPS + 1):
        t = step * 2
        stamp = {"m": t // 60, "s": t % 60}
        lines.append(HEAD.format(step=step, loss=loss(rank, step), ms_step=500 + rank * 10, ms=rank, **stamp))
        if step % 7 == 0:
            lines += ["Traceback (most recent call last):", '  File "x.py", line 3, in <module>', "ValueError: not fatal"]
        lines.append(BAR.format(tput=4.0 + rank, ms=rank + 1, **stamp))
    return lines


def interleave(label: str, seed: int) -> list[str]:
    """Merge the ranks' lines in a random order that keeps each rank's own order."""
    rng = random.Random(seed)
    queues = {r: rank_lines(r) for r in range(RANKS)}
    out: list[str] = []
    last = None
    while any(queues.values()):
        rank = rng.choice([r for r, q in queues.items() if q])
        line = queues[rank].pop(0)
        if label == "srun":
            out.append(f"{rank}: {line}")
        elif label == "srun-padded":
            out.append(f"{rank:2d}: {line}")
        elif label == "mpi":
            out.append(f"[1,{rank}]<stdout>:{line}")
        else:  # tail -f over the worker logs
            if rank != last:
                out += ["", f"==> output/msrun_log/worker_{rank}.log <=="]
            out.append(line)
        last = rank
    return out


def check_ranks(out: Path) -> None:
    for rank in range(RANKS):
        shown = scalars(out / f"rank_{rank}")
        assert sorted(shown["loss"]) == list(range(1, STEPS + 1))
        for step in range(1, STEPS + 1):
            assert same_float32(shown["loss"][step], loss(rank, step))
            assert shown["throughput"][step] == 4.0 + rank  # the bar joined the right head
            assert shown["iteration-time"][step] == 500 + rank * 10
        assert max(raw_points(out / f"rank_{rank}").values()) == 1


def aggregate_run(out: Path) -> Path:
    (run,) = (out / "aggregate").iterdir()
    return run


def check_aggregate(out: Path) -> None:
    agg = scalars(aggregate_run(out))
    for step in range(1, STEPS + 1):
        values = [loss(r, step) for r in range(RANKS)]
        assert agg["loss/mean"][step] == pytest.approx(sum(values) / RANKS, rel=1e-6)
        assert same_float32(agg["loss/min"][step], min(values))
        assert same_float32(agg["loss/max"][step], max(values))
        assert agg["iteration-time/slowest-rank"][step] == RANKS - 1
        assert agg["iteration-time/spread"][step] == (RANKS - 1) * 10
    (layout,) = (out / "layout").iterdir()
    assert "custom_scalars__config__" in texts(layout)


@pytest.mark.parametrize("label", ["srun", "srun-padded", "mpi", "tail"])
def test_replay_splits_a_labelled_stream_into_exact_rank_runs_and_an_aggregate(label: str, tmp_path: Path) -> None:
    log = tmp_path / "job.out"
    log.write_text("\n".join(interleave(label, seed=len(label))) + "\n")
    assert main(["replay", str(log), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    check_ranks(tmp_path / "out")
    check_aggregate(tmp_path / "out")


def test_user_rank_pattern(tmp_path: Path) -> None:
    log = tmp_path / "job.out"
    log.write_text("\n".join(line.replace("[1,", "<node0 r").replace("]<stdout>:", "> ", 1)
                             for line in interleave("mpi", 3)) + "\n")
    assert main(["replay", str(log), "--out", str(tmp_path / "out"), "--quiet",
                 "--rank-pattern", r"^<node0 r(?P<rank>\d+)> "]) == 0
    check_ranks(tmp_path / "out")


def test_live_split_of_a_growing_labelled_stream(tmp_path: Path) -> None:
    log = tmp_path / "job.out"
    log.touch()
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "sidecar.cli", "--watch", str(log), "--out", str(out), "-q"])
    try:
        lines = interleave("srun", seed=11)
        with log.open("a") as fh:
            for i in paced(range(0, len(lines), 17), 0.02):
                fh.write("\n".join(lines[i:i + 17]) + "\n")
                fh.flush()
        runs = [out / f"rank_{r}" for r in range(RANKS)]
        wait_until(lambda: all(r.exists() and len(scalars(r).get("throughput", {})) == STEPS for r in runs), 20,
                   "every rank's steps")
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0
    check_ranks(out)
    check_aggregate(out)
