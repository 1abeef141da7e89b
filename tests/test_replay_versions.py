"""Replay every mindformers version's multi-rank log tree and read the runs back with TensorBoard.

The trees in ``tests/fixtures/versions`` are rendered from mindformers' own format strings, with an
``expected.json`` of every (rank, tag, step, value) a correct parser must produce. Replaying twice
into the same ``--out`` must add nothing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sidecar.cli import main
from tb_read import raw_points, same_float32, scalars

VERSIONS = Path(__file__).parent / "fixtures" / "versions"
TREES = sorted(p.name for p in VERSIONS.iterdir() if (p / "expected.json").exists())


def _expected(tree: str) -> dict[str, dict[str, dict[int, float]]]:
    data = json.loads((VERSIONS / tree / "expected.json").read_text())
    return {
        rank: {tag: {int(step): float(value) for step, value in points} for tag, points in tags.items()}
        for rank, tags in data["ranks"].items()
    }


def test_every_version_has_a_tree() -> None:
    assert len(TREES) >= 18


@pytest.mark.parametrize("tree", TREES)
def test_replay_gives_exact_values_at_global_steps_twice_without_duplicates(tree: str, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    shutil.copytree(VERSIONS / tree, logs)
    out = tmp_path / "summary"
    expected = _expected(tree)

    assert main(["replay", str(logs), "--out", str(out), "--quiet"]) == 0
    first = {rank: raw_points(out / f"rank_{rank}") for rank in expected}
    assert main(["replay", str(logs), "--out", str(out), "--quiet"]) == 0

    assert sorted(p.name for p in out.iterdir() if p.name.startswith("rank_")) == sorted(
        f"rank_{r}" for r in expected
    )
    for rank, tags in expected.items():
        run = out / f"rank_{rank}"
        shown = scalars(run)
        for tag, points in tags.items():
            assert tag in shown, f"rank {rank}: tag {tag} missing"
            assert shown[tag].keys() == points.keys(), f"rank {rank} {tag}: steps differ"
            for step, value in points.items():
                assert same_float32(shown[tag][step], value), (rank, tag, step, shown[tag][step], value)
        extra = set(shown) - set(tags)
        assert not extra, f"rank {rank}: unexpected scalar tags {extra}"
        raw = raw_points(run)
        assert raw == first[rank], f"rank {rank}: the second replay wrote something"
        assert max(raw.values()) == 1, f"rank {rank}: a (tag, step) is in the files twice"
