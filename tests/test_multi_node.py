"""Multi-node pattern: one sidecar per node, each following its node's ranks, all writing into one
shared ``--out``. Nothing may collide: rank runs, checkpoints and aggregate runs are per node."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

from live_helpers import wait_until
from tb_read import raw_points, scalars

REAL = Path(__file__).parent / "fixtures" / "real" / "mf1.9-dp2" / "output" / "log"


def _node_trees(tmp_path: Path) -> dict[str, Path]:
    """Two "nodes", each with one rank of the genuine dp2 run in its own job directory."""
    nodes = {}
    for node, rank in (("node0", 0), ("node1", 1)):
        root = tmp_path / node / "output" / "log"
        root.mkdir(parents=True)
        shutil.copytree(REAL / f"rank_{rank}", root / f"rank_{rank}")
        nodes[node] = root
    return nodes


def _check(shared: Path, reference: Path) -> None:
    """Per-node checkpoints and aggregates; rank runs exactly as one sidecar replaying all ranks."""
    subprocess.run([sys.executable, "-m", "sidecar.cli", "replay", str(REAL), "--out", str(reference), "-q"],
                   check=True, timeout=120)
    assert sorted(p.name for p in (shared / ".mstb-sidecar").glob("state-*.json")) == [
        "state-node0.json", "state-node1.json"]
    assert sorted(p.name for p in (shared / "aggregate").iterdir()) == ["node0", "node1"]
    for rank in ("rank_0", "rank_1"):
        assert scalars(shared / rank) == scalars(reference / rank)
        assert max(raw_points(shared / rank).values()) == 1


def _sidecars(nodes: dict[str, Path], shared: Path, mode: str) -> list[subprocess.Popen[bytes]]:
    """One sidecar per node (``mode`` is ``replay`` or ``--watch``), all into ``shared``."""
    return [
        subprocess.Popen([sys.executable, "-m", "sidecar.cli", mode, str(root), "--out", str(shared),
                          "--instance", node, "-q"])
        for node, root in nodes.items()
    ]


def test_two_sidecars_replaying_into_one_out_do_not_collide(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    procs = _sidecars(_node_trees(tmp_path), shared, "replay")
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    _check(shared, tmp_path / "reference")


def test_two_live_sidecars_share_one_out(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    procs = _sidecars(_node_trees(tmp_path), shared, "--watch")
    try:
        runs = [shared / "rank_0", shared / "rank_1"]
        wait_until(lambda: all(r.exists() and len(scalars(r).get("loss", {})) == 200 for r in runs), 60,
                   "both nodes' 200 steps")
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        assert [p.wait(timeout=30) for p in procs] == [0, 0]
    _check(shared, tmp_path / "reference")
