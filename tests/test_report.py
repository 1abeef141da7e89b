"""The replay summary: fits 100 columns, lists every tag, explains its columns, counts resumes per rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.cli import main
from test_tensorboard_display import DP2, HEAD, BAR

VERSIONS = Path(__file__).parent / "fixtures" / "versions"


@pytest.fixture(autouse=True)
def short_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--out`` relative, as a user types it: the summary names it, and it is the user's width."""
    monkeypatch.chdir(tmp_path)


def replay(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    assert main(["replay", *args]) == 0
    return capsys.readouterr().out.splitlines()


def test_the_bundled_example_fits_100_columns_and_explains_itself(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = replay(capsys, str(DP2), "--out", "out")
    assert max(map(len, lines)) <= 100, "\n".join(lines)
    assert lines[1].split() == ["rank", "steps", "first", "last", "tags", "not", "written"]
    assert lines[2].split() == ["0", "200", "1", "200", "12", "203", "dup"]
    assert lines[3].split() == ["1", "200", "1", "200", "12", "203", "dup"]
    text = " ".join(line.strip() for line in lines)
    assert ("ranks 0-1: r0.7+ graph trainer; tags: loss, learning-rate, grad-norm, loss-scale, iteration-time, "
            "throughput, model-flops-throughput-per-npu, B-samples-per-day, batch-size, events/compile, events/training-over, "
            "events/training-start") in text  # every tag, none cut off
    assert "columns: steps = step records written; first, last = global steps; tags = " in text
    assert "not written, by reason: 406 duplicate (dup = duplicate: a copy of a record already written)" in text


def test_many_formats_and_tags_still_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = replay(capsys, str(VERSIONS), "--out", "out")
    assert max(map(len, lines)) <= 100, "\n".join(lines)
    text = " ".join(line.strip() for line in lines)
    assert "+" not in text.replace("r0.7+", "").replace("v1.9+", "")  # no "+3 more"
    assert "local_norm/* (" in text and "mtp-1-loss" in text


def write_resumed(path: Path, back_to: list[int]) -> None:
    """Steps 1..10, then for each entry training resumes at that step and runs 5 steps on."""
    steps = list(range(1, 11))
    for start in back_to:
        steps += range(start, start + 5)
    path.parent.mkdir(parents=True)
    with open(path, "w") as fh:
        for second, step in enumerate(steps):
            fh.write(HEAD.format(s=second % 60, step=step, loss=step, norm="") + "\n" + BAR.format(s=second % 60) + "\n")


def test_resumes_are_counted_per_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for rank in (0, 1):
        write_resumed(tmp_path / "one" / f"rank_{rank}" / "info.log", [6])
    text = " ".join(replay(capsys, str(tmp_path / "one"), "--out", "out1"))
    assert "training resumed: ranks 0-1 once each (superseded points are hidden by TensorBoard)" in text

    write_resumed(tmp_path / "mixed" / "rank_0" / "info.log", [6])
    write_resumed(tmp_path / "mixed" / "rank_1" / "info.log", [6, 3])
    text = " ".join(replay(capsys, str(tmp_path / "mixed"), "--out", "out2"))
    assert "training resumed: rank 0 once; rank 1 twice (" in text
