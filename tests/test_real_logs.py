"""Genuine mindformers 1.9 logs (CPU runs of the ``tests/mindformers_run`` recipe) against mindformers' own
TensorBoard output from the same runs, stored as ``tensorboard_truth.json`` beside the logs.

The live version of this check, which trains the model while the sidecar follows, is the
``mindformers`` tier (``tests/test_mindformers_live.py``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fidelity import COMPARED_TAGS, DERIVED_TAGS, compare_run, load_truth
from sidecar.cli import main
from tb_read import raw_points, scalars

REAL = Path(__file__).parent / "fixtures" / "real"
RUNS = ["mf1.9-single", "mf1.9-dp2", "mf1.9-pynative", "mf1.9-diverge", "mf1.9-diverge-fp16", "mf1.9-ckpt"]


def _replay(src: Path, out: Path) -> None:
    assert main(["replay", str(src), "--out", str(out), "--quiet"]) == 0


@pytest.mark.parametrize("run", RUNS)
def test_replay_matches_mindformers_own_tensorboard(run: str, tmp_path: Path) -> None:
    truth = load_truth(REAL / run / "tensorboard_truth.json")
    out = tmp_path / "summary"
    _replay(REAL / run / "output", out)
    for rank, tags in truth.items():
        result = compare_run(out / rank, tags, COMPARED_TAGS + DERIVED_TAGS)
        assert result.ok(), "\n".join(result.mismatches[:20])
        assert result.points["loss"] == len(tags["loss"]) > 0
        for tag in ("batch-size", "loss_vs_samples", "learning-rate_vs_samples", "B-samples-per-day"):
            assert result.points[tag] == len(tags[tag]) > 0, tag


def test_log_dir_alone_and_whole_output_with_worker_logs_give_the_same_points(tmp_path: Path) -> None:
    src = REAL / "mf1.9-dp2" / "output"
    _replay(src / "log", tmp_path / "log_only")
    _replay(src, tmp_path / "everything")
    for rank in ("rank_0", "rank_1"):
        assert scalars(tmp_path / "log_only" / rank) == scalars(tmp_path / "everything" / rank)
        assert raw_points(tmp_path / "log_only" / rank) == raw_points(tmp_path / "everything" / rank)


def test_worker_logs_alone_give_the_same_points(tmp_path: Path) -> None:
    src = REAL / "mf1.9-dp2" / "output"
    _replay(src / "log", tmp_path / "log_only")
    _replay(src / "msrun_log", tmp_path / "workers")
    for rank in ("rank_0", "rank_1"):
        assert scalars(tmp_path / "log_only" / rank) == scalars(tmp_path / "workers" / rank)


def test_real_nan_loss_comes_through_as_nan(tmp_path: Path) -> None:
    _replay(REAL / "mf1.9-diverge-fp16" / "output", tmp_path / "out")
    loss = scalars(tmp_path / "out" / "rank_0")["loss"]
    assert sum(v != v for v in loss.values()) > 0


def test_crashed_run_keeps_what_was_logged(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    shutil.copytree(REAL / "mf1.9-crash-noclip", logs)
    _replay(logs, tmp_path / "out")
    shown = scalars(tmp_path / "out" / "rank_0")
    assert shown["loss"] and "grad-norm" not in shown  # `global_norm: None` is no value
