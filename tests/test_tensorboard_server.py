"""End to end through the real TensorBoard server on 127.0.0.1: what a user's browser would get.

Both of TensorBoard's loaders are checked (the Rust data server, ``--load_fast=true``, and the
Python one, ``--load_fast=false``): each must show every step once, including across a training
resume, where the resumed values replace the stale ones instead of zig-zagging.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from live_helpers import poll
from sidecar.cli import main

VERSIONS = Path(__file__).parent / "fixtures" / "versions"
HEAD = ("[INFO] 2026-11-29 10:{m:02d}:{s:02d},000 [mindformers/core/callback/callback.py:747] print_output_info: "
        "{{ Epoch:[  1/  1], step:[{step:5d}/  100], loss: {loss:.6f}, per_step_time: 500ms, lr: 1e-05, "
        "overflow cond: False, loss_scale: 1.0, global_norm: [0.5]")
BAR = ("[INFO] 2026-11-29 10:{m:02d}:{s:02d},001 [mindformers/core/callback/callback.py:764] print_output_info: "
       "  10.0% |█████      | 4.00000 samples/s/p  0:01:00 }}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> object:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def _scalars(port: int, run: str, tag: str, want: int, deadline: float) -> list[list[float]]:
    url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?run={run}&tag={tag}"
    points = poll(lambda: _get(url), lambda got: len(got) >= want, deadline - time.monotonic(),
                  (OSError, json.JSONDecodeError))[1]
    return points or []  # type: ignore[return-value]


def _write_resumed_log(path: Path) -> None:
    """Steps 1..10, then training resumes from a checkpoint at step 6 and runs to 12 (loss + 100)."""
    lines = []
    second = 0
    for segment, steps in ((0, range(1, 11)), (100, range(6, 13))):
        for step in steps:
            second += 1
            stamp = {"m": second // 60, "s": second % 60}
            lines += [HEAD.format(step=step, loss=segment + step / 10, **stamp), BAR.format(**stamp)]
    path.parent.mkdir(parents=True)
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tb")
    shutil.copytree(VERSIONS / "v1.9.0-graph" / "output", root / "logs" / "graph")
    _write_resumed_log(root / "logs" / "resumed" / "rank_7" / "info.log")
    out = root / "summary"
    assert main(["replay", str(root / "logs"), "--out", str(out), "--quiet"]) == 0
    assert main(["replay", str(root / "logs"), "--out", str(out), "--quiet"]) == 0  # idempotent
    return out


@pytest.mark.parametrize("load_fast", ["true", "false"])
def test_tensorboard_serves_each_step_once_with_exact_values(summary: Path, load_fast: str) -> None:
    expected = json.loads((VERSIONS / "v1.9.0-graph" / "expected.json").read_text())["ranks"]
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(summary), "--host", "127.0.0.1",
         "--port", str(port), f"--load_fast={load_fast}", "--reload_interval=1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 90
        for rank in ("0", "1"):
            want = expected[rank]["loss"]
            got = _scalars(port, f"rank_{rank}", "loss", len(want), deadline)
            assert [int(p[1]) for p in got] == [s for s, _ in want], f"rank {rank}: steps as served"
            for (_, step, value), (_, truth) in zip(got, want):
                assert float(value) == pytest.approx(float(truth), rel=1e-6, nan_ok=True), (rank, step)
        resumed = _scalars(port, "rank_7", "loss", 12, deadline)
        assert [int(p[1]) for p in resumed] == list(range(1, 13))
        assert [round(p[2], 4) for p in resumed] == [round(s / 10, 4) for s in range(1, 6)] + [
            round(100 + s / 10, 4) for s in range(6, 13)
        ]
        runs = _get(f"http://127.0.0.1:{port}/data/runs")
        assert set(runs) >= {"rank_0", "rank_1", "rank_7"}  # type: ignore[arg-type]
        assert any(r.startswith("aggregate/") for r in runs)  # type: ignore[union-attr]
        layout = _get(f"http://127.0.0.1:{port}/data/plugin/custom_scalars/layout")
        loss = layout["category"][0]  # type: ignore[index]
        assert [loss["title"]] + [chart["title"] for chart in loss["chart"]] == [
            "loss", "loss (all ranks)", "loss (mean, min-max band)"]
    finally:
        server.terminate()
        server.wait(timeout=30)
